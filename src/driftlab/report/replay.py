"""A replay's compliance per turn: every agent turn's score, per round with its interval, and the drift.

Why per turn: a replay scores each agent turn (`protocol.replay`), so the curve a user asks for ("does
my model keep its prompt with users like mine?") is the share of compliant turns at turn 1, 2, ...
over dialogs. 0/1 measures get Wilson intervals, graded ones t or BCa (`stats.mean_interval`), as
every other per-round curve of driftlab. Drift is the last round against the first, paired over
the dialogs that reached both (exact McNemar for 0/1, Wilcoxon otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from driftlab.records.rundir import RunDir
from driftlab.stats import mean_interval, paired_test

COMPLIANCE_PNG = "compliance.png"


def compliance_frame(run_dir: str | Path) -> pd.DataFrame:
    """One row per agent turn: dialog (`pair`), round, its persona, the turn's score (NaN where the
    measure gave none: a reply cut at its token limit, or an error), tokens, finish reason and, under
    `when-drifting`, whether the turn was steered (1 or 0; NaN in a run without a gate)."""
    rd = RunDir(run_dir)
    agents = {p["pair"]: p["agent"] for p in rd.read_manifest().get("pairs", [])}
    rows = [{"pair": r["pair"], "round": r["round"], "agent": agents.get(r["pair"]),
             "score": np.nan if r.get("score") is None else float(r["score"]), "n_tokens": r["n_tokens"],
             "finish_reason": r["finish_reason"], "error": r.get("error"),
             "steered": np.nan if r.get("gate") is None else float(r["gate"]["steered"])}
            for r in rd.records() if r.get("kind") == "turn" and r.get("speaker") == "agent"]
    columns = ["pair", "round", "agent", "score", "n_tokens", "finish_reason", "error", "steered"]
    return pd.DataFrame(rows, columns=columns).sort_values(["pair", "round"], ignore_index=True)


def per_round(frame: pd.DataFrame) -> pd.DataFrame:
    """Per round: mean compliance over the dialogs scored there, its 95% interval (within [0, 1]),
    method and n; under a gate, the share of that round's turns it steered (NaN without one)."""
    rows = []
    for r in sorted(frame["round"].unique()):
        at = frame[frame["round"] == r]
        i = mean_interval(at["score"].astype(float))
        # scores live in [0, 1]: a t interval of a few dialogs may pass its ends
        rows.append({"round": int(r), "mean": i.estimate, "ci_low": float(np.clip(i.low, 0, 1)),
                     "ci_high": float(np.clip(i.high, 0, 1)), "ci_method": i.method, "n": i.n,
                     "steered": at["steered"].mean()})
    return pd.DataFrame(rows, columns=["round", "mean", "ci_low", "ci_high", "ci_method", "n", "steered"])


def drift(frame: pd.DataFrame) -> dict[str, Any] | None:
    """The last round against the first, paired over the dialogs scored at both; None below 2 rounds."""
    rounds = sorted(frame["round"].unique())
    if len(rounds) < 2:
        return None
    first, last = rounds[0], rounds[-1]
    at = lambda r: frame[frame["round"] == r].set_index("pair")["score"].dropna().to_dict()  # noqa: E731
    test = paired_test(at(last), at(first))
    return {"first": int(first), "last": int(last), "diff": test.diff.estimate, "diff_ci_low": test.diff.low,
            "diff_ci_high": test.diff.high, "ci_method": test.diff.method, "method": test.method, "p": test.p,
            "n": test.n}


def compliance_figure(frame: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Each dialog a thin line (jittered a little where scores are 0/1), the mean per round with its
    95% band: the compliance curve."""
    from matplotlib.figure import Figure

    from driftlab.report.figures import round_ticks, save_png

    table = per_round(frame)
    fig = Figure(figsize=(7, 3.6), layout="constrained", dpi=120)
    ax = fig.add_subplot()
    rng = np.random.default_rng(0)
    for _, dialog in frame.groupby("pair"):
        ax.plot(dialog["round"], dialog["score"] + rng.uniform(-0.015, 0.015, len(dialog)), color="0.75", lw=0.6,
                zorder=1)
    ax.fill_between(table["round"], table["ci_low"], table["ci_high"], color="C0", alpha=0.25, lw=0, zorder=2,
                    label="95% interval")
    ax.plot(table["round"], table["mean"], color="C0", lw=2, marker="o", ms=3, zorder=3, label="mean")
    if table["steered"].notna().any():  # a gated run: what the compliance cost in steered turns
        ax.plot(table["round"], table["steered"], color="C3", lw=1.2, ls="--", zorder=3, label="share steered")
    ax.set(xlabel="agent turn (round)", ylabel="compliance (the turn's score)", ylim=(-0.05, 1.05),
           title=title or f"compliance per turn, {frame['pair'].nunique()} dialogs")
    round_ticks(ax, table["round"].tolist())
    ax.legend(loc="lower left", fontsize=8, frameon=False)
    return save_png(fig, path)


def curves_figure(frames: dict[str, pd.DataFrame], path: str | Path) -> Path:
    """Several replays' compliance per turn on one axes, each mean with its 95% band: the conditions of a
    study (plain, a steer always on, the steer gated) side by side, as `driftlab report RUN RUN ...` draws
    them where the runs are replays."""
    from matplotlib.figure import Figure

    from driftlab.report.figures import round_ticks, save_png

    fig = Figure(figsize=(7, 3.6), layout="constrained", dpi=120)
    ax = fig.add_subplot()
    rounds: set[int] = set()
    for k, (label, frame) in enumerate(frames.items()):
        table = per_round(frame)
        ax.fill_between(table["round"], table["ci_low"], table["ci_high"], color=f"C{k}", alpha=0.15, lw=0)
        ax.plot(table["round"], table["mean"], color=f"C{k}", lw=2, marker="o", ms=3,
                label=f"{label} ({frame['pair'].nunique()} dialogs)")
        rounds |= set(table["round"].tolist())
    ax.set(xlabel="agent turn (round)", ylabel="compliance (mean, 95% band)", ylim=(-0.05, 1.05),
           title="compliance per turn")
    round_ticks(ax, sorted(rounds))
    ax.legend(loc="lower left", fontsize=8, frameon=False)
    return save_png(fig, path)


def write_replay_figures(run_dir: str | Path) -> list[Path]:
    """`driftlab report RUN` for a replay: the compliance table on stderr and compliance.png (the other
    measures of a run that took them: `cli.finish.print_measures`)."""
    frame = compliance_frame(run_dir)
    if frame.empty:
        return []
    print_compliance(frame)
    return [compliance_figure(frame, Path(run_dir) / COMPLIANCE_PNG)]


def print_compliance(frame: pd.DataFrame) -> None:
    """The per-round compliance table, and the drift from the first round to the last, on stderr."""
    from rich.console import Console
    from rich.table import Table

    gated = frame["steered"].notna().any()
    table = Table(title=f"compliance per turn ({frame['pair'].nunique()} dialogs)", caption=_drift_note(frame))
    for col in ("round", "compliance", "95% interval", "n", *(["steered"] if gated else [])):
        table.add_column(col, justify="right")
    for row in per_round(frame).itertuples():
        table.add_row(str(row.round), f"{row.mean:.3f}", f"[{row.ci_low:.3f}, {row.ci_high:.3f}] {row.ci_method}",
                      str(row.n), *([f"{row.steered:.2f}"] if gated else []))
    Console(stderr=True).print(table)


def _drift_note(frame: pd.DataFrame) -> str:
    d = drift(frame)
    steered = frame["steered"].dropna()
    gate = f"; the gate steered {int(steered.sum())} of {len(steered)} turns" if len(steered) else ""
    if d is None:
        return "one round: no drift to test" + gate
    return (f"round {d['last']} minus round {d['first']}: {d['diff']:+.3f} [{d['diff_ci_low']:+.3f}, "
            f"{d['diff_ci_high']:+.3f}], {d['method']} p = {d['p']:.3g}, n = {d['n']} dialogs{gate}")
