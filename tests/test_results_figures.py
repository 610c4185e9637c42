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
