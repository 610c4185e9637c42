"""The command line as a user meets it: stdout carries only results, errors are two readable lines."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest

from conftest import CommandServer

QUESTION = "What do you do in London as a tourist?"


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """Each `driftlab` here is a process forked from one server that imported driftlab's entry point,
    torch and transformers once (tests/conftest.py's CommandServer), not a new interpreter paying
    those imports (~5 s of a CPU each). What the imports print would be in every command's
    output: it must be nothing."""
    server = CommandServer(tmp_path_factory.mktemp("commands"), ["torch", "transformers"])
    assert server.import_output == "", server.import_output
    yield server
    server.close()


@pytest.fixture
def driftlab(commands) -> Callable[..., subprocess.CompletedProcess]:
    return lambda *args: commands.run(list(args))


SYSTEM = "Always reply in French."
TOKENS = 12  # the steer below changes the reply from its second token on


@pytest.fixture(scope="module")
def plain_reply(smol32) -> str:
    """The greedy reply to SYSTEM and QUESTION, computed in-process (the session's float32 SmolLM2)."""
    from driftlab.chat import Sampling, chat

    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return chat(smol32, [conv], Sampling(greedy=True, max_new_tokens=TOKENS))[0].text


@pytest.mark.model
def test_chat_prints_only_the_reply(driftlab, plain_reply):
    args = ["chat", "--model", "smollm2-135m", "--system", SYSTEM, "--greedy",
            "--max-new-tokens", str(TOKENS), "--dtype", "float32", QUESTION]
    proc = driftlab(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain_reply + "\n"


@pytest.mark.model
def test_chat_split_softmax_matches_the_eager_reference(tiny_llama, driftlab):
    """`--steer split-softmax:k=0.9` gives the greedy text of the slow weight-materialising reference.
    On a tiny random Llama, where the steer changes the reply: what is checked here is that the
    command applies the steer (the engine against the reference on SmolLM2 is test_attention_engine.py's)."""
    from attention_reference import NAME, register_reference
    from driftlab.chat import Sampling, chat
    from driftlab.chat.hf import HFChatBackend

    proc = driftlab("chat", "--model", str(tiny_llama), "--system", SYSTEM, "--greedy", "--max-new-tokens", str(TOKENS),
                    "--dtype", "float32", "--steer", "split-softmax:k=0.9", QUESTION)
    assert proc.returncode == 0, proc.stderr
    register_reference()
    ref = HFChatBackend(str(tiny_llama), dtype="float32", attn_implementation=NAME, prefix_cache_bytes=0)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    greedy = Sampling(greedy=True, max_new_tokens=TOKENS)
    want = chat(ref, [conv], greedy, steer=["split-softmax:k=0.9"])[0]
    assert proc.stdout == want.text + "\n"
    assert want.text != chat(ref, [conv], greedy)[0].text  # the intervention changes the reply


@pytest.mark.parametrize(
    "args, message",
    [
        (["chat", "--steer", "foo:x=1", "hi"], "Unknown intervention 'foo'"),
        (["chat", "--steer", "split-softmax:k=2", "hi"], "k=2: input should be less than or equal to 1"),
        (["chat", "--steer", "bias:heads=3", "hi"], "'value' is required"),
        (["chat", "--model", "no-such-model", "hi"], "Unknown model preset 'no-such-model'"),
        (["chat", "--model", "./no/such/dir", "hi"], "does not exist"),
        (["models", "pull", "no-such-model"], "Known presets:"),
        (["models", "info", "gpt-17"], "Unknown model preset"),
        (["report", "/nonexistent-run"], "is not a directory"),
        (["run", "--out", "/tmp/x", "--pair", "nope"], "is not AGENT_ID:USER_ID"),
        (["run", "--out", "/tmp/x", "--categories", "poetry"], "Invalid --categories: unknown categories"),
    ],
)
def test_errors_are_two_lines_without_traceback(args, message, driftlab):
    proc = driftlab(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "Error:" in proc.stderr and message in " ".join(proc.stderr.split())


@pytest.mark.parametrize("given, version", [(None, "own"), ("own", "own"), ("crafted-or-generic", "crafted-or-generic"),
                                            ("000", "own"), ("001", "crafted-or-generic")])
def test_run_accepts_the_old_user_probe_versions(monkeypatch, tmp_path, given, version):
    """`--user-probe-version 000|001` (the names of earlier versions) still work, as today's names."""
    from typer.testing import CliRunner

    import driftlab.protocol.runner as runner
    from driftlab.cli import app

    seen = {}

    def capture(protocol, out, **kwargs):
        seen["config"] = protocol.config
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_protocol", capture)
    flag = ["--user-probe-version", given] if given else []
    CliRunner().invoke(app, ["run", "--user-probe", *flag, "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert seen["config"].user_probe_version == version
    assert seen["config"].model_dump(mode="json")["user_probe_version"] == version


def test_help_names_papers_not_internal_numbers():
    """No command's help says "seed 000" (what the project called its source papers internally)."""
    import re

    import click
    from typer.main import get_command

    from driftlab.cli import app

    def walk(cmd: click.Command, path: str):
        yield path, cmd.help or ""
        yield path, cmd.short_help or ""
        for param in cmd.params:
            yield f"{path} {getattr(param, 'opts', [param.name])[0]}", getattr(param, "help", None) or ""
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    texts = list(walk(get_command(app), "driftlab"))
    assert len(texts) > 100
    bad = [(where, text) for where, text in texts if re.search(r"\bseeds? ?0\d\d|\b00[0-2]'s", text, re.I)]
    assert bad == []
    run_help = " ".join(text for where, text in texts if where == "driftlab run --user-probe-version")
    assert "'own'" in run_help and "'crafted-or-generic'" in run_help and "COLM 2024" in run_help


def test_models_list_json(driftlab):
    import json

    proc = driftlab("models", "list", "--format", "json")
    rows = json.loads(proc.stdout)
    assert {r["name"] for r in rows} >= {"smollm2-135m", "qwen2.5-coder-1.5b", "gemma3-270m"}
    assert [r["name"] for r in rows if r["default"]] == ["smollm2-135m"]
