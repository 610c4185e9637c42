"""Every protocol, killed with SIGKILL mid-run and resumed after its input data changed, finishes
from the plan recorded in its manifest: the same records as an uninterrupted run on the
original data, none twice, none recomputed.

The killed run is a real `driftlab` process that sends itself SIGKILL right after its Nth
durable append to any run directory (a parent's or a nested one), so the kill lands at a
known point between units of work. The resume is a new process too (as a user's would be:
no cache of the old data survives), and so is the reference, the uninterrupted run on the
original data: state the test process carries from earlier tests (torch threads, compiled
kernels) cannot reach it. All three are forked, one per command, from one server process
that imported torch, transformers and driftlab once and ran nothing (tests/conftest.py's
CommandServer): each is still its own process, killed and exiting on its own, without the ~5 s
of imports a new interpreter pays (24 processes: two minutes of a 2-core CPU). The server reads
no data: a child meets the data as it is on disk when the child starts. (KILLER is the same
kill for a command run as its own interpreter: tests/test_directions.py.)

The self-chat, the protocol the others build on, runs on SmolLM2-135M; the other protocols run
on a tiny random Llama (tests/tiny_models.py): what is checked is bookkeeping (the plan, the kill,
the records), not the model, and there a command's forward passes cost milliseconds, not seconds.
"""

from __future__ import annotations

import json
import shutil
import signal
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from driftlab.protocol.registry import protocol_of
from driftlab.records.rundir import RunDir

pytestmark = pytest.mark.model

RAW_MMLU = Path(__file__).parent / "fixtures" / "mmlu_raw_sample.jsonl"
BIOS = Path(__file__).resolve().parents[1] / "src" / "driftlab" / "pasta" / "data" / "biosbias.jsonl"
F32 = ("--dtype", "float32", "--device", "cpu")
REAL_MODEL = "selfchat"  # the one case on SmolLM2-135M; every other on the tiny Llama
TINY_HEADS = 4  # heads per layer of the tiny Llama (3 layers)

KILLER = textwrap.dedent("""
    import os, signal, sys
    from driftlab.records import rundir

    after, calls, append = int(os.environ["KILL_AFTER_APPENDS"]), [0], rundir.RunDir.append

    def append_then_maybe_die(self, records):
        append(self, records)
        calls[0] += bool(records)
        if calls[0] >= after:
            os.kill(os.getpid(), signal.SIGKILL)

    rundir.RunDir.append = append_then_maybe_die
    from driftlab.cli import app
    app(sys.argv[1:], prog_name="driftlab")
""")

@dataclass
class Case:
    args: Callable[[Path], list[str]]  # the command, given the data directory
    prepare: Callable[[Path], None]  # write the data it plans from
    change: Callable[[Path], None]  # change that data after the kill
    kill_after: int  # appends (to any run directory) before SIGKILL
    finished: Callable[[Path, str], None] = lambda out, stdout: None  # what else the resumed command leaves


def _reported(out: Path, stdout: str) -> None:
    assert "report:" in stdout and (out / "report.html").stat().st_size > 10_000


def _swept(out: Path, stdout: str) -> None:
    import pandas as pd

    assert list(pd.read_csv(out / "sweep.csv").spec) == ["plain", "split-softmax:k=0.5,heads=all"]
    assert json.loads((out / "manifest.json").read_text())["points"] == ["", "split-softmax:k=0.5,heads=all"]


def _profiled(out: Path, stdout: str) -> None:
    """What a finished profile leaves: its ranking (the tiny Llama's 4 heads of layer 0, best first,
    with the baseline), its heatmap, and a profile `driftlab pasta select` takes."""
    from typer.testing import CliRunner

    from driftlab.cli import app

    profile = json.loads((out / "profile.json").read_text())
    assert len(profile["scores"]) == TINY_HEADS and profile["baseline"] is not None
    scores = [s for _, _, s in profile["scores"]]
    assert scores == sorted(scores, reverse=True)
    assert (out / "profile.png").stat().st_size > 5000
    selected = CliRunner().invoke(app, ["pasta", "select", str(out / "profile.json"), "--select", "task-specific",
                                        "--topk", "3", "--out", str(out / "heads.json")])
    assert selected.exit_code == 0, selected.output
    heads = json.loads((out / "heads.json").read_text())
    assert sum(len(v) for v in heads.values()) == 3 and set(heads) == {"0"}


def _mmlu_data(d: Path) -> None:
    shutil.copy(RAW_MMLU, d / "mmlu.jsonl")


def _mmlu_change(d: Path) -> None:
    """Every question reworded and every answer moved: a run that read the file again would differ."""
    rows = [json.loads(line) for line in (d / "mmlu.jsonl").read_text().splitlines()]
    for row in rows:
        row["question"] = "Changed: " + row["question"]
        if row.get("correct_answer") in "ABCD":
            row["correct_answer"] = "ABCD"[("ABCD".index(row["correct_answer"]) + 1) % 4]
    (d / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))


def _personas(d: Path, prompt: str = "Always start your reply with Hi.") -> None:
    entry = {"id": "say-hi", "category": "pattern", "system_prompt": prompt, "probe": "Who are you?",
             "measure": "starts_with_word", "params": {"word": "Hi"}}
    (d / "personas.jsonl").write_text(json.dumps(entry) + "\n")


def _logs(d: Path, prefix: str = "") -> None:
    """A user's logs for `driftlab replay`: two conversations, their user turns replayed."""
    convs = [[f"{prefix}Hello! Name a fruit.", f"{prefix}And a vegetable?"], [f"{prefix}What is 2 + 2?"]]
    (d / "logs.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": t} for t in c]}) + "\n"
                                          for c in convs))
    _personas(d)


def _bios(d: Path) -> None:
    shutil.copy(BIOS, d / "bios.jsonl")


def _bios_change(d: Path) -> None:
    """Other rows first (a run drawing its examples again would take others) and every bio longer."""
    rows = [json.loads(line) for line in (d / "bios.jsonl").read_text().splitlines()]
    for row in rows:
        row["bio"] += " This sentence was added after the run started."
    (d / "bios.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))


def _profile_and_bios(d: Path) -> None:
    """The bios and a profile of the tiny Llama (DATA/model: `pasta tune` refuses another model's)."""
    from driftlab.steering.heads import Profile

    _bios(d)
    scores = [(layer, head, -float(layer * TINY_HEADS + head)) for layer in range(3) for head in range(TINY_HEADS)]
    profile = Profile(model=str(d / "model"), task="json", metric="score", alpha=0.01, n=2, scores=scores)
    (d / "profile.json").write_text(profile.model_dump_json())


def _profile_and_bios_change(d: Path) -> None:
    _bios_change(d)
    profile = json.loads((d / "profile.json").read_text())
    profile["scores"] = profile["scores"][::-1]  # another ranking: other head sets
    (d / "profile.json").write_text(json.dumps(profile))


def _source_run(d: Path) -> None:
    """A finished self-chat to replay (scripted: its texts only need to be dialogs)."""
    from driftlab.protocol.runner import run_protocol
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig
    from fakes import ScriptedBackend

    run_protocol(SelfChat(SelfChatConfig(pairs=3, rounds=2, seed=2), ScriptedBackend()), d / "source",
                 progress=False)


def _source_run_change(d: Path) -> None:
    records = (d / "source" / "records.jsonl").read_text().replace("reply ", "changed reply ")
    (d / "source" / "records.jsonl").write_text(records)


# Sizes are kept small, but each still lands its kill mid-run (checked below) and leaves records after
# the kill that a run re-reading the changed data would get otherwise (a fresh run on it differs there).
CASES = {
    "selfchat": Case(lambda d: ["run", "--pair", "say-hi:very-happy", "--pairs", "1", "--rounds", "2",
                                "--max-new-tokens", "4", "--probe-tokens", "4", "--batch-size", "1", "--user-probe", "--persona-file",
                                str(d / "personas.jsonl")],
                     _personas, lambda d: _personas(d, "Always start your reply with Ho."), 3, _reported),
    "replay": Case(lambda d: ["replay", "--conversations", str(d / "logs.jsonl"), "--agents", "say-hi",
                              "--persona-file", str(d / "personas.jsonl"), "--rounds", "2", "--max-new-tokens", "4",
                              "--batch-size", "1"],
                   _logs, lambda d: _logs(d, "Changed: "), 2),
    "mmlu": Case(lambda d: ["mmlu", "--n", "3", "--turn", "2", "--history-tokens", "3", "--batch-size", "1",
                            "--steer", "instaboost:m=3", "--data", str(d / "mmlu.jsonl")],
                 _mmlu_data, _mmlu_change, 3),
    "calibrate": Case(lambda d: ["calibrate", "--method", "spr", "--max-mmlu-drop", "0.5", "--n", "3",
                                 "--turn", "2", "--steps", "1", "--history-tokens", "6", "--data",
                                 str(d / "mmlu.jsonl")],
                      _mmlu_data, _mmlu_change, 4),
    "sweep": Case(lambda d: ["sweep", "--point", "split-softmax:k=0.5", "--pairs", "1", "--rounds", "1",
                             "--max-new-tokens", "3", "--probe-tokens", "3", "--mmlu-n", "2", "--mmlu-turn", "2", "--batch-size", "1",
                             "--data", str(d / "mmlu.jsonl")],
                  _mmlu_data, _mmlu_change, 4, _swept),
    "pasta-eval": Case(lambda d: ["pasta", "eval", "--task", "json", "--n", "2", "--max-new-tokens", "6",
                                  "--baseline", "zero-shot", "--baseline", "pasta", "--heads", "0-1",
                                  "--batch-size", "1", "--data", str(d / "bios.jsonl")],
                       _bios, _bios_change, 2),
    "pasta-profile": Case(lambda d: ["pasta", "profile", "--task", "json", "--n", "1", "--layers", "0",
                                     "--max-new-tokens", "4", "--batch-size", "2", "--data", str(d / "bios.jsonl")],
                          _bios, _bios_change, 1, _profiled),
    "pasta-tune": Case(lambda d: ["pasta", "tune", str(d / "profile.json"), "--task", "json", "--select",
                                  "task-specific", "--topk", "2", "--topk", "9", "--n", "2", "--max-new-tokens", "4",
                                  "--batch-size", "1", "--data", str(d / "bios.jsonl")],
                       _profile_and_bios, _profile_and_bios_change, 3),
    "decay": Case(lambda d: ["decay", "--from-run", str(d / "source"), "--pairs", "3", "--batch-size", "1"],
                  _source_run, _source_run_change, 1),
}


def _all_records(out: Path) -> dict[str, list[str]]:
    """Every run directory under `out` (nested ones too): its records, as sorted JSON lines."""
    return {str(m.parent.relative_to(out)): sorted(json.dumps(r, sort_keys=True) for r in RunDir(m.parent).records())
            for m in sorted(out.rglob("manifest.json"))}


@pytest.fixture(scope="module")
def commands(protocol_commands):
    """The session's command server for protocol commands (tests/conftest.py: shared with
    test_directions.py and test_kl.py, so a worker starts it once)."""
    return protocol_commands


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> Path:
    """A tiny random Llama (3 layers of 4 heads, SmolLM2's tokenizer) for every case but REAL_MODEL's, which
    the test links as DATA/model."""
    return tiny_llama


@pytest.mark.parametrize("name", list(CASES))
def test_killed_run_resumes_from_its_recorded_plan(name, tmp_path, commands, tiny) -> None:
    case = CASES[name]
    data = tmp_path / "data"
    data.mkdir()
    case.prepare(data)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    model = F32
    if name != REAL_MODEL:  # the tiny model, under the data directory (a pasta profile names its model)
        (data / "model").symlink_to(tiny, target_is_directory=True)
        model = ("--model", str(data / "model"), *F32)
    ref = commands.run([*case.args(data), *model, "--out", str(reference)])
    assert ref.returncode == 0, ref.stderr[-2000:]

    killed = commands.run([*case.args(data), *model, "--out", str(resumed)], kill_after=case.kill_after)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    manifest = RunDir(resumed).read_manifest()
    assert manifest.get("protocol") == name and "completed" not in manifest, "the kill did not land mid-run"
    kept = {p: (resumed / p / "records.jsonl").read_bytes() for p in _all_records(resumed)
            if (resumed / p / "records.jsonl").exists()}
    assert any(kept.values())

    case.change(data)  # the data the plan was drawn from is not what it was
    done = commands.run([*case.args(data), *model, "--out", str(resumed)])
    assert done.returncode == 0, done.stderr[-2000:]
    case.finished(resumed, done.stdout)

    assert _all_records(resumed) == _all_records(reference)  # finished from the recorded plan
    for path, before in kept.items():  # nothing written before the kill was rewritten or redone
        assert (resumed / path / "records.jsonl").read_bytes()[: len(before)] == before
    for m in resumed.rglob("manifest.json"):  # every run complete, each record once
        rd = RunDir(m.parent)
        run = rd.read_manifest()
        keys = [r.key for r in rd.records(protocol_of(run).records)]
        assert len(keys) == len(set(keys)) == sum(protocol_of(run).expected(run).values()), m
        assert run["completed"] is True
    if name == "decay":
        a, b = np.load(reference / "decay.npz"), np.load(resumed / "decay.npz")
        assert all(np.array_equal(a[k], b[k]) for k in a.files)
