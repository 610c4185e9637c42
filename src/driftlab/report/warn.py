"""Which measure warns before the instruction breaks: `driftlab warn --from-run RUN`.

A warning is a number read at agent turn t that says turn t + 1 will fail (its score below
`fail_below`, 0.5 by default), in a run that scores every agent turn (`driftlab replay`). The
measures are those a run recorded per turn (`report.activation.measures_frame`: pi, the projection,
the reminded KL, the prompt's influence), each read in the direction that means drift (TURN_MEASURES'
sign, negated). Three baselines a warning must beat, known for free at turn t: the turn index, the
agent tokens so far, and turn t's own compliance (a turn that already slipped).

Per signal:
* AUROC for "the next turn fails" over every turn that has a next one, with a 95% interval from a
  bootstrap over dialogs (a dialog's turns are not independent);
* within dialogs: the same AUROC on values centred per dialog, over dialogs that both hold and fail,
  since a measure that only tells easy prompts from hard ones is no warning;
* AUROC minus the turn index's, on the same resamples (paired): a signal counts as a **warning**
  only where that difference's interval lies above 0, and its within-dialog interval above 0.5 (one
  that clears the turn index only pooled "tells dialogs apart, not turns");
* lead time: a threshold chosen on the other half of the dialogs (two folds by dialog, Youden's J),
  then per dialog that held at turn 1 and later failed, whether an alarm came at least one turn
  before its first failure and how many turns before; and how many dialogs that never failed raised
  an alarm anyway.

Where a run measured two measures or more, one more signal combines them: a logistic regression of
"the next turn fails" on the measures (each through its quantiles), fitted on the other dialogs only
(five folds by dialog) and read on each turn as its predicted probability. It asks whether the measures warn together
where none does alone; a residual-stream probe fitted to failures is this kind of signal ("When
Attention Closes", arXiv 2605.12922). It is judged like the others, on predictions no turn's own dialog
was fitted on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score

from driftlab.errors import DriftlabError
from driftlab.report.activation import PASS, TURN_MEASURES, measures_frame
from driftlab.report.replay import compliance_frame
from driftlab.report.tables import TextTable
from driftlab.stats import auroc_resamples, percentile_interval, resample_counts

N_RESAMPLES = 2000
CONFIDENCE = 0.95
WARN_JSON, WARN_CSV, WARN_PNG, GATE_JSON = "warn.json", "warn.csv", "warn.png", "gate.json"
# The baselines: column, label, the sign that makes larger mean more likely to fail.
BASELINES = (("round", "turn index", 1), ("tokens", "agent tokens so far", 1), ("score", "this turn's compliance", -1))


@dataclass(frozen=True)
class Signal:
    """One signal's verdict as a warning (see the module docstring)."""

    name: str
    label: str
    baseline: bool
    n_turns: int
    n_dialogs: int
    auroc: float
    auroc_low: float
    auroc_high: float
    within: float
    within_low: float
    within_high: float
    vs_turn: float
    vs_turn_low: float
    vs_turn_high: float
    failing_dialogs: int
    warned: int
    lead_median: float
    quiet_dialogs: int
    false_alarms: int

    @property
    def warns(self) -> bool:
        """Counts as a warning: above the turn index (that difference's interval clear of 0), and within
        dialogs above chance (that interval clear of 0.5): not only a sign of which dialogs fail."""
        return not self.baseline and self.vs_turn_low > 0 and self.within_low > 0.5

    @property
    def verdict(self) -> str:
        if self.baseline:
            return "baseline"
        if self.warns:
            return "WARNS"
        if self.vs_turn_low > 0:
            return "tells dialogs apart, not turns"
        return "no better than the turn index"


def turns_frame(*run_dirs: str | Path, fail_below: float = PASS) -> pd.DataFrame:
    """One row per agent turn t that has a scored next turn: its measures, the baselines, and
    `fails_next` (turn t + 1 scored below `fail_below`)."""
    frame = measures_frame(*run_dirs)
    turns = frame[frame.what == "turn"].drop(columns="what").copy()
    tokens = compliance_frame(run_dirs[0]).set_index(["pair", "round"])["n_tokens"]
    turns["tokens"] = [tokens.get((p, r), 0) for p, r in zip(turns.pair, turns["round"], strict=True)]
    turns = turns.sort_values(["pair", "round"])
    turns["tokens"] = turns.groupby("pair")["tokens"].cumsum()  # through turn t: what the model had written
    nxt = turns.set_index(["pair", "round"])["score"]
    turns["next_score"] = [nxt.get((p, r + 1), np.nan) for p, r in zip(turns.pair, turns["round"], strict=True)]
    turns = turns[turns.next_score.notna()].copy()
    turns["fails_next"] = turns.next_score < fail_below
    return turns.reset_index(drop=True)


# The measures combined: the cross-fitted probability that the next turn fails (`combined`).
COMBINED = ("combined", "measures combined (fitted on other dialogs)", 1)
FOLDS = 5


# when-drifting's own reading (its signal over the first turn's), where the run recorded it: the quantity a
# gate thresholds, so a warning there is one the gate can act on as it stands.
GATE = ("gate", "when-drifting's reading", -1)


def signals(turns: pd.DataFrame) -> list[tuple[str, str, int, bool]]:
    """(column, label, warning sign, is a baseline) of every signal the run measured (the measures
    combined where it measured two or more)."""
    measures = [(c, label, -sign, False) for c, label, sign in TURN_MEASURES if turns[c].notna().any()]
    gate = [(*GATE, False)] if turns[GATE[0]].notna().any() else []
    both = [(*COMBINED, False)] if len(measures) >= 2 else []
    return [*[(c, label, sign, True) for c, label, sign in BASELINES], *measures, *both, *gate]


# How to get a measure a run did not record: pi at generation time; the others afterwards, from its records.
_JOIN = ", and pass that run as one more --from-run"
ADD_LATER = {"pi": "record it with `--steer trace` on the replay",
             "projection": "read it afterwards with `driftlab directions`, then `driftlab project --from-run RUN "
                           "--directions DIRS`" + _JOIN,
             "reminded": "read it afterwards with `driftlab kl --from-run RUN`" + _JOIN,
             "influence": "read it afterwards with `driftlab kl --from-run RUN`" + _JOIN}


def unmeasured(found: list[Signal]) -> list[tuple[str, str]]:
    """(label, how to add it) of each turn measure the analysed runs did not record."""
    names = {s.name for s in found}
    return [(label, ADD_LATER[c]) for c, label, _ in TURN_MEASURES if c not in names]


def combined(features: np.ndarray, labels: np.ndarray, dialogs: np.ndarray, seed: int) -> np.ndarray:
    """Per row, the probability that the next turn fails by a logistic regression on `features`, fitted
    on the rows of the other folds' dialogs only (FOLDS folds by dialog, drawn from `seed`): no row is
    scored by a model that saw its dialog. Each feature enters through its quantiles, mapped to a normal
    (fitted on the same rows): the KLs are heavy-tailed, and a few turns of large KL would otherwise set
    the scale (standardised raw KLs fell below chance on the qwen replay, whose prompt influence alone
    reaches 0.73). NaN in a fold whose training rows hold one class only."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import QuantileTransformer

    out = np.full(len(labels), np.nan)
    folds = GroupKFold(n_splits=min(FOLDS, len(set(dialogs))), shuffle=True, random_state=seed)
    for train, test in folds.split(features, labels, dialogs):
        if labels[train].all() or not labels[train].any():
            continue
        ranks = QuantileTransformer(n_quantiles=min(100, len(train)), output_distribution="normal")
        model = make_pipeline(ranks, LogisticRegression()).fit(features[train], labels[train])
        out[test] = model.predict_proba(features[test])[:, 1]
    return out


def gate_steer(turns: pd.DataFrame, found: list[Signal], by: str, fail_below: float = PASS) -> str | None:
    """The gate that acts on a warning, or None. Where when-drifting's reading warns:
    `when-drifting:r=R[,by=...]`, with R the reading below which the next turn fails most often (Youden's
    J over this run's dialogs, all held out from the runs it will steer; the lead times beside it are
    cross-fitted over dialogs). Else, where the turn's own compliance clears the turn index as a warning
    must (pooled and within dialogs): a replay's `when-drifting:r=FAIL_BELOW,by=score`, which steers the
    turn after a failing one (no threshold to fit: a failure is the reading)."""
    if not any(s.name == GATE[0] and s.warns for s in found):
        own = next((s for s in found if s.name == "score"), None)
        beats = own is not None and own.vs_turn_low > 0 and own.within_low > 0.5
        return f"when-drifting:r={fail_below:.4g},by=score" if beats else None
    rows = turns.dropna(subset=[GATE[0]])
    threshold = youden_threshold(GATE[2] * rows[GATE[0]].to_numpy(float), rows.fails_next.to_numpy(bool))
    r = min(max(-threshold, 1e-6), 1.0)
    return f"when-drifting:r={r:.4g}" + ("" if by == "pi" else f",by={by}")


def centred(values: np.ndarray, dialogs: np.ndarray) -> np.ndarray:
    """Each value minus its dialog's mean: what is left tells turns of one dialog apart."""
    _, group = np.unique(dialogs, return_inverse=True)
    means = np.bincount(group, weights=values) / np.bincount(group)
    return values - means[group]


def analyse(turns: pd.DataFrame, fail_below: float = PASS, seed: int = 0,
            n_resamples: int = N_RESAMPLES) -> list[Signal]:
    """Every signal's verdict, all on the same rows (turns where every measured signal has a value)
    and the same bootstrap resamples of dialogs."""
    spec = signals(turns)
    rows = turns.dropna(subset=[c for c, *_ in spec if c != COMBINED[0]]).reset_index(drop=True)
    y, dialogs = rows.fails_next.to_numpy(bool), rows.pair.to_numpy()
    if any(c == COMBINED[0] for c, *_ in spec):
        measured = [c for c, _, _, baseline in spec if not baseline and c not in (COMBINED[0], GATE[0])]
        fitted = combined(rows[measured].to_numpy(float), y, dialogs, seed)
        if np.isnan(fitted).any():  # some fold had one class to fit on: too few failures to combine
            spec = [s for s in spec if s[0] != COMBINED[0]]
        else:
            rows[COMBINED[0]] = fitted
    values = {c: sign * rows[c].to_numpy(float) for c, _, sign, _ in spec}
    within_rows = rows.groupby("pair").fails_next.transform(lambda s: 0 < s.sum() < len(s)).to_numpy(bool)
    inside = {c: centred(v, dialogs)[within_rows] for c, v in values.items()}
    # Every resample at once, the same counts for every signal (paired). A dialog drawn k times keeps its
    # mean, so the within-dialog values need no centring again per resample.
    counts = resample_counts(len(rows), dialogs, n_resamples, seed)
    boot = {c: (auroc_resamples(values[c], y, counts), auroc_resamples(inside[c], y[within_rows],
                                                                        counts[:, within_rows]))
            for c in values}
    turn_boot = boot["round"][0]
    leads = lead_times(rows, values, fail_below, seed)
    out = []
    for c, label, _, baseline in spec:
        auc = _auroc(values[c], y)
        diffs = boot[c][0] - turn_boot
        out.append(Signal(c, label, baseline, len(rows), len(set(dialogs)), auc,
                          *percentile_interval(boot[c][0], n_resamples, CONFIDENCE),
                          _auroc(inside[c], y[within_rows]), *percentile_interval(boot[c][1], n_resamples, CONFIDENCE),
                          auc - _auroc(values["round"], y), *percentile_interval(list(diffs), n_resamples, CONFIDENCE),
                          **leads[c]))
    return out


def _auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """scikit-learn's AUROC; NaN where one class is missing."""
    return float(roc_auc_score(labels, scores)) if 0 < labels.sum() < len(labels) else float("nan")


def youden_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """The value at least which an alarm is raised that maximises TPR - FPR on these turns; +inf
    (never alarm) where one class is missing."""
    if not 0 < labels.sum() < len(labels):
        return float("inf")
    candidates = np.unique(scores)
    tpr = np.array([(scores[labels] >= t).mean() for t in candidates])
    fpr = np.array([(scores[~labels] >= t).mean() for t in candidates])
    return float(candidates[int(np.argmax(tpr - fpr))])


def lead_times(rows: pd.DataFrame, values: dict[str, np.ndarray], fail_below: float,
               seed: int) -> dict[str, dict[str, float | int]]:
    """Per signal, with thresholds cross-fitted over two folds of dialogs: failing dialogs (held at
    turn 1, failed later), those warned at least one turn before their first failure, the median lead
    (turns) of those, dialogs that never failed, and those of them that raised an alarm."""
    dialogs = np.array(sorted(rows.pair.unique()))
    fold = dict(zip(np.random.default_rng(seed).permutation(dialogs), np.arange(len(dialogs)) % 2, strict=True))
    in_fold = rows.pair.map(fold).to_numpy()
    y = rows.fails_next.to_numpy(bool)
    first = _first_failures(rows, fail_below)
    out = {}
    for c, v in values.items():
        alarms = rows.assign(alarm=cross_fitted_alarms(v, y, in_fold))
        leads, quiet, false_alarms = [], 0, 0
        for pair, part in alarms.groupby("pair"):
            raised = part["round"][part.alarm]
            if pair not in first:
                quiet += 1
                false_alarms += bool(len(raised))
            elif first[pair] > 1:
                early = raised[raised < first[pair]]
                leads.append(first[pair] - early.min() if len(early) else np.nan)
        warned = [x for x in leads if np.isfinite(x)]
        out[c] = {"failing_dialogs": len(leads), "warned": len(warned),
                  "lead_median": float(np.median(warned)) if warned else float("nan"),
                  "quiet_dialogs": quiet, "false_alarms": false_alarms}
    return out


def cross_fitted_alarms(values: np.ndarray, labels: np.ndarray, fold: np.ndarray) -> np.ndarray:
    """Alarms (value >= threshold) where each fold's threshold is chosen on the other fold's turns
    only: a threshold never sees the dialogs it is judged on."""
    alarm = np.zeros(len(values), dtype=bool)
    for k in np.unique(fold):
        threshold = youden_threshold(values[fold != k], labels[fold != k])
        alarm[fold == k] = values[fold == k] >= threshold
    return alarm


def _first_failures(rows: pd.DataFrame, fail_below: float) -> dict[int, int]:
    """Per dialog, the first turn scored below `fail_below` (turn 1 from its own score, later turns
    from the row before them)."""
    out: dict[int, int] = {}
    for pair, part in rows.sort_values("round").groupby("pair"):
        if part["score"].iloc[0] < fail_below and part["round"].iloc[0] == 1:
            out[pair] = 1
            continue
        failing = part["round"][part.fails_next]
        if len(failing):
            out[pair] = int(failing.min()) + 1
    return out


def write_warn(run_dirs: list[Path], out: Path, fail_below: float = PASS,
               seed: int = 0) -> tuple[list[Signal], Path, str | None]:
    """Analyse, then write warn.json, warn.csv and warn.png into `out`, and gate.json where the gate's own
    reading warns (`gate_steer`: the steer that acts on it)."""
    turns = turns_frame(*run_dirs, fail_below=fail_below)
    if turns.empty:
        raise DriftlabError(f"{run_dirs[0]} has no agent turn followed by a scored one: nothing to predict.",
                            hint="Let the replay run two rounds or more (the same command resumes it).")
    found = analyse(turns, fail_below, seed)
    out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame([{**asdict(s), "warns": s.warns, "verdict": s.verdict} for s in found])
    table.to_csv(out / WARN_CSV, index=False)
    (out / WARN_JSON).write_text(table.to_json(orient="records", indent=2))
    figure(found, out / WARN_PNG, fail_below)
    gate = gate_steer(turns, found, _gate_signal(run_dirs[0]), fail_below)
    if gate is not None:
        (out / GATE_JSON).write_text(json.dumps({"steer": gate, "fail_below": fail_below}, indent=2))
    else:  # (an earlier analysis of other records may have named one)
        (out / GATE_JSON).unlink(missing_ok=True)
    return found, out, gate


def _gate_signal(run_dir: Path) -> str:
    """What the run's `when-drifting` read ('pi' or 'projection'; 'pi' where it had none)."""
    from driftlab.protocol.runner import config_of
    from driftlab.records.rundir import RunDir
    from driftlab.steering.interventions import Interventions

    steer = Interventions.parse(config_of(RunDir(run_dir).read_manifest()).get("steer") or [])
    gate = steer.get("when-drifting")
    return "pi" if gate is None else gate.by


def figure(found: list[Signal], path: Path, fail_below: float) -> Path:
    """Each signal's AUROC for the next turn's failure, pooled and within dialogs, with 95% intervals;
    the turn index's as a line every warning must clear."""
    from matplotlib.figure import Figure

    from driftlab.report.figures import save_png

    fig = Figure(figsize=(7, 0.5 * len(found) + 1.6), layout="constrained", dpi=120)
    ax = fig.add_subplot()
    ys = np.arange(len(found))[::-1]
    for y, s in zip(ys, found, strict=True):
        color = "C2" if s.warns else ("0.5" if s.baseline else "C0")
        ax.errorbar(s.auroc, y + 0.12, xerr=[[s.auroc - s.auroc_low], [s.auroc_high - s.auroc]], fmt="o",
                    color=color, capsize=3, label="pooled" if y == ys[0] else None)
        ax.errorbar(s.within, y - 0.12, xerr=[[s.within - s.within_low], [s.within_high - s.within]], fmt="s",
                    color=color, mfc="white", capsize=3, label="within dialogs" if y == ys[0] else None)
    turn = next(s for s in found if s.name == "round")
    ax.axvline(turn.auroc, color="0.5", ls="--", lw=1)
    ax.axvline(0.5, color="0.8", lw=1)
    ax.set_yticks(ys, [s.label + (" (baseline)" if s.baseline else "") for s in found])
    ax.set(xlim=(0, 1.03), xlabel=f"AUROC: the next agent turn fails (score < {fail_below})")
    fig.suptitle(f"which signal warns ({found[0].n_dialogs} dialogs, {found[0].n_turns} turns)")  # over the labels too
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return save_png(fig, path)


def table(found: list[Signal], fail_below: float = PASS) -> TextTable:
    """The terminal table of `driftlab warn`."""
    def cell(value: float, low: float, high: float, signed: bool = False) -> str:
        f = "{:+.2f}" if signed else "{:.2f}"
        return "n/a" if not np.isfinite(value) else f"{f.format(value)} [{f.format(low)}, {f.format(high)}]"

    rows = []
    for s in found:
        lead = f"{s.warned}/{s.failing_dialogs}" + (f", median {s.lead_median:g} turns" if s.warned else "")
        rows.append([s.label, cell(s.auroc, s.auroc_low, s.auroc_high), cell(s.within, s.within_low, s.within_high),
                     "" if s.name == "round" else cell(s.vs_turn, s.vs_turn_low, s.vs_turn_high, signed=True), lead,
                     f"{s.false_alarms}/{s.quiet_dialogs}", s.verdict])
    n = found[0]
    return TextTable(f"which signal warns: the next agent turn fails (score < {fail_below}); "
                     f"{n.n_turns} turns of {n.n_dialogs} dialogs",
                     ["signal", "AUROC [95% CI]", "within dialogs", "minus turn index", "warned in time",
                      "false alarms", "verdict"], rows,
                     "Intervals: bootstrap over dialogs. A signal warns where its AUROC minus the turn index's (same "
                     "resamples) stays above 0 and its AUROC within dialogs above 0.5. Warned in time: dialogs that held at turn 1 and failed later, alarmed "
                     "at least one turn before; thresholds chosen on the other half of the dialogs.")
