"""One results contract: `Results` of every protocol's committed run, checked against numbers
recomputed here from the raw records; strict JSON; concatenation across runs; `driftlab report`
writing results.json for one run and a comparison page for several."""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from driftlab.report.results import IDENTITY, RESULTS_JSON, Results, summarize

RESULTS = Path(__file__).parent.parent / "docs" / "results"
RUNS = ["qwen-paper-20", "sweep-ref-20", "decay-qwen-20", "pasta-qwen/eval-json", "pasta-qwen/tune-json",
        "pasta-qwen/profile-json", "judge-smollm2-qwen-20", "sweep-ref-20/points/instaboost_m3.0/mmlu"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("run", RUNS)
def test_every_protocol_gives_typed_results_with_their_identity(run):
    res = summarize(RESULTS / run)
    manifest = json.loads((RESULTS / run / "manifest.json").read_text())
    assert res.protocol == manifest["protocol"] and res.complete == bool(manifest.get("completed"))
    assert res.estimates
    frame = res.to_pandas()
    assert list(frame.columns[: len(IDENTITY)]) == IDENTITY
    assert (frame.protocol == res.protocol).all() and frame.model.notna().all()
    real = [e for e in res.estimates if e.metric != "records"]
    for e in real:
        assert e.n >= 1 and math.isfinite(e.value), e
        if math.isfinite(e.low):
            assert e.low <= e.value + 1e-9 <= e.high + 2e-9 and e.interval, e
    back = Results.from_dict(json.loads(json.dumps(res.to_dict(), allow_nan=False)))
    pd.testing.assert_frame_equal(back.to_pandas(), frame)


def test_selfchat_stability_equals_the_records_recomputed():
    """Overall agent stability: each conversation's mean over its probe rounds, then their mean."""
    records = _lines(RESULTS / "qwen-paper-20" / "records.jsonl")
    per_conv = defaultdict(list)
    for r in records:
        if r["kind"] == "probe" and r["target"] == "agent" and r["score"] is not None:
            per_conv[(r["condition"], r["pair"])].append(r["score"])
    res = summarize(RESULTS / "qwen-paper-20").to_pandas()
    overall = res[(res.metric == "stability") & (res.target == "agent") & (res.category == "all") & res["round"].isna()]
    for row in overall.itertuples():
        means = [np.mean(v) for (cond, _), v in per_conv.items() if cond == row.condition]
        assert row.value == pytest.approx(np.mean(means)) and row.n == len(means)


def test_mmlu_accuracy_equals_the_answers_counted():
    run = RESULTS / "sweep-ref-20" / "points" / "instaboost_m3.0" / "mmlu"
    answers = [r for r in _lines(run / "records.jsonl") if r["kind"] == "answer"]
    (acc,) = [e for e in summarize(run).estimates if e.metric == "accuracy"]
    assert acc.n == len(answers) and acc.value == pytest.approx(np.mean([a["correct"] for a in answers]))
    assert acc.interval == "wilson"


def test_sweep_gains_carry_their_holm_corrected_tests():
    frame = summarize(RESULTS / "sweep-ref-20").to_pandas()
    gains = frame[frame.metric == "gain"]
    assert len(gains) == 10 and (gains.test != "").all()
    assert (gains.p_holm >= gains.p - 1e-12).all()  # Holm never lowers a p-value
    table = pd.read_csv(RESULTS / "sweep-ref-20" / "sweep.csv")
    cfg3 = table[table.spec == "cfg:alpha=3.0"].iloc[0]
    mine = gains[gains.spec == "cfg:alpha=3.0"].iloc[0]
    assert mine.value == pytest.approx(cfg3.stability_gain) and mine.p_holm == pytest.approx(cfg3.gain_p_holm)


def test_runs_concatenate_and_compare_in_one_page(tmp_path):
    """`driftlab report` in this process (`python -m driftlab` itself is tests/test_cli_errors.py's):
    the page and the CSV are the command's work, not an interpreter's seconds of imports."""
    from typer.testing import CliRunner

    from driftlab.cli import app

    runs = []
    for name in ("qwen-paper-20", "judge-smollm2-qwen-20"):
        runs.append(shutil.copytree(RESULTS / name, tmp_path / name))
    both = pd.concat([summarize(r).to_pandas() for r in runs], ignore_index=True)
    assert set(both.model) == {"qwen2.5-coder-1.5b", "smollm2-135m"}
    assert set(both.dtype) == {"bfloat16", "float32"}

    done = CliRunner().invoke(app, ["report", *map(str, runs), "--out", str(tmp_path / "cmp")])
    assert done.exit_code == 0, (done.output[-3000:], done.exception)
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert "qwen-paper-20" in page and "judge-smollm2-qwen-20" in page and "data:image/png;base64," in page
    csv = pd.read_csv(tmp_path / "cmp" / "compare.csv")
    assert len(csv) == len(both)

    one = CliRunner().invoke(app, ["report", str(runs[1])])
    assert one.exit_code == 0, (one.output[-3000:], one.exception)
    written = json.loads((runs[1] / RESULTS_JSON).read_text())  # strict JSON: NaN written as null
    assert written["protocol"] == "selfchat" and written["identity"]["model"] == "smollm2-135m"
    judge = [e for e in written["estimates"] if e["metric"] == "judge_agreement"]
    assert judge and judge[0]["value"] == pytest.approx(0.65) and judge[0]["n"] == 20
