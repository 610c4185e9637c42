"""The committed results say what their records say: docs/results/README.md's generated blocks
and each sweep's sweep.csv are recomputed from the committed run directories."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pandas as pd
import pytest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _figures():
    spec = importlib.util.spec_from_file_location("results_figures", RESULTS / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_finished_sweeps_are_found():
    assert "sweep-ref-20" in _figures().SWEEPS


def test_every_generated_block_of_the_results_readme_matches_its_records(capsys):
    figures = _figures()
    text = figures.README.read_text(encoding="utf-8")
    names = [m["name"] for m in figures.BLOCK.finditer(text)]
    assert set(names) == set(figures.BLOCKS)  # every block is in the README, once
    assert len(names) == len(set(names))
    assert figures.main(["--check"]) == 0, capsys.readouterr().out


def test_a_changed_figure_is_caught(monkeypatch, capsys):
    """The check can fail: a block whose records say otherwise is named."""
    figures = _figures()
    # The other blocks as committed (recomputing them is the test above's work), one changed.
    committed = {m["name"]: m["body"] for m in figures.BLOCK.finditer(figures.README.read_text(encoding="utf-8"))}
    blocks = {name: (lambda body=body: body) for name, body in committed.items()}
    monkeypatch.setattr(figures, "BLOCKS", {**blocks, "decay-qwen-20": lambda: "| mean pi | 0.999 |"})
    assert figures.main(["--check"]) == 1
    assert "decay-qwen-20" in capsys.readouterr().out


@pytest.mark.parametrize("name", _figures().SWEEPS)
def test_committed_sweep_tables_are_what_the_point_records_give(name, tmp_path):
    from driftlab.report.sweep import sweep_table

    copy = tmp_path / name
    shutil.copytree(RESULTS / name, copy)
    sweep_table(copy)  # writes copy/sweep.csv as the report does
    fresh = pd.read_csv(copy / "sweep.csv")
    committed = pd.read_csv(RESULTS / name / "sweep.csv")
    pd.testing.assert_frame_equal(fresh.reset_index(drop=True), committed, check_dtype=False, atol=1e-9)


def test_replay_conditions_compare_each_dialog_s_mean_compliance_with_the_first_run_s(tmp_path):
    """Runs of the same dialogs: compliance at turns 1, 5, ..., each dialog's mean over turns 2..T against the
    first run's (paired over dialogs), and a gate's steered share; T the last round every run completed."""
    import json

    from driftlab.report.replay import compliance_frame
    from driftlab.stats import paired_test
    from test_warn import _write_run

    _write_run(tmp_path / "a", rounds=10)
    _write_run(tmp_path / "b", rounds=10, seed=1)
    lines = (tmp_path / "b" / "records.jsonl").read_text().splitlines()
    gated = [json.loads(line) | {"gate": {"r": 0.5, "by": "score", "score": None, "steered": i % 4 == 0}}
             for i, line in enumerate(lines)]
    (tmp_path / "b" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gated))
    figures = _figures()
    table = figures.replay_conditions(str(tmp_path / "a"), str(tmp_path / "b"), upto=8).splitlines()
    assert table[0].startswith("| run | turn 1 | turn 5 | turn 8 | turns 2-8, per dialog |")
    frames = [compliance_frame(tmp_path / n) for n in "ab"]
    means = [f[(f["round"] >= 2) & (f["round"] <= 8)].groupby("pair")["score"].mean().to_dict() for f in frames]
    test = paired_test(means[1], means[0])
    steered = frames[1][frames[1]["round"] <= 8]["steered"]
    assert f"| {test.diff.estimate:+.2f} " in table[3] and f": {test.better} / {test.worse}, p = {figures._p(test.p)} |" \
        in table[3] and f"{steered.mean():.0%} of {len(steered)}" in table[3]
    b = frames[1].assign(prev=frames[1].groupby("pair")["score"].shift())
    after = b[(b["round"] <= 8) & (b.prev < 0.5)]  # a turn after a failing one: does it pass?
    assert f"| {(after.score >= 0.5).mean():.2f} [" in table[3] and f"(n = {len(after)}) |" in table[3]
    assert table[3].split(" | ")[1:3] == [f"{frames[1].loc[frames[1]['round'] == t, 'score'].mean():.2f}"
                                          for t in (1, 5)]
