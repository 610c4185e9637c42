"""The LLM-judge measure: its prompt and verdict parsing, agreement statistics, and judges asked
through real backends: a tiny model in this process, SmolLM2 in float32, and SmolLM2 behind a
real `driftlab serve` reached as an OpenAI endpoint (whose verdicts must equal the local ones)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

import driftlab as dl
from driftlab import api
from driftlab.bench import JUDGE, JudgeParams, MeasureError, Persona
from driftlab.bench.judge import RUBRIC, judge_conversation, verdict_score
from driftlab.bench.measures import parse_keywords
from driftlab.errors import DriftlabError
from driftlab.protocol.judge import VERDICTS, Ask, Judges
from driftlab.report.metrics import judge_agreement
from driftlab.stats import agreement


# -- the text side ---------------------------------------------------------------------------------
@pytest.mark.parametrize("verdict, score", [("7", 0.7), ("Rating: 7/10", 0.7), ("10", 1.0), (" 0\n", 0.0),
                                            ("I would rate it 3 out of 10.", 0.3), ("9.", 0.9)])
def test_a_rating_is_read_from_the_verdict(verdict, score):
    assert verdict_score(verdict) == score


@pytest.mark.parametrize("verdict", ["0.7", "17", "eleven", "", "A) 20, B)", "x7"])
def test_a_verdict_without_a_rating_is_an_error(verdict):
    with pytest.raises(ValueError, match="no rating from 0 to 10"):
        verdict_score(verdict)


def test_keywords_keep_commas_inside_a_value():
    assert parse_keywords("model=m,rubric=warm, never familiar, and kind,max_tokens=4") == {
        "model": "m", "rubric": "warm, never familiar, and kind", "max_tokens": "4"}
    assert parse_keywords("model=m,oops") == {"model": "m,oops"}  # no key after the comma: part of the value
    for bad in ("oops", "=m", " = m"):
        with pytest.raises(ValueError, match="not key=value"):
            parse_keywords(bad)


def test_judge_params_from_a_name_or_keywords():
    assert JudgeParams.model_validate("smollm2-135m") == JudgeParams(model="smollm2-135m")
    p = JudgeParams.model_validate("model=openai:j,base_url=http://h:1/v1,max_tokens=3")
    assert (p.model, p.base_url, p.max_tokens, p.rubric) == ("openai:j", "http://h:1/v1", 3, RUBRIC)


def test_a_persona_names_its_judge_in_one_line_and_cannot_be_scored_without_one():
    p = Persona(system_prompt="Be warm, never familiar.", probe="How are you?",
                measure="judge:model=smollm2-135m,rubric=0: cold or familiar, 10: warm, never familiar")
    assert p.measure == JUDGE
    assert p.params == {"model": "smollm2-135m", "rubric": "0: cold or familiar, 10: warm, never familiar"}
    with pytest.raises(MeasureError, match="scores inside a run"):
        p.score("Hello there!")
    with pytest.raises(ValueError, match="model"):
        Persona(system_prompt="x", probe="y", measure="judge:rubric=z")


def test_the_judge_reads_the_system_prompt_probe_reply_and_rubric():
    conv = judge_conversation(JudgeParams(model="m", rubric="RUBRIC-X"), "SYS-X", "PROBE-X", "REPLY-X")
    assert [m["role"] for m in conv] == ["system", "user"]
    text = conv[1]["content"]
    assert text.index("SYS-X") < text.index("PROBE-X") < text.index("REPLY-X") < text.index("RUBRIC-X")


# -- agreement ---------------------------------------------------------------------------------
def _kappa_by_hand(a, b):
    a, b = np.asarray(a) >= 0.5, np.asarray(b) >= 0.5
    po = (a == b).mean()
    pe = a.mean() * b.mean() + (1 - a.mean()) * (1 - b.mean())
    return (po - pe) / (1 - pe)


def test_agreement_against_independent_formulas():
    rng = np.random.default_rng(3)
    a = rng.random(40)
    b = np.clip(a + rng.normal(0, 0.3, 40), 0, 1)
    got = agreement(a, b)
    assert got.n == 40
    assert got.spearman == pytest.approx(pd.Series(a).corr(pd.Series(b), method="spearman"))
    assert got.kappa == pytest.approx(_kappa_by_hand(a, b))
    assert got.agree.estimate == pytest.approx(((a >= 0.5) == (b >= 0.5)).mean())
    assert got.agree.low < got.agree.estimate < got.agree.high
    assert got.mad == pytest.approx(np.abs(a - b).mean())
    opposite = agreement(a, 1 - a)
    assert opposite.spearman == pytest.approx(-1) and opposite.kappa < 0
    constant = agreement([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert math.isnan(constant.spearman) and math.isnan(constant.kappa) and constant.agree.estimate == 1


def test_judge_agreement_counts_only_replies_both_scored():
    rec = {"kind": "probe", "target": "agent"}
    records = [{**rec, "score": 1.0, "judge": 0.9}, {**rec, "score": 0.0, "judge": 0.1},
               {**rec, "score": 0.0, "judge": 0.8}, {**rec, "score": None, "judge": 0.5},
               {**rec, "score": 1.0, "judge": None, "judge_error": "JudgeError: no rating"},
               {**rec, "score": 0.5, "judge": None}]  # a run without a judge: not counted
    table = judge_agreement(records)
    row = table.iloc[0]
    assert (row.target, row.n, row.judge_errors) == ("agent", 3, 1)
    assert row.agree == pytest.approx(2 / 3)
    assert judge_agreement([{**rec, "score": 1.0, "judge": None, "error": None}]).empty


# -- judges asked through real backends --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")
    return dl.load(str(path), dtype="float32", device="cpu")


def _verdicts(run_dir):
    lines = (run_dir / VERDICTS).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _probes(run_dir):
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "probe"]


def test_a_judge_measure_scores_from_its_recorded_verdicts_and_a_resume_never_asks_again(tiny, tmp_path):
    """Every score (or error) is what the cached verdict says; records lost in a crash are redone
    without one more question to the judge."""
    judge = f"judge:model={api.spec_of(tiny).model},max_tokens=4"
    out = tmp_path / "run"
    kw = dict(system="Answer like a pirate.", probe="How are you today?", measure=judge, pairs=2, rounds=2,
              max_new_tokens=6, probe_tokens=6, progress=False)
    run = dl.selfchat(tiny, out=out, **kw)
    probes = [r for r in run.records if r["kind"] == "probe"]
    asked = _verdicts(out)
    assert len(probes) == 4 and len(asked) == len({json.dumps(v["request"]) for v in asked}) <= 4
    by_reply = {v["request"]["messages"][1]["content"].split("<reply>\n")[1].split("\n</reply>")[0]:
                v["response"]["text"] for v in asked}
    for r in probes:
        if not r["text"].strip():
            assert r["score"] == 0.0
            continue
        verdict = by_reply[r["text"]]
        try:
            assert r["score"] == verdict_score(verdict) and r["error"] is None
        except ValueError:
            assert r["score"] is None and r["error"].startswith("JudgeError")
    assert run.manifest["judges"]["template"].count("{reply}") == 1
    assert set(run.manifest["judges"]["models"]) == {api.spec_of(tiny).model}

    lines = (out / "records.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["kind"] != "probe"]
    (out / "records.jsonl").write_text("".join(line + "\n" for line in kept))
    again = dl.selfchat(tiny, out=out, **kw)
    assert len(_verdicts(out)) == len(asked)  # nothing asked twice
    key = lambda r: (r["pair"], r["round"])  # noqa: E731
    assert sorted((key(r), r["score"], r["error"]) for r in again.records if r["kind"] == "probe") == sorted(
        (key(r), r["score"], r["error"]) for r in probes)


def test_a_run_judge_rates_beside_the_measure_and_the_report_shows_agreement(tiny, tmp_path):
    from driftlab.report.html import write_report

    out = tmp_path / "run"
    run = dl.selfchat(tiny, out=out, pairs=2, rounds=1, max_new_tokens=6, probe_tokens=6, progress=False,
                      judge=f"model={api.spec_of(tiny).model},max_tokens=3")
    probes = [r for r in run.records if r["kind"] == "probe"]
    assert probes and all((r["judge"] is None) != (r["judge_error"] is None) or not r["text"].strip()
                          for r in probes)
    assert run.manifest["config"]["judge"]["max_tokens"] == 3
    table = run.summary.judge
    assert list(table.target) == ["agent"]
    assert table.n.iloc[0] + table.judge_errors.iloc[0] == sum(r["score"] is not None for r in probes)
    assert "Judge model against the deterministic measures" in write_report(out).read_text()


def test_a_judge_that_cannot_load_is_named(tiny, tmp_path):
    with pytest.raises(DriftlabError, match="judge model 'openai:j'.*not an http"):
        dl.selfchat(tiny, out=tmp_path / "r", pairs=1, rounds=1, judge="model=openai:j,base_url=ftp://x",
                    progress=False)
    with pytest.raises(DriftlabError, match=r"judge model '\./no-such-judge'"):
        dl.selfchat(tiny, out=tmp_path / "r2", pairs=1, rounds=1, judge="./no-such-judge", progress=False)


# -- on the real model, locally and behind driftlab serve -------------------------------------------
ASKS = [("Always reply in French.", "What is your favourite food?", reply) for reply in
        ("J'adore le fromage et le pain frais.", "I love cheese and fresh bread.", "Pizza, obviously!")]


def test_the_served_judge_gives_the_local_judges_verdicts(smol32, tmp_path):
    """The same SmolLM2 asked in-process and through `driftlab serve` (OpenAI wire format) gives
    the same greedy verdicts, and the verdicts are cached per run directory."""
    from driftlab.chat.spec import BackendSpec
    from driftlab.serve import ServeSettings, create_app
    from driftlab.serve.background import background as serving

    local = Judges(BackendSpec(model="smollm2-135m"), smol32, tmp_path / "local")
    (tmp_path / "local").mkdir()
    params = JudgeParams(model="smollm2-135m", max_tokens=6)
    mine = local.rate([Ask(params, *a) for a in ASKS])
    with serving(create_app(smol32, ServeSettings(served_model_name="judge-smol"))) as url:
        (tmp_path / "served").mkdir()
        served = Judges(BackendSpec(model="smollm2-135m"), None, tmp_path / "served")
        remote = JudgeParams(model="openai:judge-smol", base_url=f"{url}/v1", max_tokens=6)
        theirs = served.rate([Ask(remote, *a) for a in ASKS])
        served.close()
    assert any(r["score"] is not None for r in mine)  # SmolLM2 does answer with ratings
    assert [r["verdict"] for r in theirs] == [r["verdict"] for r in mine]
    assert [r["score"] for r in theirs] == [r["score"] for r in mine]
    assert len(_verdicts(tmp_path / "served")) == len(ASKS)
    local.close()


@pytest.mark.model
def test_the_cli_takes_a_judge_measure_in_one_line(tmp_path):
    """`driftlab run --measure judge:model=...` (the command, in this process, on a tiny model): the judge
    named in the manifest, every probe rated or its error recorded, and the verdicts cached."""
    from typer.testing import CliRunner

    from driftlab.cli import app
    from tiny_models import make_tiny_model

    model = make_tiny_model("qwen2", tmp_path / "qwen2")
    out = tmp_path / "run"
    done = CliRunner().invoke(app, ["run", "--model", str(model), "--dtype", "float32", "--device", "cpu",
                                    "--system", "Be warm, never familiar.", "--probe", "Hey buddy?",
                                    "--measure", f"judge:model={model},rubric=0: familiar, 10: warm, max_tokens=3",
                                    "--pairs", "1", "--rounds", "1", "--max-new-tokens", "4", "--probe-tokens", "4",
                                    "--no-report", "--out", str(out)])
    assert done.exit_code == 0, (done.output[-3000:], done.exception)
    manifest = json.loads((out / "manifest.json").read_text())
    (persona,) = [p for p in manifest["personas"].values() if p["measure"] == JUDGE]
    assert persona["params"] == {"model": str(model), "rubric": "0: familiar, 10: warm", "max_tokens": 3}
    assert list(manifest["judges"]["models"]) == [str(model)]
    (probe,) = _probes(out)
    assert (probe["score"] is None) == (probe["error"] is not None)
    assert len(_verdicts(out)) == (1 if probe["text"].strip() else 0)
