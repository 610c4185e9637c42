"""Models by Hugging Face Hub id, fully offline: a tiny random model in a hand-built hub cache.

What a user with models in the Hugging Face cache meets: the resolution order (preset, local
directory, Hub id), chat and a self-chat run by id, revision pins, `models list`, the commit
sha in the manifest and a resume that refuses other weights, and every error (malformed id,
offline and not cached, gated, misspelt, missing revision, unreachable hub) as one line that
leaves nothing behind. The hub's answers come from a local HTTP server speaking the hub's
protocol (repo info, tree, file metadata and downloads; status + X-Error-Code for refusals),
through huggingface_hub's real client: nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import PROTOCOL_PRELOAD as PRELOAD
from conftest import CommandServer
from driftlab.assets.hub import HubRef, parse_hub_id
from driftlab.errors import DriftlabError
from fake_hub import FakeHub, fake_hub
from hub_cache import REPO, SHA_MAIN, SHA_V2, build_cache, hub_env, set_ref


# -- the id itself: string rules only ------------------------------------------------------------
@pytest.mark.parametrize("name, ref", [
    ("meta-llama/Llama-2-7b-chat-hf", HubRef("meta-llama/Llama-2-7b-chat-hf")),
    ("Qwen/Qwen2.5-7B-Instruct@main", HubRef("Qwen/Qwen2.5-7B-Instruct", "main")),
    (f"org/m.v1_x@{SHA_V2}", HubRef("org/m.v1_x", SHA_V2)),
    ("org/name@refs/pr/1", HubRef("org/name", "refs/pr/1")),
    ("smollm2-135m", None), ("./org/name", None), ("/abs/org/name", None), ("a/b/c", None), ("~/m", None),
])
def test_parse_hub_id(name: str, ref: HubRef | None) -> None:
    assert parse_hub_id(name) == ref


@pytest.mark.parametrize("name, problem", [
    ("org/na me", "is not org/name"), ("org--x/name", "no '--'"), ("org/name-", "is not org/name"),
    ("org/name@", "must be followed by a revision"), ("org/name@ x", "is not a revision"),
    ("org/name@refs/../../x", "is not a revision"),
    ("preset@v1", "is not org/name"), ("org/" + "n" * 97, "longer than 96"),
])
def test_malformed_ids_are_refused(name: str, problem: str) -> None:
    with pytest.raises(DriftlabError, match="not a valid Hugging Face Hub id") as err:
        parse_hub_id(name)
    assert problem in err.value.message and "org/name@revision" in err.value.hint


def test_a_malformed_id_fails_the_cli_before_torch_is_imported() -> None:
    code = ("import sys\nfrom driftlab.cli.options import backend_spec\nfrom driftlab.errors import DriftlabError\n"
            "try:\n    backend_spec('org/na me', 'auto', 'cpu')\nexcept DriftlabError as e:\n    print(e.message)\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines()[0].startswith("Invalid --model org/na me: 'org/na me' is not a valid Hugging")
    assert proc.stdout.splitlines()[-1] == "False"


# -- a hub cache ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_home")
    build_cache(root)
    return root


@pytest.fixture
def hub(hub_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key, value in hub_env(hub_root).items():
        monkeypatch.setenv(key, value)
    set_ref(hub_root / "hub", REPO, "main", SHA_MAIN)  # a test may move it
    return hub_root


def _full(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def cli(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real `driftlab` entry point in a fresh process (huggingface_hub reads its settings at import)."""
    return subprocess.run([sys.executable, "-m", "driftlab", *args], capture_output=True, text=True, env=_full(env),
                          cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def commands(hub_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CommandServer]:
    """`driftlab` commands on `hub_root`'s cache that load torch, each its own process forked from one
    server (tests/conftest.py). The server starts with hub_env(hub_root), so huggingface_hub's
    import-time settings (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE) are the cli()'s; it reads no ref
    or snapshot, so each command meets the cache as it is on disk when the command starts."""
    server = CommandServer(tmp_path_factory.mktemp("commands"), PRELOAD, _full(hub_env(hub_root)))
    yield server
    server.close()


def one_line_error(proc: subprocess.CompletedProcess, *expect: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("Error: ") and len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    for text in expect:
        assert text in lines[0], lines[0]
    return lines[0]


def tree(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.is_symlink(), p.stat().st_size if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def test_resolution_order_preset_then_directory_then_hub(hub: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from driftlab.assets import model_dir, resolve_model

    snapshots = hub / "hub" / "models--tiny-org--tiny-chat" / "snapshots"
    assert resolve_model("smollm2-135m", auto_pull_default=False) == model_dir("smollm2-135m")
    assert resolve_model(REPO) == snapshots / SHA_MAIN
    assert resolve_model(f"{REPO}@v2") == snapshots / SHA_V2  # a tag
    assert resolve_model(f"{REPO}@{SHA_V2}") == snapshots / SHA_V2  # a commit
    # A local directory named like the id comes first.
    local = tmp_path / REPO
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO) == Path(REPO)


def test_chat_by_hub_id_records_the_commit(hub: Path) -> None:
    """In-process: the backend loads the snapshot and says exactly which weights it holds."""
    import torch

    from driftlab.chat import ChatRequest, Sampling
    from driftlab.chat.hf import HFChatBackend

    main = HFChatBackend(REPO, dtype="float32", device="cpu", prefix_cache_bytes=0)
    pinned = HFChatBackend(f"{REPO}@v2", dtype="float32", device="cpu", prefix_cache_bytes=0)
    assert main.describe()["hub"] == {"id": REPO, "sha": SHA_MAIN, "requested": REPO}
    assert pinned.describe()["hub"] == {"id": REPO, "sha": SHA_V2, "requested": f"{REPO}@v2"}
    assert not torch.equal(next(main.model.parameters()), next(pinned.model.parameters()))
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    (reply,) = main.generate(ChatRequest([conv], Sampling(greedy=True, max_new_tokens=6, ignore_eos=True)))
    assert len(reply.token_ids) == 6


def test_loading_leaves_the_hub_setting_alone(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load never switches the hub off for the rest of the process: a --user-model or a
    --compare model loaded after it may still need a download."""
    from driftlab.chat.hf import HFChatBackend

    monkeypatch.delenv("HF_HUB_OFFLINE")
    snapshot = hub / "hub" / "models--tiny-org--tiny-chat" / "snapshots" / SHA_MAIN
    HFChatBackend(str(snapshot), dtype="float32", device="cpu")  # a directory: no hub involved
    assert "HF_HUB_OFFLINE" not in os.environ


@pytest.mark.model  # a whole protocol, four CLI processes (forked)
def test_cli_chat_and_selfchat_run_by_hub_id_and_resume_refuses_changed_weights(hub: Path, tmp_path: Path,
                                                                                commands: CommandServer) -> None:
    proc = commands.run(["chat", "--model", REPO, "--device", "cpu", "--dtype", "float32", "--greedy",
                         "--max-new-tokens", "4", "Hello"])
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "run"
    run = ("run", "--model", REPO, "--out", str(out), "--device", "cpu", "--dtype", "float32", "--pairs", "1",
           "--rounds", "1", "--max-new-tokens", "3", "--probe-tokens", "3", "--no-report")
    proc = commands.run(run)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["completed"] is True
    assert manifest["config"]["backend"]["model"] == REPO
    for role in ("agent", "user"):
        assert manifest["models"][role]["hub"] == {"id": REPO, "sha": SHA_MAIN, "requested": REPO}
    # The branch moves to other weights: the run refuses to continue on them, and is left as it was.
    set_ref(hub / "hub", REPO, "main", SHA_V2)
    before = tree(out)
    line = one_line_error(commands.run(run), f"at commit {SHA_MAIN}", f"now loads commit {SHA_V2}")
    assert "agent model" in line
    assert tree(out) == before
    # Pinned to the recorded commit, it is the same run again.
    pinned = list(run)
    pinned[2] = f"{REPO}@{SHA_MAIN}"
    proc = commands.run(pinned)
    assert proc.returncode == 0, proc.stderr


def test_models_list_shows_cached_causal_lms(hub: Path, commands: CommandServer) -> None:
    """(Each command forked from the server on `hub`'s cache: cli()'s environment, COLUMNS added.)"""
    cli = lambda env, *args: commands.run(list(args), env=_full(env))  # noqa: E731
    proc = cli(hub_env(hub), "models", "list", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in json.loads(proc.stdout) if r["source"] == "hf-cache"]
    assert [(r["name"], r["revision"], r["refs"]) for r in rows] == [
        (REPO, SHA_MAIN, ["main"]), (f"{REPO}@{SHA_V2}", SHA_V2, ["v2"])]  # the encoder is not a causal LM
    assert all(r["size_bytes"] > 100_000 for r in rows)
    table = cli({**hub_env(hub), "COLUMNS": "200"}, "models", "list")
    assert REPO in table.stdout and "Hugging Face cache" in table.stdout and SHA_V2[:12] in table.stdout
    info = cli({**hub_env(hub), "COLUMNS": "200"}, "models", "info", REPO)
    assert info.returncode == 0 and SHA_MAIN in info.stdout and "qwen2: 3 layers" in info.stdout, info.stderr
    one_line_error(cli(hub_env(hub), "models", "info", "tiny-org/an-encoder"), "No causal LM 'tiny-org/an-encoder'")


@pytest.mark.process
def test_offline_and_not_cached_is_one_line_and_writes_nothing(hub: Path, tmp_path: Path,
                                                               commands: CommandServer) -> None:
    assert commands.import_output == ""  # what a new interpreter's imports would add to the error's output
    before = tree(hub / "hub")
    proc = commands.run(["run", "--model", "other-org/not-here@v1", "--out", str(tmp_path / "run"), "--device", "cpu"])
    one_line_error(proc, "'other-org/not-here@v1' is not in the Hugging Face cache", "HF_HUB_OFFLINE")
    assert "driftlab models pull other-org/not-here@v1" in proc.stderr
    assert not (tmp_path / "run").exists() and tree(hub / "hub") == before
    one_line_error(commands.run(["chat", "--model", f"{REPO}@no-such-tag", "hi"]), "is not in the Hugging Face")


# -- the hub's answers, from a local server ------------------------------------------------------
SERVED, SERVED_B = "tiny-org/served", "tiny-org/served-b"
SHA_SERVED, SHA_SERVED_B = "a" * 40, "b" * 40
GATED_FILES = "licensed-org/llama"  # public metadata, files behind a licence: how the hub gates Llama-2


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("served")
    a = make_tiny_model("qwen2", root / "a", seed=2)
    (a / "model.Q4_K_M.gguf").write_bytes(b"a duplicate weight format, never downloaded")
    b = make_tiny_model("qwen2", root / "b", seed=3)
    dataset_like = root / "not-a-model"
    dataset_like.mkdir()
    (dataset_like / "README.md").write_text("# not a model\n")
    with fake_hub({SERVED: (SHA_SERVED, a), SERVED_B: (SHA_SERVED_B, b), GATED_FILES: (SHA_SERVED, a),
                   "tiny-org/not-a-model": (SHA_SERVED, dataset_like)}, gated={GATED_FILES}) as endpoint:
        yield endpoint


def online(root: Path, endpoint: str, **extra: str) -> dict[str, str]:
    return {**hub_env(root), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": endpoint, "HF_TOKEN": "",
            "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2", **extra}


@pytest.fixture(scope="module")
def online_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF_HOME of `online_commands`: one cache for the tests below that download from the hub
    server (or must download nothing), since huggingface_hub reads it at import."""
    return tmp_path_factory.mktemp("hf_online")


@pytest.fixture(scope="module")
def online_commands(online_root: Path, hub_server: str,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[CommandServer]:
    """`driftlab` commands against the hub server, each forked from one server started with
    online(online_root)'s environment (what cli() gives a new interpreter) that imported torch
    and transformers once: a command's own variables (HF_TOKEN) are ones read when used."""
    server = CommandServer(tmp_path_factory.mktemp("online-commands"), ["torch", "transformers", "huggingface_hub"],
                           _full(online(online_root, hub_server)))
    yield server
    server.close()


def models_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and "models--" in str(p)}


@pytest.mark.process  # fresh interpreters
def test_pull_downloads_once_then_loads_offline(tmp_path: Path, hub_server: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    proc = cli(online(tmp_path, hub_server), "models", "pull", SERVED)
    assert proc.returncode == 0, proc.stderr
    snapshot = Path(proc.stdout.strip())
    assert snapshot == tmp_path / "hub" / "models--tiny-org--served" / "snapshots" / SHA_SERVED
    assert (snapshot.parent.parent / "refs" / "main").read_text() == SHA_SERVED
    assert (snapshot / "model.safetensors").is_file() and not list(snapshot.glob("*.gguf"))
    assert "Fetching" in proc.stderr  # huggingface_hub's progress bar
    FakeHub.requests.clear()
    again = cli(online(tmp_path, hub_server), "models", "pull", SERVED)
    assert again.returncode == 0 and Path(again.stdout.strip()) == snapshot
    assert not [r for r in FakeHub.requests if "/resolve/" in r]  # cached: nothing downloaded again
    for key, value in hub_env(tmp_path).items():  # and offline from here on
        monkeypatch.setenv(key, value)
    from driftlab.assets import resolve_model

    assert resolve_model(SERVED) == snapshot


@pytest.mark.model  # a whole protocol
def test_a_run_downloads_its_agent_and_user_models(tmp_path: Path, online_root: Path,
                                                   online_commands: CommandServer) -> None:
    """Two uncached Hub models in one process: loading the first must not switch the hub off."""
    assert not models_files(online_root)  # the first test of online_root: neither model is cached
    out = tmp_path / "run"
    proc = online_commands.run(["run", "--model", SERVED, "--user-model", SERVED_B, "--out", str(out),
                                "--device", "cpu", "--dtype", "float32", "--pairs", "1", "--rounds", "1",
                                "--max-new-tokens", "2", "--probe-tokens", "2", "--no-report"])
    assert proc.returncode == 0, proc.stderr
    models = json.loads((out / "manifest.json").read_text())["models"]
    assert (models["agent"]["hub"]["sha"], models["user"]["hub"]["sha"]) == (SHA_SERVED, SHA_SERVED_B)


@pytest.mark.parametrize("model, expect, hint", [
    ("gated-org/llama@main", ("is gated", "no Hugging Face token is set"), "HF_TOKEN"),
    (GATED_FILES, ("is gated", "no Hugging Face token is set"), "https://huggingface.co/licensed-org/llama"),
    ("missing-org/lama", ("No model 'missing-org/lama' on the Hugging Face Hub",), "Check the spelling"),
    (f"{SERVED}@v9", ("has no revision 'v9'",), "drop '@v9'"),
    (f"{SERVED}@{'c' * 40}", (f"has no revision '{'c' * 40}'",), "commits"),
    ("tiny-org/not-a-model", ("has no config.json: it is not a transformers model",), "causal LMs"),
    ("some-org/model", ("Could not download 'some-org/model'",), "HF_ENDPOINT"),  # the hub fails (500)
])
def test_hub_errors_are_one_line_and_download_nothing(online_root: Path, online_commands: CommandServer, model: str,
                                                      expect: tuple[str, ...], hint: str) -> None:
    before = models_files(online_root)
    proc = online_commands.run(["models", "pull", model])
    one_line_error(proc, *expect)
    assert hint in proc.stderr.splitlines()[1]
    assert models_files(online_root) == before


def test_gated_with_a_token_says_the_token_lacks_access(online_root: Path, hub_server: str,
                                                        online_commands: CommandServer) -> None:
    env = _full(online(online_root, hub_server, HF_TOKEN="hf_fake"))  # huggingface_hub reads HF_TOKEN when used
    one_line_error(online_commands.run(["chat", "--model", "gated-org/llama", "--device", "cpu", "hi"], env=env),
                   "is gated", "has not been granted access")


def test_unreachable_hub_is_one_line(tmp_path: Path) -> None:
    env = online(tmp_path, "http://127.0.0.1:9")
    one_line_error(cli(env, "models", "pull", "some-org/model"), "Could not download 'some-org/model'")


# -- chat templates Hub models bring ---------------------------------------------------------------
# Llama-2-chat's template (meta-llama/Llama-2-7b-chat-hf, tokenizer_config.json): no system turn of
# its own; the system prompt is folded into the first user turn between <<SYS>> tags.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("mode", ["content", "prefix"])
def test_llama2_template_folds_the_system_prompt_and_its_span_is_still_found(mode: str) -> None:
    from transformers import AutoTokenizer

    from driftlab.chat.templates import Renderer
    from tiny_models import tokenizer_dir

    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    tok.chat_template = LLAMA2_TEMPLATE
    system = "Always answer in French, whatever the question."
    conv = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And of Spain?"}]
    rendered = Renderer(tok, mode).render(conv)
    assert "[INST] <<SYS>>\n" + system in rendered.text  # folded into the first user turn
    start, end = rendered.system_span
    shown = tok.decode(rendered.ids[start:end])
    assert shown.endswith(system) and "capital" not in shown
    if mode == "content":
        assert shown.strip() == system
    else:
        assert start == 0 and shown.startswith(tok.decode(rendered.ids[:1])) and "<<SYS>>" in shown


@pytest.mark.model  # a whole protocol on a tiny model
def test_a_selfchat_runs_under_llama2s_template_with_split_softmax(tmp_path: Path) -> None:
    """The whole dialog flow (agent and user views, probes) through Llama-2's template, whose
    alternation rule rejects malformed turn orders, with an intervention that needs the span."""
    from driftlab.chat import BackendSpec, Sampling
    from driftlab.chat.hf import HFChatBackend
    from driftlab.protocol.runner import run_protocol
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig
    from driftlab.records.rundir import RunDir
    from tiny_models import make_tiny_model

    model = make_tiny_model("qwen2", tmp_path / "llama2-templated")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA2_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    backend = HFChatBackend(str(model), dtype="float32", device="cpu")
    assert backend.tokenizer.chat_template == LLAMA2_TEMPLATE
    cfg = SelfChatConfig(backend=BackendSpec(model=str(model), device="cpu", dtype="float32"), pairs=1, rounds=2,
                         user_probe=True, sampling=Sampling(max_new_tokens=4), probe_tokens=4, steer=["split-softmax:k=0.5"])
    rundir = run_protocol(SelfChat(cfg, backend), tmp_path / "run", progress=False)
    manifest = RunDir(rundir.path).read_manifest()
    assert manifest["completed"] is True
    assert len((rundir.path / "records.jsonl").read_text().splitlines()) >= 2 * 2 + 2


def test_a_model_without_chat_template_gets_the_plain_one_with_a_note(tmp_path: Path, capfd) -> None:
    from driftlab.chat import ChatRequest, Sampling
    from driftlab.chat.hf import HFChatBackend
    from tiny_models import make_tiny_model

    model = make_tiny_model("qwen2", tmp_path / "base")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    capfd.readouterr()
    backend = HFChatBackend(str(model), dtype="float32", device="cpu")
    assert "has no chat template" in " ".join(capfd.readouterr().err.split())
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    rendered = backend.render(conv)
    assert rendered.text == "Be brief.\n\nUser: Hello\nAssistant:"
    start, end = rendered.system_span
    assert backend.decode(rendered.ids[start:end]).strip() == "Be brief."
    (reply,) = backend.generate(ChatRequest([conv], Sampling(greedy=True, max_new_tokens=3, ignore_eos=True)))
    assert len(reply.token_ids) <= 3


def test_a_snapshot_missing_a_shard_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A download that stopped between shards leaves a snapshot that names files it lacks."""
    from driftlab.assets.hub import cached_snapshot
    from hub_cache import add_snapshot

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (src / "model-00001-of-00002.safetensors").write_bytes(b"1")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    cache = tmp_path / "hub"
    snapshot = add_snapshot(cache, "org/sharded", "9" * 40, src, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert cached_snapshot(HubRef("org/sharded")) is None
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"2")
    assert cached_snapshot(HubRef("org/sharded")) == snapshot
    assert cached_snapshot(HubRef("org/sharded", "9" * 40)) == snapshot
    assert cached_snapshot(HubRef("org/sharded", "v1")) is None  # no such ref
