"""Summary tables as plain strings, shared by the terminal (rich) and the HTML report.

One place decides what a cell says ("0.42 [0.31, 0.55]"), so `driftlab run`, `driftlab
report` and report.html never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from driftlab.report.metrics import ALL, CONFIDENCE, TARGET_LABELS, RunSummary, category_order

CONDITION_LABELS = {"persona": "user with persona", "empty-user": "user without system prompt"}
SHORT_CONDITION = {"empty-user": "empty-user ablation"}


@dataclass
class TextTable:
    """A titled grid of strings; `note` explains the cells."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str


def fmt(x: float, digits: int = 2) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def fmt_cell(mean: float, lo: float, hi: float, digits: int = 2) -> str:
    """mean [lo, hi]; just the mean when the CI is undefined (n < 2)."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} [{fmt(lo, digits)}, {fmt(hi, digits)}]"


def column_label(condition: str, target: str) -> str:
    label = TARGET_LABELS.get(target, target)
    return label if condition == "persona" else f"{label}, {SHORT_CONDITION.get(condition, condition)}"


def series_keys(summary: RunSummary) -> list[tuple[str, str]]:
    """(condition, target) pairs present, in manifest condition order, agent before user."""
    df = summary.per_round
    keys = list(dict.fromkeys(zip(df["condition"], df["target"])))
    return keys


def _cell_with_n(row: pd.Series, n_max: int) -> str:
    cell = fmt_cell(row["mean"], row["ci_low"], row["ci_high"])
    return cell if int(row["n"]) == n_max else f"{cell} (n={int(row['n'])})"


def round_table(summary: RunSummary) -> TextTable:
    """Rounds as rows, one column per (condition, target), pooled over categories, plus an
    'overall' row (each conversation's mean over the common probe rounds)."""
    pooled = summary.per_round[summary.per_round["category"] == ALL]
    overall = summary.overall[summary.overall["category"] == ALL]
    keys = series_keys(summary)
    columns = ["round"]
    n_max: dict[tuple[str, str], int] = {}
    for key in keys:
        cells = pooled[(pooled["condition"] == key[0]) & (pooled["target"] == key[1])]
        n_max[key] = int(cells["n"].max())
        columns.append(f"{column_label(*key)} (n={n_max[key]})")
    rows = []
    for rnd in sorted(pooled["round"].unique()):
        row = [str(int(rnd))]
        for key in keys:
            cell = pooled[
                (pooled["condition"] == key[0]) & (pooled["target"] == key[1]) & (pooled["round"] == rnd)
            ]
            row.append(_cell_with_n(cell.iloc[0], n_max[key]) if len(cell) else "")
        rows.append(row)
    row = ["overall"]
    for key in keys:
        cell = overall[(overall["condition"] == key[0]) & (overall["target"] == key[1])]
        row.append(_cell_with_n(cell.iloc[0], n_max[key]) if len(cell) else "")
    rows.append(row)
    return TextTable(
        title="Probe scores by round (mean over conversations)",
        columns=columns,
        rows=rows,
        note=f"mean [{CONFIDENCE:.0%} CI over conversations: {ci_methods(summary)}]; scores in [0, 1], "
        "higher = persona followed. 'overall': each conversation's mean over the probe rounds. 'adoption above "
        "round 1': the user-persona score minus the same conversation's round-1 score (p_A answered before any "
        "word of the user LM), in [-1, 1].",
    )


def category_table(summary: RunSummary) -> TextTable:
    """Categories (of the persona being probed) as rows, overall stability per (condition, target)."""
    ov = summary.overall
    keys = series_keys(summary)
    columns = ["category", *(column_label(*k) for k in keys)]
    rows = []
    for cat in category_order(ov["category"]):
        row = [cat]
        for key in keys:
            cell = ov[(ov["condition"] == key[0]) & (ov["target"] == key[1]) & (ov["category"] == cat)]
            row.append(
                f"{fmt_cell(*cell.iloc[0][['mean', 'ci_low', 'ci_high']])} (n={int(cell.iloc[0]['n'])})"
                if len(cell) and int(cell.iloc[0]["n"])
                else ""
            )
        rows.append(row)
    return TextTable(
        title="Overall score by persona category",
        columns=columns,
        rows=rows,
        note="Category of the persona being probed: the agent's own for stability, the user's for "
        "adoption. Each conversation averaged over the probe rounds, then mean [95% CI] (n conversations); "
        f"CI: {ci_methods(summary)}.",
    )


def ci_methods(summary: RunSummary) -> str:
    """The interval methods the summary's cells used, in words (t below 30 conversations, ...)."""
    from driftlab.stats import METHOD_LABELS

    used = pd.concat([summary.per_round, summary.overall])
    used = used[used["n"] > 1]["ci_method"] if "ci_method" in used else pd.Series(["bca"])
    names = [METHOD_LABELS.get(m, m) for m in dict.fromkeys(used.dropna())]
    return ", ".join(names) + " (chosen by n: t below 30, BCa bootstrap from 30, Wilson for 0/1 values)" \
        if names else "none (n < 2)"


PAIRED_COLUMNS = ["n", "mean [95% CI]", "better/worse/tied", "test", "p", "p_holm", "verdict"]


def paired_cells(r) -> list[str]:
    """The cells of one paired test's row (a `PairedTest.as_dict` row with its `warning`), as `PAIRED_COLUMNS`."""
    return [str(r.n), fmt_cell(r.diff, r.diff_ci_low, r.diff_ci_high), f"{r.better}/{r.worse}/{r.tied}", r.method,
            fmt(r.p, 3), fmt(r.p_holm, 3), r.warning or "supported (p_holm < 0.05)"]


def comparison_table(summary: RunSummary) -> TextTable | None:
    """Each condition against the first, paired by conversation (`compare_conditions`); None with one condition."""
    cmp = summary.comparisons
    if cmp is None or cmp.empty:
        return None
    rows = [[TARGET_LABELS.get(r.target, r.target),
             f"{SHORT_CONDITION.get(r.condition, r.condition)} - {SHORT_CONDITION.get(r.versus, r.versus)}", *paired_cells(r)]
            for r in cmp.itertuples()]
    return TextTable(
        title="Conditions compared on the same conversations",
        columns=["target", "difference", *PAIRED_COLUMNS],
        rows=rows,
        note="Each conversation's mean over the probe rounds both conditions reached, differenced pair by pair; "
             "the CI is a t-interval below 30 pairs (BCa bootstrap from 30; Newcombe's paired interval when every "
             "value is 0 or 1); p: two-sided, Holm-corrected over "
             "the comparisons of this run (p_holm).",
    )


def drift_table(summary: RunSummary) -> TextTable | None:
    """The last probe round against the first, per condition and target (`drift_tests`); None without two rounds."""
    drift = summary.drift
    if drift is None or drift.empty:
        return None
    rows = [[column_label(r.condition, r.target), f"round {r.last} - round {r.first}", *paired_cells(r)]
            for r in drift.itertuples()]
    return TextTable(
        title="Drift: the last probe round against the first, on the same conversations",
        columns=["score", "difference", *PAIRED_COLUMNS],
        rows=rows,
        note="Each conversation's score at the last probe round every conversation reached minus its score at the "
             "first (repeated probes averaged); a negative agent difference is drift away from the system prompt, a "
             "positive adoption difference is the user's persona taken on (better = higher). Exact McNemar for 0/1 scores, else "
             "Wilcoxon signed-rank; the CI is a t-interval below 30 pairs; p two-sided, Holm over these rows.",
    )
