"""Bad input as a user meets it, through the real `driftlab` entry point (`driftlab.cli.main`,
in a process of its own: see the `commands` fixture).

Every case must: exit with code 2, print one "Error: ..." line (and at most one "Hint: ..."
line) on stderr and nothing on stdout, show no traceback, and change nothing on disk (the
case's scratch directory, which is also its working directory, and the model cache).

To add a case, append a `Case` row to CASES. `argv`, `env` values and `stdin` may use these
placeholders, filled from the case's scratch directory:

    {ws}             the scratch directory (also the working directory)
    {bad_utf8}       a persona file (.jsonl) written in Latin-1, not UTF-8
    {cache_file}     a regular file (to point DRIFTLAB_CACHE at)
    {ro_dir}         a directory nobody can write to (case skipped where none exists)
    {corrupt_model}  a copy of the default model whose model.safetensors is truncated
                     (only for `model=True` cases: it needs the pulled model)

Unless a case sets it, DRIFTLAB_CACHE is `{ws}/cache` (which must stay absent) for fast cases
and the real cache for `model=True` cases; pip is pointed at a dead index, so no case can
reach the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import CommandServer, linked_copy, unwritable_dir


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    expect: tuple[str, ...]  # substrings of the "Error:" line (whitespace-normalised)
    env: Mapping[str, str] = field(default_factory=dict)
    hint: str | None = None  # substring of the "Hint:" line, if one is expected
    stdin: bytes | None = None
    model: bool = False  # needs the pulled default model (or loads one): marked `model`
    xfail: str | None = None  # a known gap: the reason, until someone fixes it


LATIN1 = "latin1-personas.jsonl"
NOT_UTF8 = ("is not UTF-8", LATIN1)
CACHE_HINT = "DRIFTLAB_CACHE"
DEVICES = "auto, cpu, cuda"

PROFILE = str(Path(__file__).resolve().parents[1] / "docs/results/pasta-smollm2/profile-json/profile.json")
HEAD_CONFIG = str(Path(__file__).resolve().parents[1] / "docs/results/pasta-smollm2/heads.json")
PRONOUN_PROFILE = str(Path(__file__).resolve().parents[1] / "docs/results/pasta-smollm2/profile-pronouns/profile.json")

CASES = [
    # -- text that looks like rich markup is printed as is, never parsed
    Case("score-id-closing-tag", ("personas", "score", "[/bold]", "hi"), ("no persona with id '[/bold]'",)),
    Case("score-id-brackets", ("personas", "score", "x[a-z]", "hi"), ("no persona with id 'x[a-z]'",)),
    Case("list-category-markup", ("personas", "list", "--category", "[red]x"), ("unknown category '[red]x'",)),
    # -- persona files and stdin that are not UTF-8
    Case("list-file-latin1", ("personas", "list", "--file", "{bad_utf8}"), NOT_UTF8, hint="UTF-8"),
    Case("score-file-latin1", ("personas", "score", "reply-in-french", "hi", "--file", "{bad_utf8}"), NOT_UTF8),
    Case("score-stdin-latin1", ("personas", "score", "reply-in-french", "-"), ("standard input is not UTF-8",),
         stdin="Très bien, merci.".encode("latin-1")),
    # -- models
    Case("models-list-format", ("models", "list", "--format", "xml"), ("Unknown --format 'xml'",),
         hint="--format json"),
    Case("warm-batch-not-numbers", ("models", "warm", "--batch", "1,x"), ("--batch '1,x' is not a list of batch sizes",),
         hint="--batch 1,2,4,8"),
    Case("warm-batch-zero", ("models", "warm", "--batch", "0,4"), ("--batch '0,4' is not a list of batch sizes",)),
    Case("warm-batch-empty", ("models", "warm", "--batch", ""), ("--batch '' is not a list of batch sizes",)),
    Case("pull-cache-is-file", ("models", "pull", "smollm2-135m"), ("DRIFTLAB_CACHE={cache_file}", "is a file"),
         env={"DRIFTLAB_CACHE": "{cache_file}"}, hint=CACHE_HINT),
    Case("pull-cache-under-file", ("models", "pull", "smollm2-135m"), ("lies under {cache_file}", "is a file"),
         env={"DRIFTLAB_CACHE": "{cache_file}/driftlab"}, hint=CACHE_HINT),
    Case("pull-cache-read-only", ("models", "pull", "smollm2-135m"), ("DRIFTLAB_CACHE={ro_dir}", "not writable"),
         env={"DRIFTLAB_CACHE": "{ro_dir}"}, hint=CACHE_HINT),
    Case("pull-cache-read-only-subdir", ("models", "pull", "qwen2.5-coder-0.5b"), ("not writable",),
         env={"DRIFTLAB_CACHE": "{ro_dir}/driftlab"}, hint=CACHE_HINT),
    # the automatic pull of the default model (run needs a model; device and dtype pass first;
    # test_assets.py checks the read-only variants through resolve_model)
    Case("auto-pull-cache-is-file", ("run", "--out", "{ws}/run", "--device", "cpu"), ("is a file",),
         env={"DRIFTLAB_CACHE": "{cache_file}"}, hint=CACHE_HINT),
    # -- devices torch knows but driftlab cannot run on (refused before any model is loaded or
    #    pulled; the other device names are checked in-process below, without a CLI start-up
    #    that imports transformers)
    Case("device-meta", ("run", "--out", "{ws}/run", "--device", "meta"), ("Device 'meta' is not supported",),
         hint=DEVICES),
    Case("device-mps", ("run", "--out", "{ws}/run", "--device", "mps"), ("Device 'mps'", "not available"),
         hint=DEVICES, xfail="an Apple GPU is there" if sys.platform == "darwin" else None),
    Case("decay-device-meta", ("decay", "--out", "{ws}/decay", "--device", "meta"),
         ("Device 'meta' is not supported",)),
    # -- Hugging Face Hub ids (tests/test_hub.py has the hub's own answers, from a local server)
    Case("run-hub-id-malformed", ("run", "--out", "{ws}/run", "--model", "org/na me"),
         ("Invalid --model org/na me", "is not a valid Hugging Face Hub id")),
    Case("user-model-hub-id-malformed", ("run", "--out", "{ws}/run", "--user-model", "org/name@"),
         ("Invalid --user-model org/name@", "must be followed by a revision")),
    Case("decay-compare-hub-id-malformed", ("decay", "--out", "{ws}/decay", "--compare", "x--y/z"),
         ("Invalid --compare", "is not a valid Hugging Face Hub id")),
    Case("run-hub-offline-not-cached", ("run", "--out", "{ws}/run", "--model", "some-org/not-cached", "--device", "cpu"),
         ("'some-org/not-cached' is not in the Hugging Face cache ({ws}/hf/hub)", "HF_HUB_OFFLINE is set"),
         env={"HF_HOME": "{ws}/hf", "HF_HUB_OFFLINE": "1"}, hint="driftlab models pull some-org/not-cached"),
    # -- placement: device maps and quantisation
    Case("device-map-bad-json", ("run", "--out", "{ws}/run", "--device-map", "{{model"), ("Invalid --device-map",),
         hint="--help"),
    Case("device-map-bad-device", ("chat", "--device-map", '{{"model.layers.0": "tpu"}}', "hi"),
         ("Invalid --device-map", "'tpu' of module 'model.layers.0'")),
    Case("quantize-3bit", ("run", "--out", "{ws}/run", "--quantize", "3bit"),
         ("Invalid --quantize 3bit", "use one of 8bit, 4bit")),
    Case("quantize-remote", ("chat", "--model", "openai:gpt-x", "--quantize", "4bit", "hi"),
         ("--quantize places a local model's weights",)),
    # -- damaged model files and files only read after the model is loaded
    Case("run-corrupt-weights", ("run", "--model", "{corrupt_model}", "--out", "{ws}/run", "--device", "cpu"),
         ("{corrupt_model}/model.safetensors", "truncated or corrupt"),
         hint="driftlab models pull smollm2-135m --force", model=True),
    # -- sampling and run options: validated once (by the models the library uses) before anything
    #    is loaded or written
    Case("run-top-p-zero", ("run", "--out", "{ws}/run", "--top-p", "0"), ("Invalid --top-p 0.0", "greater than 0")),
    Case("chat-top-p-zero", ("chat", "--top-p", "0", "hi"), ("Invalid --top-p 0.0",)),
    Case("run-tiny-temperature", ("run", "--out", "{ws}/run", "--temperature", "1e-45"),
         ("Invalid --temperature", "too small to sample with")),
    Case("run-seed-too-big", ("run", "--out", "{ws}/run", "--seed", str(2**63)), ("Invalid --seed",)),
    Case("chat-seed-negative", ("chat", "--seed", "-1", "hi"), ("Invalid --seed -1",)),
    Case("run-huge-max-new-tokens", ("run", "--out", "{ws}/run", "--max-new-tokens", "1000000000"),
         ("Invalid --max-new-tokens 1000000000", "32768")),
    Case("run-zero-rounds", ("run", "--out", "{ws}/run", "--rounds", "0"), ("Invalid --rounds 0",)),
    Case("run-own-persona-incomplete", ("run", "--out", "{ws}/run", "--system", "Be terse."),
         ("needs --system, --probe and --measure", "--probe, --measure missing")),
    Case("run-own-persona-unknown-measure", ("run", "--out", "{ws}/run", "--system", "x", "--probe", "y",
                                             "--measure", "sentence_cout"), ("Invalid --measure", "sentence_count")),
    Case("run-own-persona-params-not-json", ("run", "--out", "{ws}/run", "--system", "x", "--probe", "y",
                                             "--measure", "sentence_count", "--measure-params", "{{n: 1}}"),
         ("--measure-params is not JSON",)),
    Case("run-own-persona-bad-params", ("run", "--out", "{ws}/run", "--system", "x", "--probe", "y",
                                        "--measure", "sentence_count", "--measure-params", '{{"n": 0}}'),
         ("Invalid --measure-params", "greater than or equal to 1")),
    Case("run-judge-unknown-key", ("run", "--out", "{ws}/run", "--judge", "model=smollm2-135m,colour=red"),
         ("Invalid --judge: colour=red", "extra inputs")),
    Case("run-judge-bad-url", ("run", "--out", "{ws}/run", "--judge", "model=openai:j,base_url=ftp://x"),
         ("judge model 'openai:j'", "not an http(s) URL")),
    Case("run-zero-pairs", ("run", "--out", "{ws}/run", "--pairs", "0"), ("No persona pairs to run",)),
    Case("run-unknown-pair-id", ("run", "--out", "{ws}/run", "--pair", "nope:very-happy"),
         ("no persona with id 'nope'",)),
    Case("run-bad-span", ("run", "--out", "{ws}/run", "--span", "middle"), ("Invalid --span middle",)),
    Case("run-bad-dtype", ("run", "--out", "{ws}/run", "--dtype", "float8"), ("Invalid --dtype float8",)),
    Case("run-bad-probe-after", ("run", "--out", "{ws}/run", "--probe-after", "probe"),
         ("Invalid --probe-after probe", "user, agent")),
    Case("sweep-bad-personas", ("sweep", "--out", "{ws}/sweep", "--personas", "paper"),
         ("Invalid --personas paper: use one of table2, reference",)),
    # -- --steer: one grammar, one-line errors, no silent overwrite
    Case("chat-steer-nan", ("chat", "--steer", "bias:value=nan", "hi"), ("value=nan", "finite number")),
    Case("run-steer-twice", ("run", "--out", "{ws}/run", "--steer", "split-softmax:k=0.9",
                             "--steer", "split-softmax:k=0.5"), ("split-softmax is given 2 times",)),
    Case("run-steer-bad-bool", ("run", "--out", "{ws}/run", "--steer", "bias:value=1,invert=ture"),
         ("invert=ture",)),
    # -- --out that cannot be a run directory
    Case("run-out-is-file", ("run", "--out", "{cache_file}", "--pairs", "1"), ("is a file",)),
    Case("run-out-unwritable", ("run", "--out", "{ro_dir}/run", "--pairs", "1"), ("Cannot write the run directory",)),
    Case("decay-out-is-file", ("decay", "--out", "{cache_file}"), ("is a file",), model=True),
    Case("decay-out-unwritable", ("decay", "--out", "{ro_dir}/decay"), ("Cannot write the run directory",), model=True),
    # -- cheap decay options, checked before any model loads or trace runs
    Case("decay-layer-without-head", ("decay", "--out", "{ws}/d", "--layer", "1"), ("Give both --layer and --head",)),
    Case("decay-layer-out-of-range", ("decay", "--out", "{ws}/d", "--layer", "99", "--head", "0"),
         ("--layer 99 --head 0 is outside smollm2-135m (30 layers x 9 heads)",), model=True),
    Case("decay-unknown-compare", ("decay", "--out", "{ws}/d", "--compare", "no-such-model"),
         ("Unknown model preset 'no-such-model'",), model=True),
    Case("decay-pairs-zero", ("decay", "--out", "{ws}/d", "--pairs", "0"), ("Invalid --pairs 0",)),
    # -- damaged run directories: readers name the line, and never modify the files
    *[Case(f"report-{name}", ("report", f"{{{name}}}"), (message,), hint=hint) for name, (_, _, message, hint) in {
        "run_nul": (None, None, "records.jsonl line 2 is not a valid record", "Remove line 2"),
        "run_latin1": (None, None, "records.jsonl line 2 is not a valid record", "Remove line 2"),
        "run_empty_object": (None, None, "line 2 is not a valid record: Unable to extract tag", "Remove line 2"),
        "manifest_empty": (None, None, "is not a driftlab manifest", None),
        "manifest_list": (None, None, "is not a driftlab manifest", None),
    }.items()],
    # -- remote servers, Ray and driftlab serve: checked before anything connects or loads
    Case("run-base-url-not-http", ("run", "--out", "{ws}/run", "--model", "openai:m", "--base-url", "localhost:8000"),
         ("Invalid --base-url localhost:8000", "not an http(s) URL")),
    Case("run-concurrency-zero", ("run", "--out", "{ws}/run", "--concurrency", "0"), ("Invalid --concurrency 0",)),
    Case("run-actors-zero", ("run", "--out", "{ws}/run", "--ray", "local", "--actors", "0"), ("Invalid --actors 0",)),
    Case("run-openai-without-name", ("run", "--out", "{ws}/run", "--model", "openai:"), ("served model's name",)),
    Case("run-openai-no-key", ("run", "--out", "{ws}/run", "--model", "openai:gpt-4o-mini", "--pairs", "1",
                               "--api-key-env", "DRIFTLAB_NO_SUCH_KEY"), ("$DRIFTLAB_NO_SUCH_KEY is not set",),
         hint="--api-key-env"),
    Case("run-openai-split-softmax", ("run", "--out", "{ws}/run", "--model", "openai:m", "--base-url",
                                      "http://127.0.0.1:9/v1", "--pairs", "1", "--steer", "split-softmax:k=0.5"),
         ("cannot apply --steer split-softmax",), hint="supports: spr"),
    Case("run-openai-with-ray", ("run", "--out", "{ws}/run", "--model", "openai:m", "--ray", "local"),
         ("--ray shards local models",)),
    Case("serve-key-env-unset", ("serve", "--api-key-env", "DRIFTLAB_NO_SUCH_KEY"),
         ("--api-key-env DRIFTLAB_NO_SUCH_KEY: the variable is not set",)),
    Case("serve-openai-model", ("serve", "--model", "openai:x"), ("driftlab serve runs a local model",)),
    Case("serve-bad-steer", ("serve", "--steer", "split-softmax:k=2"), ("k=2",)),
    Case("serve-port-negative", ("serve", "--port", "-1"), ("Invalid --port -1",)),
    Case("serve-graceful-nan", ("serve", "--graceful-timeout", "nan"), ("Invalid --graceful-timeout nan", "finite")),
    Case("serve-empty-name", ("serve", "--served-model-name", ""), ("Invalid --served-model-name",)),
    Case("serve-unknown-host", ("serve", "--host", "nosuchhost.invalid", "--insecure-no-auth"),
         ("Cannot listen on nosuchhost.invalid:8000",)),
    Case("serve-exposed-without-key", ("serve", "--host", "0.0.0.0"),
         ("--host 0.0.0.0 exposes the server", "no API key"), hint="--insecure-no-auth"),
    Case("serve-key-file-missing", ("serve", "--api-key-file", "{ws}/no-key.txt"), ("--api-key-file", "cannot read it")),
    Case("serve-key-env-and-file", ("serve", "--api-key-env", "HOME", "--api-key-file", "{ws}/k.txt"),
         ("--api-key-env and --api-key-file both given",)),
    Case("mmlu-effect-nan", ("mmlu", "--effect", "nan", "--out", "{ws}/m"), ("Invalid --effect nan", "(0, 1]")),
    Case("serve-max-queue-zero", ("serve", "--max-queue", "0"), ("Invalid --max-queue 0",)),
    Case("serve-max-batch-zero", ("serve", "--max-batch", "0"), ("Invalid --max-batch 0",)),
    Case("serve-request-timeout-zero", ("serve", "--request-timeout", "0"), ("Invalid --request-timeout",)),
    Case("serve-prefix-cache-negative", ("serve", "--prefix-cache-mb", "-1"), ("Invalid --prefix-cache-mb",)),
    Case("run-openai-timeout-zero", ("run", "--out", "{ws}/run", "--model", "openai:x", "--timeout", "0"),
         ("Invalid --timeout",)),
    Case("chat-openai-retries-negative", ("chat", "--model", "openai:x", "--max-retries", "-1", "hi"),
         ("Invalid --max-retries -1",)),
    Case("serve-heads-not-name-path", ("serve", "--heads", "heads.json"), ("--heads 'heads.json' is not NAME=PATH",)),
    Case("serve-heads-missing-file", ("serve", "--heads", "json={ws}/missing.json"), ("missing.json does not exist",)),
    Case("serve-heads-bad-name", ("serve", "--heads", "3.1={ws}/h.json"), ("Invalid --heads", "starts with a letter")),
    Case("serve-steer-unregistered-heads", ("serve", "--steer", "pasta:heads=json"),
         ("Cannot read head selection 'json'",)),
    Case("run-ray-empty", ("run", "--out", "{ws}/run", "--ray", ""), ("Invalid --ray",)),
    Case("run-bad-starters", ("run", "--out", "{ws}/run", "--starters", "bogus"), ("Invalid --starters bogus",)),
    Case("run-bad-user-probe-version", ("run", "--out", "{ws}/run", "--user-probe-version", "002"),
         ("Invalid --user-probe-version 002", "use one of own, crafted-or-generic")),
    # -- PASTA
    Case("pasta-eval-unknown-task", ("pasta", "eval", "--task", "poems", "--out", "{ws}/e"), ("Invalid --task poems",)),
    Case("pasta-eval-no-heads", ("pasta", "eval", "--task", "json", "--baseline", "pasta", "--out", "{ws}/e"),
         ("pasta baseline needs heads",), hint="--heads"),
    Case("pasta-eval-bad-baseline", ("pasta", "eval", "--task", "json", "--baseline", "loud", "--out", "{ws}/e"),
         ("Invalid --baseline", "'loud'")),
    Case("pasta-eval-missing-heads-file", ("pasta", "eval", "--task", "json", "--heads", "{ws}/none.json",
                                           "--out", "{ws}/e"), ("none.json does not exist",)),
    Case("pasta-eval-topk-without-profile", ("pasta", "eval", "--task", "json", "--heads", "3.1", "--topk", "2",
                                             "--out", "{ws}/e"), ("topk picks heads from a profile",)),
    Case("pasta-profile-head-in-layers", ("pasta", "profile", "--task", "json", "--layers", "3.1", "--out", "{ws}/p"),
         ("Invalid --layers 3.1", "layers only")),
    Case("pasta-profile-alpha-one", ("pasta", "profile", "--task", "json", "--alpha", "1", "--out", "{ws}/p"),
         ("Invalid --alpha",)),
    Case("pasta-select-missing", ("pasta", "select", "{ws}/nope.json", "--out", "{ws}/h.json"),
         ("nope.json does not exist",)),
    Case("pasta-select-bad-how", ("pasta", "select", "{ws}/nope.json", "--select", "vote", "--out", "{ws}/h.json"),
         ("Unknown head selection 'vote'",)),
    Case("pasta-select-dir-profile", ("pasta", "select", "{ws}", "--out", "{ws}/h.json"), ("is a directory",)),
    Case("pasta-select-unwritable-out", ("pasta", "select", PROFILE, "--out", "{ws}/no/such/dir/h.json"),
         ("Cannot write the head config",)),
    Case("pasta-tune-missing-profile", ("pasta", "tune", "{ws}/nope.json", "--task", "json", "--out", "{ws}/t"),
         ("nope.json does not exist",)),
    Case("pasta-tune-head-config-as-profile", ("pasta", "tune", HEAD_CONFIG, "--task", "json", "--out", "{ws}/t"),
         ("is not a head profile",), hint="--heads"),
    Case("pasta-tune-bad-select", ("pasta", "tune", PROFILE, "--task", "json", "--select", "vote", "--out", "{ws}/t"),
         ("Invalid --select vote",)),
    Case("pasta-tune-topk-zero", ("pasta", "tune", PROFILE, "--task", "json", "--topk", "0", "--out", "{ws}/t"),
         ("Invalid --topk", "at least 1")),
    Case("pasta-tune-empty-intersection", ("pasta", "tune", PROFILE, PRONOUN_PROFILE,
                                           "--task", "json", "--topk", "1", "--out", "{ws}/t"),
         ("No top-k in [1] selects any head",), hint="--select union"),
    Case("pasta-tune-other-model", ("pasta", "tune", PROFILE, "--task", "json", "--model", "qwen2.5-coder-1.5b",
                                    "--out", "{ws}/t"), ("come from smollm2-135m, not qwen2.5-coder-1.5b",)),
    Case("pasta-eval-no-prompt-wording", ("pasta", "eval", "--task", "biasbios", "--prompt", "rephrased",
                                          "--out", "{ws}/e"), ("Task biasbios has no 'rephrased' prompt",)),
    Case("pasta-eval-generate-tokens-on-json", ("pasta", "eval", "--task", "json", "--generate-tokens", "8",
                                                "--out", "{ws}/e"), ("already generates",), hint="--max-new-tokens"),
    Case("pasta-eval-train-split", ("pasta", "eval", "--task", "json", "--split", "train", "--out", "{ws}/e"),
         ("Invalid --split train",)),
    # (refused before the default model is pulled or loaded: the case's own, empty cache stays absent)
    Case("chat-pasta-unclosed-mark", ("chat", "--steer", "pasta:heads=all", "an *open span", "--device", "cpu",
                                      "--dtype", "float32"), ("never closed",), hint="literal marker"),
    Case("pasta-eval-missing-data", ("pasta", "eval", "--task", "json", "--data", "{ws}/nope.jsonl",
                                     "--out", "{ws}/e", "--device", "cpu", "--dtype", "float32"),
         ("nope.jsonl: file not found",), model=True),
    Case("run-persona-file-latin1",
         ("run", "--persona-file", "{bad_utf8}", "--out", "{ws}/run", "--pairs", "1", "--rounds", "1",
          "--device", "cpu", "--dtype", "float32"), NOT_UTF8, model=True),
]


MANIFEST = json.dumps({
    "driftlab_run": 2, "protocol": "selfchat", "completed": True,
    "config": {"rounds": 1, "probe_repeats": 1, "user_probe": False},
    "pairs": [{"pair": 0, "agent": "reply-in-french", "user": "very-happy", "starter": "Hi?"}],
    "conditions": ["persona"], "probe_rounds": [1], "personas": {},
})
GOOD_RECORD = json.dumps({"kind": "turn", "pair": 0, "condition": "persona", "round": 1, "speaker": "agent",
                          "text": "x", "n_tokens": 1, "finish_reason": "stop", "seed": 1}).encode() + b"\n"
BAD_RUNS = {  # placeholder -> (manifest text, the bad second records line)
    "run_nul": (MANIFEST, b"\x00\x00\x00\n"),
    "run_latin1": (MANIFEST, '{"text": "café"}\n'.encode("latin-1")),
    "run_empty_object": (MANIFEST, b"{}\n"),
    "manifest_empty": ("{}", b""),
    "manifest_list": ("[]", b""),
}


def _params():
    for case in CASES:
        marks = [pytest.mark.model] if case.model else []
        if case.xfail:
            marks.append(pytest.mark.xfail(reason=case.xfail, strict=False))
        yield pytest.param(case, id=case.name, marks=marks)


# --------------------------------------------------------------------------- the scratch directory


def _build(case: Case, ws: Path, request) -> dict[str, str]:
    used = " ".join([*case.argv, *case.env.values(), *case.expect])
    values = {"ws": str(ws)}
    if "{bad_utf8}" in used:
        bad = ws / LATIN1
        line = '{"id": "cafe-au-lait", "category": "persona", "system_prompt": "Tu parles d\'un café.", '
        line += '"probe": "Où es-tu ?", "measure": "language", "params": {"lang": "fr"}}\n'
        bad.write_bytes(line.encode("latin-1"))
        values["bad_utf8"] = str(bad)
    if "{cache_file}" in used:
        (ws / "cache-file").write_text("not a directory\n")
        values["cache_file"] = str(ws / "cache-file")
    if "{ro_dir}" in used:
        values["ro_dir"] = str(unwritable_dir(ws, request))
    for name, (manifest, bad_line) in BAD_RUNS.items():
        if "{" + name + "}" in used:
            run = ws / name
            run.mkdir()
            (run / "manifest.json").write_text(manifest)
            (run / "records.jsonl").write_bytes(GOOD_RECORD + bad_line)
            values[name] = str(run)
    if "{corrupt_model}" in used:
        src = Path(request.getfixturevalue("smol_dir"))
        copy = linked_copy(src, ws / "corrupt-model", leave_out="model.safetensors")
        target = copy / "model.safetensors"
        assert not target.exists() and not target.is_symlink()  # never write through to the real file
        with (src / "model.safetensors").open("rb") as fh:
            target.write_bytes(fh.read(1 << 20))
        values["corrupt_model"] = str(copy)
    return values


def _snapshot(*roots: Path) -> dict[str, tuple]:
    """Every path under `roots` with its type and mode, and for files their size and mtime
    (symlinks not followed). Directory mtimes are left out: a command may create and remove
    a scratch entry (a run directory it tidies up on failure); what is left is what counts."""
    state: dict[str, tuple] = {}
    for root in roots:
        if not root.exists() and not root.is_symlink():
            state[str(root)] = ("absent",)
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [".", *dirnames, *filenames]:
                path = Path(dirpath) / name
                st = path.lstat()
                is_dir = path.is_dir() and not path.is_symlink()
                state[str(path)] = (st.st_mode,) if is_dir else (st.st_mode, st.st_size, st.st_mtime_ns)
    return state


# --------------------------------------------------------------------------- the test


# What the cases' commands import, once in the server rather than in each of ~120 forked commands
# (0.1-1.2 s of a CPU each: run and sweep reach the protocols and pandas, report matplotlib, serve
# its web stack). None of them reads a variable a case sets at import: not transformers, whose
# huggingface_hub reads HF_HOME then (run-hub-offline-not-cached sets it).
PRELOAD = ["torch", "driftlab.report.html", "driftlab.protocol.sweep", "driftlab.protocol.decay",
           "driftlab.pasta.evaluate", "driftlab.chat.openai", "openai", "driftlab.serve", "langdetect"]


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """Each case's `driftlab` is a process forked from one server that imported driftlab's entry
    point (driftlab.cli) and PRELOAD once (tests/conftest.py's CommandServer; no case sets a
    variable they read at import), instead of a new interpreter paying those imports: ~0.5 s of
    a CPU per case, ~2 s for the cases that reach torch. What those imports print would be in
    every case's output: it must be nothing."""
    server = CommandServer(tmp_path_factory.mktemp("commands"), PRELOAD)
    assert server.import_output == "", server.import_output
    yield server
    server.close()


@pytest.mark.parametrize("case", list(_params()))  # a list: pytest 10 refuses generators
def test_bad_input_is_one_clean_error(case: Case, tmp_path, request):
    ws = tmp_path / "ws"
    ws.mkdir()
    values = _build(case, ws, request)
    fill = lambda text: text.format(**values)  # noqa: E731

    env = dict(os.environ)
    env.update(
        PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="",
        PIP_EXTRA_INDEX_URL="",
    )  # fmt: skip
    if not case.model:
        env["DRIFTLAB_CACHE"] = str(ws / "cache")
    env.update({k: fill(v) for k, v in case.env.items()})
    from driftlab.assets.store import cache_root

    cache = Path(env["DRIFTLAB_CACHE"]).expanduser() if env.get("DRIFTLAB_CACHE") else cache_root()
    watched = [ws]
    if ws not in cache.parents and cache != ws and not str(cache).startswith(("/sys/", "/proc/")):
        watched.append(cache)  # the real model cache, for model cases

    before = _snapshot(*watched)
    commands = request.getfixturevalue("commands")
    proc = commands.run(list(map(fill, case.argv)), env=env, cwd=ws, stdin=case.stdin or b"")
    stderr, stdout = proc.stderr, proc.stdout

    assert "Traceback" not in stderr, stderr
    assert proc.returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error: ")]
    hints = [line for line in lines if line.startswith("Hint: ")]
    assert len(errors) == 1 and len(hints) <= 1 and len(lines) == len(errors) + len(hints), stderr
    message = " ".join(errors[0].split())
    for want in case.expect:
        assert " ".join(fill(want).split()) in message, stderr
    if case.hint is not None:
        assert hints and fill(case.hint) in hints[0], stderr
    assert stdout.strip() == "", stdout
    after = _snapshot(*watched)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"the failed command changed files on disk: {changed}"


@pytest.mark.parametrize(
    "device, message",
    [
        ("meta", "Device 'meta' is not supported"),
        ("xla", "Device 'xla' is not supported"),
        ("cpu:0", "Device 'cpu:0' is not supported"),
        ("tpu", "Unknown device 'tpu'"),
        ("cuda:x", "Unknown device 'cuda:x'"),
        ("cuda:99", "Device 'cuda:99'"),  # no GPU: "sees no CUDA GPU"; with GPUs: "does not exist"
    ],
)
def test_unusable_devices_are_refused(device, message):
    from driftlab.chat.loading import pick_device
    from driftlab.errors import DriftlabError

    with pytest.raises(DriftlabError) as err:
        pick_device(device)
    assert message in err.value.message
    assert "cuda" in (err.value.hint or "").lower()


def test_mps_only_where_torch_has_it():
    import torch

    from driftlab.chat.loading import pick_device
    from driftlab.errors import DriftlabError

    if torch.backends.mps.is_available():
        assert pick_device("mps").type == "mps"
    else:
        with pytest.raises(DriftlabError, match="'mps' .*not available"):
            pick_device("mps")


def test_usable_devices_resolve():
    import torch

    from driftlab.chat.loading import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        last = torch.cuda.device_count() - 1
        assert pick_device(f"cuda:{last}") == torch.device(f"cuda:{last}")
        assert pick_device("cuda").type == "cuda"


@pytest.mark.parametrize("columns", [None, "60"])
def test_models_list_never_clips_preset_names(columns, tmp_path, commands):
    """`driftlab models list | grep NAME` finds every preset, piped or in a narrow terminal (rich reads
    COLUMNS when it prints, so a command forked from the server meets the job's own)."""
    from driftlab.assets import PRESETS

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["DRIFTLAB_CACHE"] = str(tmp_path)
    if columns:
        env["COLUMNS"] = columns
    proc = commands.run(["models", "list"], env=env)
    assert proc.returncode == 0, proc.stderr
    for name in PRESETS:
        assert any(name in line.split() for line in proc.stdout.splitlines() if "│" in line), (name, proc.stdout)
    assert "…" not in "".join(line.split("│")[1] for line in proc.stdout.splitlines() if line.count("│") > 2)


@pytest.mark.process
@pytest.mark.skipif(getattr(getattr(__import__("torch").backends, "mps", None), "is_available", lambda: False)(),
                    reason="this machine has an Apple GPU")
def test_a_missing_device_or_model_is_refused_before_transformers_is_loaded():
    """The cheap checks come first. A device this machine lacks is refused before transformers is
    imported at all; an unknown model name before the attention engine registers, which imports
    transformers' masking utilities (7 of the 10 s such an error took in a fresh interpreter)."""
    script = """
import sys
from driftlab.chat import BackendSpec
from driftlab.chat.factory import make_backend
from driftlab.errors import DriftlabError
try:
    make_backend(BackendSpec(device="mps"))
except DriftlabError as err:
    print("device", err.message.startswith("Device 'mps'"), "transformers" in sys.modules)
from driftlab.chat.hf import HFChatBackend
try:
    HFChatBackend("no-such-model")
except DriftlabError as err:
    print("model", err.message.startswith("Unknown model preset"), "transformers.masking_utils" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split("\n")[:2] == ["device True False", "model True False"], proc.stdout + proc.stderr[-2000:]
