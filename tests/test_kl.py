"""Drift in next-token distributions (`driftlab kl`, protocol/kl.py): each KL against an independent
slow reference (full forward passes of transformers' own eager model, KL in float64), a reminded KL of
exactly 0 where the system prompt already stands before the turn, kill -9 and resume, one-line errors.

SmolLM2 gives the KLs compared with the reference and the live ones; what is bookkeeping or exact math
(a --kl run's replies, SPR's zeros, kill and resume, a reply's own distributions) runs on a tiny random
Llama (tests/tiny_models.py), whose forward pass costs a millisecond."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import driftlab as dl
from devices import backend_device
from driftlab.api import spec_of
from driftlab.chat.hf import HFChatBackend
from driftlab.errors import DriftlabError
from driftlab.protocol.kl import KL, KLConfig
from driftlab.records.rundir import RunDir
from test_directions import commands  # noqa: F401 (its command server)

PAIRS = ["reply-in-french:very-happy", "all-caps:teen-slang"]


def same_kl(value: float) -> object:
    """One KL read twice in float32 (live in a round's batch, again turn by turn): equal to float32's
    rounding, which grows with the KL (CI's machine: 1.5e-5 apart on 1.73 nats), inside the 1e-4 nats
    against float64 and far below what a wrong context or position shifts (>= 1e-3)."""
    return pytest.approx(value, rel=5e-5, abs=1e-5)


SIZES = {"rounds": 3, "max_new_tokens": 10, "probe_tokens": 6}  # (6 and 4 tokens: a series D* cannot fit)


@pytest.fixture(scope="module")
def recorded(smol32, tmp_path_factory) -> Path:
    """A greedy self-chat of two pairs over three rounds, with probes after the agent's turns, and the live KL."""
    out = tmp_path_factory.mktemp("kl") / "run"
    dl.selfchat(smol32, pair=PAIRS, **SIZES, greedy=True, kl=True, out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def kl_run(smol32, recorded, tmp_path_factory) -> Path:
    """`driftlab kl` of the recorded run, in this process (the command itself is killed and resumed on
    the tiny model)."""
    out = tmp_path_factory.mktemp("kl") / "kl"
    dl.run(KL(KLConfig(backend=spec_of(smol32), from_run=str(recorded)), smol32), out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> HFChatBackend:
    """A tiny random Llama with SmolLM2's tokenizer, float32, for the tests that are bookkeeping or exact math."""
    return HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def tiny_recorded(tiny, tmp_path_factory) -> Path:
    """`recorded`'s self-chat, live KL included, on the tiny model."""
    out = tmp_path_factory.mktemp("kl") / "tiny-run"
    dl.selfchat(tiny, pair=PAIRS, **SIZES, greedy=True, kl=True, out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def measured(kl_run) -> list[dict]:
    return RunDir(kl_run).records()


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


def test_the_live_kl_of_a_self_chat_is_driftlab_kl_of_its_records(recorded, measured, tiny, tiny_recorded,
                                                                 tmp_path) -> None:
    """`--kl` measures each agent reply right after it is generated (prefix cache warm from generation, all
    replies of a round in one pass); `driftlab kl` reads the finished dialog again, turn by turn. Same
    divergences, every turn and probe reply; and the dialog itself is the one a run without --kl writes
    (on the tiny model: a second run of SmolLM2 would check the same bookkeeping)."""
    live = {(r["pair"], r["round"], r["kind"]): r["kl"] for r in RunDir(recorded).records()
            if r["kind"] == "probe" or r["speaker"] == "agent"}
    assert all(kl is not None for kl in live.values()) and len(live) == len(measured) == 2 * 3 + 2 * 3
    for rec in measured:
        kl = live[(rec["pair"], rec["round"], rec["what"])]
        assert kl["positions"] == rec["positions"], rec
        assert kl["reminded"] == same_kl(rec["reminded"]) and kl["prompt"] == same_kl(rec["prompt"]), (kl, rec)
    user = [r for r in RunDir(recorded).records() if r["kind"] == "turn" and r["speaker"] == "user"]
    assert user and all(r.get("kl") is None for r in user)  # the user LM is not the model under test
    plain = dl.selfchat(tiny, pair=PAIRS, **SIZES, greedy=True, out=tmp_path / "plain", progress=False)
    texts = lambda records: sorted((r["pair"], r["round"], r["kind"], r["text"]) for r in records)  # noqa: E731
    assert texts(plain.records) == texts(RunDir(tiny_recorded).records())
    assert len({r["text"] for r in plain.records}) > len(plain.records) // 2  # (replies that differ: not vacuous)


def test_every_measure_side_by_side_from_the_live_run_or_joined_from_a_kl_run(recorded, kl_run) -> None:
    """The report's frame reads the live KLs from the self-chat's records, and the same from a `driftlab kl`
    run joined to the self-chat it read (probe scores from there); each turn meets the next probe's score
    (probes follow the agent's turn: the same round's), and the agreement table's rho is scipy's."""
    from scipy.stats import spearmanr

    from driftlab.report.activation import agreement_table, measures_frame, turn_frame

    live, joined = measures_frame(recorded), measures_frame(kl_run)
    assert len(live) == len(joined) == 12
    for column in ("score", "reminded", "influence"):
        assert list(live[column].fillna(-1)) == [same_kl(v) for v in joined[column].fillna(-1)], column
    turns = turn_frame(live)
    scores = {(r["pair"], r["round"]): r["score"] for r in RunDir(recorded).records() if r["kind"] == "probe"}
    assert [scores[(p, r)] for p, r in zip(turns.pair, turns["round"], strict=True)] == list(turns.next_score)
    table = agreement_table(live)
    row = next(r for r in table.rows if r[0] == "reminded KL ~ prompt influence")
    expected = spearmanr(turns.reminded, turns.influence).statistic
    assert row[1].startswith(f"Spearman {expected:.2f}"), (row, expected)
    assert any("predicts the next probe's pass" in r[0] for r in table.rows)


def test_the_reminded_kl_is_exactly_zero_where_the_prompt_already_stands_before_the_turn(measured, tiny,
                                                                                       tiny_recorded, tmp_path) -> None:
    """Turn 1 directly follows the system prompt: restating it there changes nothing, so its reminded KL is 0.
    On a run with SPR at p = 1 every user turn follows a restated prompt: every turn's reminded KL is 0,
    and its prompt influence is not (on the tiny model, whose round 2 without SPR has a reminded KL)."""
    first = [r for r in measured if r["what"] == "turn" and r["round"] == 1]
    assert len(first) == 2 and all(r["reminded"] == 0.0 and r["prompt"] > 0 for r in first)
    spr = dl.selfchat(tiny, pair=PAIRS[:1], rounds=2, max_new_tokens=8, probe_tokens=4, greedy=True,
                      steer="spr:p=1.0", out=tmp_path / "spr", progress=False)
    kl = dl.run(KL(KLConfig(backend=spec_of(tiny), from_run=str(spr.path)), tiny), out=tmp_path / "kl",
                progress=False)
    turns = [r for r in kl.records if r["what"] == "turn"]
    assert len(turns) == 2 and all(r["reminded"] == 0.0 and r["prompt"] > 0 for r in turns)
    plain = [r["kl"]["reminded"] for r in RunDir(tiny_recorded).records()
             if r["kind"] == "turn" and r["speaker"] == "agent" and r["round"] == 2]
    assert plain and min(plain) > 1e-4  # without SPR the same model's reminded KL is not 0: not vacuous


def _reference(model, backend, context: list[dict], n: int) -> torch.Tensor:
    """float64 log-probabilities [n, V] at the positions generating the first n tokens of the last assistant
    turn of `context`, from one full forward pass."""
    ids = backend.render(context, add_generation_prompt=False).ids
    start = len(backend.render(context[:-1], add_generation_prompt=True).ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : start - 1 + n]
    return torch.log_softmax(logits.double(), dim=-1)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.slow
def test_a_killed_kl_run_resumes_to_the_records_of_an_uninterrupted_one(commands, tiny, tiny_recorded,  # noqa: F811
                                                                        tmp_path) -> None:
    """`driftlab kl` of the tiny model's run, killed after its first append and run again: the records of the
    uninterrupted command, a command of the same server (the same float32 arithmetic: they compare exactly;
    this process's own run, whose prefix cache lays out its batches otherwise, differs in the last digit)."""
    args = ["kl", "--from-run", str(tiny_recorded), "--model", spec_of(tiny).model, "--dtype", "float32",
            "--device", backend_device()]
    reference = commands.run([*args, "--out", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.stderr[-2000:]
    killed = commands.run([*args, "--out", str(tmp_path / "run")], kill_after=1)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    kept = (tmp_path / "run" / "records.jsonl").read_bytes()
    assert kept and "completed" not in RunDir(tmp_path / "run").read_manifest()
    done = commands.run([*args, "--out", str(tmp_path / "run")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "records.jsonl").read_bytes().startswith(kept)
    resumed, uninterrupted = (sorted(map(str, RunDir(tmp_path / run).records())) for run in ("run", "reference"))
    assert len(resumed) == 12 and resumed == uninterrupted
    assert "reminded KL" in done.stderr and "how far the measures agree" in done.stderr  # the per-round tables


def test_a_live_kl_takes_the_dialog_as_it_was_from_generation_not_a_second_read(smol32, monkeypatch) -> None:
    """A generated reply's own distributions (`Reply.distributions`) stand for the as-is context: equal to
    reading it again (1e-4 nats), and no second read. Teeth: a context that is not, token for token, what
    was generated (the reply edited) is read, not taken."""
    from driftlab.chat import ChatRequest, Sampling
    from driftlab.protocol.divergence import kl_mean, reply_logprobs
    from driftlab.steering import Interventions

    conv = [{"role": "system", "content": "Always reply in French."}, {"role": "user", "content": "How are you?"}]
    reply = smol32.generate(ChatRequest([conv], Sampling(greedy=True, max_new_tokens=12), distributions=True))[0]
    assert reply.distributions is not None and len(reply.distributions.logprobs) >= reply.n_tokens
    context = [*conv, {"role": "assistant", "content": reply.text}]
    read = reply_logprobs(smol32, [context], Interventions(), [reply.finish_reason], store=False)[0]
    reads = []
    monkeypatch.setattr(smol32, "prompt_logprobs", lambda prompts, *a, **k: reads.append(len(prompts)) or [])
    taken = reply_logprobs(smol32, [context], Interventions(), [reply.finish_reason], store=False,
                           given=[reply.distributions])[0]
    assert reads == [] and taken[1] == read[1]
    assert kl_mean(read[0], taken[0]) < 1e-4 and (read[0] - taken[0]).abs().max() < 1e-3
    edited = [*conv, {"role": "assistant", "content": reply.text + " Merci."}]
    with pytest.raises(ValueError):  # read (the stub returns nothing), not taken
        reply_logprobs(smol32, [edited], Interventions(), [reply.finish_reason], store=False, given=[reply.distributions])
    assert reads == [1]


def test_what_a_live_kl_cannot_measure_is_one_line_before_any_work(smol32, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    with pytest.raises(DriftlabError, match="--steer cfg mixes or switches distributions"):
        dl.selfchat(smol32, pair=PAIRS[:1], rounds=1, steer="cfg:alpha=1.5", kl=True, out=tmp_path / "cfg",
                    progress=False)
    from driftlab.chat import BackendSpec
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig

    remote = BackendSpec(model="openai:x", runtime={"base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(DriftlabError, match="openai:x is not a local model; --kl needs its tokens"):
        dl.run(SelfChat(SelfChatConfig(backend=remote, pair_ids=[tuple(PAIRS[0].split(":"))], pairs=0, rounds=1,
                                       kl=True)), out=tmp_path / "remote", progress=False)
    assert not (tmp_path / "cfg" / "records.jsonl").exists() and not (tmp_path / "remote" / "records.jsonl").exists()


def test_a_dialog_that_could_pass_the_context_window_is_refused_with_its_round(smol32, tmp_path) -> None:
    """SmolLM2's window is 8192 tokens: 80-token turns and probe replies can pass it in round 48 (every turn
    at its limit), so 100 rounds are refused before any generation, and 47 are not."""
    with pytest.raises(DriftlabError, match=r"--rounds 100 can pass the model's context window of 8192 tokens at "
                                            r"round 48 \(\d+ tokens"):
        dl.selfchat(smol32, pair=PAIRS[:1], rounds=100, max_new_tokens=80, probe_tokens=80, out=tmp_path / "long",
                    progress=False)
    assert not (tmp_path / "long" / "records.jsonl").exists()
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig

    fits = SelfChat(SelfChatConfig(backend=spec_of(smol32), pair_ids=[tuple(PAIRS[0].split(":"))], pairs=0, rounds=47,
                                   sampling={"max_new_tokens": 80}, probe_tokens=80), smol32)
    fits.require()  # (no error)


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


def test_driftlab_equilibrium_fits_the_kl_series_of_runs_and_compares_two(recorded, kl_run, tmp_path) -> None:
    """The series are each conversation's agent turns from round 2, from the live records or a kl run alike;
    the table fits each run and, for two, compares their D* (here the same dialogs: a difference of 0); the
    CLI draws the series beside the repeated turns where asked, and refuses a figure path that is no PNG."""
    from typer.testing import CliRunner

    from driftlab.cli import app
    from driftlab.report.equilibrium import equilibrium_table, series, turns

    live = {(r["pair"], r["round"]): r["kl"]["reminded"] for r in RunDir(recorded).records()
            if r["kind"] == "turn" and r["speaker"] == "agent"}
    assert series(turns(recorded)) == [[live[(p, 2)], live[(p, 3)]] for p in (0, 1)]
    assert [[same_kl(v) for v in one] for one in series(turns(recorded))] == series(turns(kl_run))
    table = equilibrium_table([recorded, kl_run], n_boot=50)
    assert len(table.rows) == 3 and abs(float(table.rows[2][1].split()[0])) < 1e-3, table.rows
    figure = tmp_path / "eq.png"
    done = CliRunner().invoke(app, ["equilibrium", str(recorded), str(kl_run), "--figure", str(figure)])
    assert done.exit_code == 0 and f"figure: {figure}" in done.output, done.output
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = CliRunner().invoke(app, ["equilibrium", str(recorded), "--figure", str(tmp_path / "eq.pdf")])
    assert done.exit_code != 0 and "is not a .png path" in str(done.exception) + done.output
    done = CliRunner().invoke(app, ["equilibrium", str(recorded), str(kl_run), str(recorded)])
    assert done.exit_code != 0 and "the fit takes one, or two to compare" in str(done.exception) + done.output
