"""`driftlab warn`: is a measure a warning? Checked on replay runs written here, where which signal
warns, and how early, is known by construction.

The AUROC is scikit-learn's on the same arrays; the intervals resample whole dialogs; a threshold is
chosen without the dialogs it is judged on; a signal that only tells dialogs apart has a pooled AUROC
far above its within-dialog one; a signal that drops one turn before each failure warns with a lead of
one turn, and the turn index is the line every warning must clear.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score
from typer.testing import CliRunner

from driftlab.cli import app
from driftlab.report import warn
from driftlab.stats import resample_counts


def _write_run(path: Path, dialogs: int = 24, rounds: int = 10, seed: int = 0,
               gate: bool = False) -> dict[tuple[int, int], dict]:
    """A replay-shaped run: half the dialogs fail from a turn drawn in 4..8 on; pi falls one turn before
    the first failure (a warning with lead 1); `influence` is a per-dialog constant that is higher in the
    dialogs that fail (it tells dialogs apart, not turns); the reminded KL is noise. With `gate`, a
    monitoring `when-drifting` recorded its reading too: pi over 0.3, the first turn's."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    pairs, records, truth = [], [], {}
    for d in range(dialogs):
        breaks = int(rng.integers(4, 9)) if d % 2 == 0 else None
        level = 1.0 + rng.normal(0, 0.05) if breaks else 0.2 + rng.normal(0, 0.05)
        pairs.append({"pair": d, "agent": "reply-in-french", "user": None, "starter": "hi", "turns": ["hi"] * rounds})
        for r in range(1, rounds + 1):
            failing = breaks is not None and r >= breaks
            score = 0.0 if failing else 1.0
            pi = 0.05 if (breaks is not None and r >= breaks - 1) else 0.3 + rng.normal(0, 0.02)
            rec = {"kind": "turn", "speaker": "agent", "pair": d, "condition": "persona", "round": r,
                   "text": f"reply {d} {r}", "n_tokens": 10 + int(rng.integers(0, 5)), "finish_reason": "stop",
                   "score": score, "pi": [pi, pi], "kl": {"reminded": float(rng.exponential()), "prompt": -level,
                                                          "positions": 10}}
            if gate:
                rec["gate"] = {"r": 1.0, "pi_ratio": round(pi / 0.3, 6), "steered": pi / 0.3 < 1.0}
            records.append(rec)
            truth[d, r] = rec
    steer = ["trace", "when-drifting:r=1"] if gate else []
    manifest = {"protocol": "replay", "config": {"rounds": rounds, "probe_after": "agent", "steer": steer},
                "pairs": pairs,
                "conditions": ["persona"], "completed": True}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return truth


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("warn") / "run"
    _write_run(path)
    return path


@pytest.fixture(scope="module")
def found(run) -> dict[str, warn.Signal]:
    turns = warn.turns_frame(run)
    return {s.name: s for s in warn.analyse(turns, n_resamples=400)}


def test_the_rows_are_turns_with_a_next_turn_and_its_failure(run) -> None:
    turns = warn.turns_frame(run)
    assert len(turns) == 24 * 9 and set(turns["round"]) == set(range(1, 10))
    row = turns[(turns.pair == 0) & (turns["round"] == 3)].iloc[0]
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    mine = {r["round"]: r for r in records if r["pair"] == 0}
    assert row.tokens == sum(mine[r]["n_tokens"] for r in (1, 2, 3))  # the agent's tokens through turn 3
    assert row.fails_next == (mine[4]["score"] < 0.5) and row.score == mine[3]["score"]


def test_auroc_is_scikit_learns_on_the_same_arrays(run, found) -> None:
    turns = warn.turns_frame(run)
    y = turns.fails_next.to_numpy(bool)
    assert found["pi"].auroc == pytest.approx(roc_auc_score(y, -turns.pi.to_numpy()), abs=1e-12)
    assert found["round"].auroc == pytest.approx(roc_auc_score(y, turns["round"].to_numpy()), abs=1e-12)
    assert found["score"].auroc == pytest.approx(roc_auc_score(y, -turns.score.to_numpy()), abs=1e-12)


def test_intervals_resample_whole_dialogs() -> None:
    dialogs = np.repeat(np.arange(6), [3, 1, 4, 2, 5, 2])
    counts = resample_counts(len(dialogs), dialogs, 50, rng=1)
    for c in counts:  # each dialog drawn k times contributes all its turns k times
        per_dialog = [set(c[dialogs == d]) for d in range(6)]
        assert all(len(k) == 1 for k in per_dialog)
        assert sum(k.pop() for k in per_dialog) == 6  # 6 draws of a dialog
    assert len({tuple(c) for c in counts}) > 1


def test_a_signal_that_falls_before_each_failure_warns_with_a_lead(found) -> None:
    pi = found["pi"]
    assert pi.auroc > 0.95 and pi.within > 0.9 and pi.vs_turn_low > 0 and pi.warns
    assert pi.failing_dialogs == 12 and pi.warned == 12 and pi.lead_median == 1 and pi.false_alarms == 0


def test_a_signal_that_only_tells_dialogs_apart_is_no_warning_within_dialogs(found) -> None:
    influence = found["influence"]
    assert influence.auroc > 0.7 and abs(influence.within - 0.5) < 0.1
    reminded = found["reminded"]
    assert not reminded.warns and reminded.auroc_low < 0.5 < reminded.auroc_high
    assert found["round"].baseline and not found["round"].warns and found["round"].vs_turn == 0


def test_thresholds_are_chosen_without_the_dialogs_they_are_judged_on(monkeypatch) -> None:
    """Each fold's alarms use a threshold fitted on the other fold's turns only (values here carry their
    dialog's id, so the fit can be inspected)."""
    dialogs = np.repeat(np.arange(8), 5)
    fold = dialogs % 2
    values = dialogs * 100.0 + np.tile(np.arange(5), 8)
    labels = np.tile([False, False, False, True, True], 8)
    seen = []
    original = warn.youden_threshold

    def spy(scores, y):
        seen.append(set((scores // 100).astype(int)))
        return original(scores, y)

    monkeypatch.setattr(warn, "youden_threshold", spy)
    warn.cross_fitted_alarms(values, labels, fold)
    assert seen == [{1, 3, 5, 7}, {0, 2, 4, 6}]


def test_the_command_writes_its_table_json_and_figure(run, tmp_path) -> None:
    result = CliRunner().invoke(app, ["warn", "--from-run", str(run), "--out", str(tmp_path / "w")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "w" / "warn.json").read_text())
    assert [r["name"] for r in rows][:3] == ["round", "tokens", "score"] and \
        next(r for r in rows if r["name"] == "pi")["warns"] is True
    assert (tmp_path / "w" / "warn.png").stat().st_size > 5000
    # The run has pi and both KLs, not the projection: how to add it goes to stderr, the table to stdout.
    assert "not measured here: projection: read it afterwards with `driftlab directions`" in result.stderr
    assert "not measured here" not in result.stdout and "not measured here: pi" not in result.stderr


def test_a_run_that_scores_no_turns_is_refused_in_one_line(tmp_path) -> None:
    from driftlab.errors import DriftlabError

    (tmp_path / "sc").mkdir()
    (tmp_path / "sc" / "manifest.json").write_text(json.dumps({"protocol": "selfchat", "config": {}}))
    result = CliRunner().invoke(app, ["warn", "--from-run", str(tmp_path / "sc")])
    assert isinstance(result.exception, DriftlabError) and "a selfchat run" in result.exception.message


def test_a_signal_above_the_turn_index_only_pooled_tells_dialogs_apart() -> None:
    """Clearing the turn index pooled is not enough: within dialogs the signal must beat chance too."""
    base = dict(name="influence", label="prompt influence", baseline=False, n_turns=100, n_dialogs=20, auroc=0.8,
                auroc_low=0.7, auroc_high=0.9, vs_turn=0.2, vs_turn_low=0.05, vs_turn_high=0.3, failing_dialogs=5,
                warned=3, lead_median=1.0, quiet_dialogs=10, false_alarms=2)
    between = warn.Signal(**base, within=0.5, within_low=0.3, within_high=0.7)
    within = warn.Signal(**base, within=0.8, within_low=0.6, within_high=0.95)
    assert not between.warns and between.verdict == "tells dialogs apart, not turns"
    assert within.warns and within.verdict == "WARNS"


def test_where_the_gates_own_reading_warns_warn_names_the_gate_that_acts_on_it(tmp_path, run) -> None:
    """A monitoring gate recorded its reading (pi over the first turn's) at every turn; it falls a turn
    before each failure, so it warns, and warn writes the steer whose threshold separates the two levels
    (0.05 / 0.3 before a failure, about 1 else). A run without the reading gets no gate."""
    _write_run(tmp_path / "gated", gate=True)
    found, out, gate = warn.write_warn([tmp_path / "gated"], tmp_path / "w")
    by_name = {s.name: s for s in found}
    assert by_name["gate"].warns and gate is not None and gate.startswith("when-drifting:r=")
    r = float(gate.split("r=")[1])
    assert 0.05 / 0.3 <= r < 0.8
    assert json.loads((out / warn.GATE_JSON).read_text())["steer"] == gate
    assert warn.write_warn([run], tmp_path / "plain")[2] is None
    result = CliRunner().invoke(app, ["warn", "--from-run", str(tmp_path / "gated"), "-o", str(tmp_path / "cli")])
    assert result.exit_code == 0 and f"gate: --steer {gate}" in result.output


def test_where_the_turn_s_own_compliance_warns_the_gate_is_a_replay_s_score_gate(found) -> None:
    """No measure's reading to threshold: where the turn's own compliance clears the turn index as a warning
    must (pooled and within dialogs), the gate steers the turn after a failing one; else there is none."""
    turns = pd.DataFrame()
    own = dataclasses.replace(found["score"], vs_turn_low=0.02, within_low=0.6)
    rest = [s for s in found.values() if s.name not in ("score", "gate")]
    assert warn.gate_steer(turns, [own, *rest], "pi", fail_below=0.4) == "when-drifting:r=0.4,by=score"
    for weak in (dataclasses.replace(own, vs_turn_low=-0.01), dataclasses.replace(own, within_low=0.45)):
        assert warn.gate_steer(turns, [weak, *rest], "pi") is None


def test_the_measures_combined_are_fitted_without_the_dialog_they_score(found) -> None:
    """The combined signal warns where one of its measures does (pi here), and a turn's probability comes
    from a model fitted on other dialogs: relabelling one dialog changes every prediction but its own."""
    both = found["combined"]
    assert both.warns and both.auroc > 0.9
    gen = np.random.default_rng(0)
    dialogs = np.repeat(np.arange(20), 6)
    features = gen.normal(size=(len(dialogs), 3))
    labels = features[:, 0] + gen.normal(0, 0.5, len(dialogs)) > 0
    before = warn.combined(features, labels, dialogs, seed=0)
    relabelled = labels.copy()
    relabelled[dialogs == 3] = ~relabelled[dialogs == 3]
    after = warn.combined(features, relabelled, dialogs, seed=0)
    own = dialogs == 3
    np.testing.assert_array_equal(before[own], after[own])
    assert not np.allclose(before[~own], after[~own])
    assert roc_auc_score(labels, before) > 0.75  # it learns the signal from the other dialogs
    rare = np.zeros(len(dialogs), dtype=bool)
    rare[dialogs == 5] = True  # failures in one dialog only: the folds without it cannot be fitted
    assert np.isnan(warn.combined(features, rare, dialogs, seed=0)).any()


def test_replays_compared_show_their_compliance_curves_side_by_side(tmp_path, run) -> None:
    """`driftlab report RUN RUN`: where two runs or more are replays, compare.html carries their compliance per
    turn on one axes (compliance.png); a single replay gets none there (its own report has its curve)."""
    _write_run(tmp_path / "other", seed=1)
    page = CliRunner().invoke(app, ["report", str(run), str(tmp_path / "other"), "-o", str(tmp_path / "cmp")])
    assert page.exit_code == 0, page.output
    assert (tmp_path / "cmp" / "compliance.png").stat().st_size > 10_000
    assert "Compliance per turn" in (tmp_path / "cmp" / "compare.html").read_text()
    from driftlab.report.compare import _replay_curves
    from driftlab.report.results import summarize

    assert _replay_curves([run], [summarize(run)], tmp_path / "one.png") is None
