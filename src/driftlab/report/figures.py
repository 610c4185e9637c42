"""Figure 3 of both drift papers, drawn from a run's summary (PNG, matplotlib without pyplot).

`drift_figure`: x = round, y = mean probe score in [0, 1]; blue = the agent keeps its own
persona (f_B), orange = the agent adopts the user's persona (f_A). One panel per condition;
with the ablation a second panel shows the empty-user condition, as in Figure 3B of the
instruction-stability paper.
`category_figure`: the same lines split by category of the persona being probed.

Uncertainty: by default a band with the 95% CI of the mean (t-interval below 30
conversations, BCa bootstrap from 30: `driftlab.stats.mean_interval`; it shrinks with n,
so it says whether a drop is real); `errors="std"` draws +-1 std error bars as the paper
does (the spread of single conversations). The figure says which one it shows.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Literal

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from driftlab.protocol.runner import config_of
from driftlab.report.metrics import ALL, CONFIDENCE, N_RESAMPLES, RunSummary, category_order
from driftlab.report.tables import CONDITION_LABELS, series_keys
from driftlab.stats import BOOTSTRAP_MIN_N

Errors = Literal["ci", "std"]
COLORS = {"agent": "#1f77b4", "user": "#ff7f0e"}  # the paper's blue and orange
LABELS = {"agent": "agent persona (stability, $f_B$)", "user": "user persona (adoption, $f_A$)"}
STYLES = {"persona": "-", "empty-user": "--"}
DPI = 130


def error_note(errors: Errors) -> str:
    if errors == "ci":
        return (
            f"Bands: {CONFIDENCE:.0%} CI of the mean over conversations (t-interval below "
            f"{BOOTSTRAP_MIN_N} conversations, BCa bootstrap with {N_RESAMPLES} resamples from "
            f"{BOOTSTRAP_MIN_N}; Wilson for 0/1 scores). Repeats averaged per conversation."
        )
    return "Error bars: ±1 std across conversations (as in the paper's Figure 3). Repeats averaged."


def model_title(manifest: dict) -> str:
    """'smollm2-135m' or 'agent X, user Y', plus the steering if any."""
    cfg = config_of(manifest)
    agent = cfg.get("backend", {}).get("model", "?")
    user = cfg.get("user_model")
    text = agent if not user or user == agent else f"agent {agent}, user {user}"
    if cfg.get("steer"):
        text += f" · steer: {', '.join(cfg['steer'])}"
    return text


def _series(df: pd.DataFrame, condition: str, target: str) -> pd.DataFrame:
    sel = df[(df["condition"] == condition) & (df["target"] == target)]
    return sel.sort_values("round")


def _plot(ax: Axes, cells: pd.DataFrame, color: str, label: str, errors: Errors, style: str = "-") -> None:
    x = cells["round"].to_numpy(float)
    y = cells["mean"].to_numpy(float)
    ax.plot(x, y, style, color=color, marker="o", ms=4, lw=1.8, label=label)
    if errors == "ci":
        ax.fill_between(
            x,
            cells["ci_low"].to_numpy(float),
            cells["ci_high"].to_numpy(float),
            color=color,
            alpha=0.18,
            lw=0,
        )
    else:
        ax.errorbar(
            x,
            y,
            yerr=cells["std"].to_numpy(float),
            fmt="none",
            ecolor=color,
            elinewidth=1,
            capsize=3,
            alpha=0.8,
        )


def round_ticks(ax: Axes, rounds) -> None:
    """Whole-round ticks on the x axis: every round of a short dialog, at most about ten of a long one."""
    ax.xaxis.set_major_locator(MaxNLocator(nbins=min(max(len(rounds), 1), 10), integer=True))


def _style_axes(ax: Axes, rounds: list[int]) -> None:
    ax.set_ylim(-0.03, 1.03)
    round_ticks(ax, rounds)
    if rounds:
        ax.set_xlim(min(rounds) - 0.4, max(rounds) + 0.4)
    ax.set_xlabel("round")
    ax.grid(alpha=0.3, lw=0.6)
    ax.spines[["top", "right"]].set_visible(False)


def drift_figure(summary: RunSummary, path: str | Path, errors: Errors = "ci") -> Path:
    """The Figure-3 plot: one panel per condition (A: user with persona, B: empty user)."""
    pooled = summary.per_round[summary.per_round["category"] == ALL]
    conditions = list(dict.fromkeys(c for c, _ in series_keys(summary)))
    rounds = sorted(int(r) for r in pooled["round"].unique())
    fig = Figure(figsize=(5.2 * len(conditions) + 0.6, 4.3), layout="constrained", dpi=DPI)
    axes = fig.subplots(1, len(conditions), sharey=True, squeeze=False)[0]
    for k, (ax, cond) in enumerate(zip(axes, conditions)):
        n = 0
        if cond != "persona" and "persona" in conditions:  # the panel-A agent line, for comparison
            ref = _series(pooled, "persona", "agent")
            ax.plot(ref["round"], ref["mean"], ":", color="0.55", lw=1.3, label="agent persona, panel A")
        for target in ("agent", "user"):
            cells = _series(pooled, cond, target)
            if len(cells):
                _plot(ax, cells, COLORS[target], LABELS[target], errors)
                n = max(n, int(cells["n"].max()))
        letter = chr(ord("A") + k) if len(conditions) > 1 else ""
        ax.set_title(
            f"{letter + ': ' if letter else ''}{CONDITION_LABELS.get(cond, cond)} (n={n})", fontsize=10
        )
        _style_axes(ax, rounds)
    axes[0].set_ylabel("probe score (1 = persona followed)")
    _figure_legend(fig, axes, error_note(errors))
    fig.suptitle(f"Instruction drift · {model_title(summary.manifest)}", fontsize=11)
    return save_png(fig, path)


def category_figure(summary: RunSummary, path: str | Path, errors: Errors = "ci") -> Path:
    """Small multiples by category of the persona being probed (agent's for blue, user's for orange)."""
    df = summary.per_round[summary.per_round["category"] != ALL]
    cats = [c for c in category_order(df["category"]) if c != ALL]
    rounds = sorted(int(r) for r in summary.per_round["round"].unique())
    keys = [k for k in series_keys(summary) if k[1] in COLORS]  # the raw scores, in [0, 1]
    ncols = min(3, max(1, len(cats)))
    nrows = -(-max(1, len(cats)) // ncols)
    fig = Figure(figsize=(3.6 * ncols, 3.0 * nrows + 1.0), layout="constrained", dpi=DPI)
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
    for ax, cat in zip(axes, cats):
        ns = []
        for cond, target in keys:
            cells = _series(df[df["category"] == cat], cond, target)
            if len(cells):
                label = LABELS[target] + ("" if cond == "persona" else f", {cond} (dashed)")
                _plot(ax, cells, COLORS[target], label, errors, STYLES.get(cond, "-."))
                short = target if cond == "persona" else f"{target}/{cond}"
                ns.append(f"{int(cells['n'].max())} {short}")
        ax.set_title(f"{cat}\nn = {', '.join(ns)}", fontsize=9)
        _style_axes(ax, rounds)
    for ax in axes[len(cats) :]:
        ax.set_visible(False)
    for ax in axes[::ncols]:
        ax.set_ylabel("probe score")
    _figure_legend(fig, axes, error_note(errors))
    fig.suptitle(f"Drift by persona category · {model_title(summary.manifest)}", fontsize=10.5)
    return save_png(fig, path)


def _figure_legend(fig: Figure, axes, note: str) -> None:
    """One legend under the panels, so it never hides a line; `note` (what the bands are) heads it."""
    seen: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if seen:
        fig.legend(
            list(seen.values()),
            list(seen),
            loc="outside lower center",
            ncols=min(3, len(seen)),
            fontsize=8,
            frameon=False,
            handlelength=3,
            # Wrapped to the figure's width (about 14 characters per inch at 7.5 pt).
            title=textwrap.fill(note, width=max(40, int(fig.get_figwidth() * 14))),
            title_fontsize=7.5,
        )


def save_png(fig: Figure, path: str | Path) -> Path:
    """Write a pyplot-free Figure as PNG (no global backend state: safe in notebooks and threads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def write_figures(summary: RunSummary, out_dir: str | Path, errors: Errors = "ci") -> dict[str, Path]:
    """Both figures as PNGs in `out_dir`: {"drift": ..., "categories": ...}."""
    out = Path(out_dir)
    return {
        "drift": drift_figure(summary, out / "drift.png", errors),
        "categories": category_figure(summary, out / "drift_by_category.png", errors),
    }
