"""Drift in next-token distributions (`driftlab kl`, protocol/kl.py): each KL against an independent
slow reference (full forward passes of transformers' own eager model, KL in float64), a reminded KL of
exactly 0 where the system prompt already stands before the turn, kill -9 and resume, one-line errors."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import driftlab as dl
from driftlab.api import spec_of
from driftlab.errors import DriftlabError
from driftlab.protocol.kl import KL, KLConfig
from driftlab.records.rundir import RunDir
from test_directions import commands  # noqa: F401 (its command server)

PAIRS = ["reply-in-french:very-happy", "all-caps:teen-slang"]


@pytest.fixture(scope="module")
def recorded(smol32, tmp_path_factory) -> Path:
    """A greedy self-chat of two pairs over three rounds, with probes after the agent's turns."""
    out = tmp_path_factory.mktemp("kl") / "run"
    dl.selfchat(smol32, pair=PAIRS, rounds=3, max_new_tokens=10, probe_tokens=6, greedy=True, out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def measured(smol32, recorded, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("kl") / "kl"
    run = dl.run(KL(KLConfig(backend=spec_of(smol32), from_run=str(recorded)), smol32), out=out, progress=False)
    return run.records


def test_each_kl_matches_full_forward_passes_of_transformers_in_float64(smol32, smol_dir, recorded, measured) -> None:
    """Agent turns of rounds 2 and 3: the reminded KL and the prompt influence recomputed from three full
    forward passes of transformers' eager model (no cache, no driftlab attention), in float64."""
    from transformers import AutoModelForCausalLM

    from driftlab.protocol.project import recorded_dialogs

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32, attn_implementation="eager")
    dialogs = {d["pair"]: d for d in recorded_dialogs(recorded)}
    checked = 0
    for rec in measured:
        if rec["what"] != "turn" or rec["round"] == 1:
            continue
        d, rnd, n = dialogs[rec["pair"]], rec["round"], rec["positions"]
        system = {"role": "system", "content": d["system"]}
        conv = [system]
        for a, b in zip(d["a"][:rnd], d["b"][:rnd], strict=True):
            conv += [{"role": "user", "content": a}, {"role": "assistant", "content": b}]
        as_is = _reference(model, smol32, conv, n)
        reminded = _reference(model, smol32, conv[:-2] + [system] + conv[-2:], n)
        emptied = _reference(model, smol32, [{"role": "system", "content": ""}, *conv[1:]], n)
        assert abs(_kl(as_is, reminded) - rec["reminded"]) < 1e-4, rec
        assert abs(_kl(as_is, emptied) - rec["prompt"]) < 1e-4, rec
        assert rec["reminded"] > 1e-4 and rec["prompt"] > 1e-4  # (not vacuous)
        checked += 1
    assert checked == 4  # 2 pairs x rounds 2 and 3


def test_the_reminded_kl_is_exactly_zero_where_the_prompt_already_stands_before_the_turn(smol32, recorded,
                                                                                       measured, tmp_path) -> None:
    """Turn 1 directly follows the system prompt: restating it there changes nothing, so its reminded KL is 0.
    On a run with SPR at p = 1 every user turn follows a restated prompt: every turn's reminded KL is 0,
    and its prompt influence is not."""
    first = [r for r in measured if r["what"] == "turn" and r["round"] == 1]
    assert len(first) == 2 and all(r["reminded"] == 0.0 and r["prompt"] > 0 for r in first)
    spr = dl.selfchat(smol32, pair=PAIRS[:1], rounds=2, max_new_tokens=8, probe_tokens=4, greedy=True,
                      steer="spr:p=1.0", out=tmp_path / "spr", progress=False)
    kl = dl.run(KL(KLConfig(backend=spec_of(smol32), from_run=str(spr.path)), smol32), out=tmp_path / "kl",
                progress=False)
    turns = [r for r in kl.records if r["what"] == "turn"]
    assert len(turns) == 2 and all(r["reminded"] == 0.0 and r["prompt"] > 0 for r in turns)


def _reference(model, backend, context: list[dict], n: int) -> torch.Tensor:
    """float64 log-probabilities [n, V] at the positions generating the first n tokens of the last assistant
    turn of `context`, from one full forward pass."""
    ids = backend.render(context, add_generation_prompt=False).ids
    start = len(backend.render(context[:-1], add_generation_prompt=True).ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[start - 1 : start - 1 + n]


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.slow
def test_a_killed_kl_run_resumes_to_the_records_of_an_uninterrupted_one(commands, recorded, tmp_path) -> None:  # noqa: F811
    args = ["kl", "--from-run", str(recorded), "--dtype", "float32"]
    ref = commands.run([*args, "--out", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = commands.run([*args, "--out", str(tmp_path / "run")], kill_after=1)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    kept = (tmp_path / "run" / "records.jsonl").read_bytes()
    assert kept and "completed" not in RunDir(tmp_path / "run").read_manifest()
    done = commands.run([*args, "--out", str(tmp_path / "run")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "records.jsonl").read_bytes().startswith(kept)
    assert sorted(map(str, RunDir(tmp_path / "run").records())) == sorted(map(str, RunDir(tmp_path / "ref").records()))
    assert "reminded KL" in done.stderr and "prompt influence" in done.stderr  # the per-round table


def test_what_driftlab_kl_cannot_read_is_one_line_before_any_work(recorded, tmp_path, monkeypatch) -> None:
    from driftlab.chat import BackendSpec

    monkeypatch.setenv("OPENAI_API_KEY", "unused")  # the remote backend is refused before it is asked anything
    with pytest.raises(DriftlabError, match="is not a run directory"):
        KL(KLConfig(from_run=str(tmp_path))).check()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"protocol": "mmlu", "config": {}}')
    with pytest.raises(DriftlabError, match="is a mmlu run, not a self-chat"):
        KL(KLConfig(from_run=str(tmp_path / "other"))).check()
    with pytest.raises(DriftlabError, match="openai:x is not a local model; driftlab kl needs its tokens"):
        dl.run(KL(KLConfig(backend=BackendSpec(model="openai:x", runtime={"base_url": "http://127.0.0.1:9/v1"}),
                           from_run=str(recorded))), out=tmp_path / "remote", progress=False)
