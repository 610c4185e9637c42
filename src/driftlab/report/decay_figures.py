"""Attention-decay figures: the persona-drift paper's Figure 4 (pi along a dialog) and Figure 8 (two models).

matplotlib without pyplot (Agg figures), PNG out. Rounds are coloured from light to dark,
as in the paper's Figure 8, so a later round reads as a deeper colour.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from driftlab.protocol.decay import DecayTrace, traces
from driftlab.report.figures import round_ticks

DPI = 130


def _round_colors(n: int):
    cmap = colormaps["viridis_r"]
    return [cmap(0.15 + 0.75 * i / max(1, n - 1)) for i in range(n)]


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def figure4(trace: DecayTrace, layer: int, head: int, path: str | Path) -> Path:
    """pi(t) along each dialog: one head (top) and the mean over all layers and heads (bottom).

    x = token position in the dialog, so the user's turns show as gaps between the agent's;
    dashed lines mark where each agent turn starts (first dialog).
    """
    rounds = sorted(set(trace.round.tolist()))
    colors = _round_colors(len(rounds))
    fig = Figure(figsize=(10, 6.2), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    series = [(trace.pi[:, layer, head], f"layer {layer}, head {head}"),
              (trace.pi.mean(axis=(1, 2)), "mean over all layers and heads")]
    for ax, (values, title) in zip(axes, series, strict=True):
        for d in sorted(set(trace.dialog.tolist())):
            for r, color in zip(rounds, colors, strict=True):
                sel = (trace.dialog == d) & (trace.round == r)
                if sel.any():
                    ax.plot(trace.position[sel], values[sel], color=color, lw=0.9, alpha=0.75,
                            label=f"round {r}" if d == trace.dialog.min() else None)
        first = trace.dialog == trace.dialog.min()
        for r in rounds:
            sel = first & (trace.round == r)
            if sel.any():
                ax.axvline(trace.position[sel].min(), color="0.6", ls="--", lw=0.7)
        ax.set_ylabel(r"$\pi(t)$: attention on system prompt")
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylim(0, min(1.0, max(0.05, float(values.max()) * 1.1)))
        ax.grid(alpha=0.25)
    axes[1].set_xlabel("token position in the dialog (gaps: the user's turns)")
    axes[0].legend(ncol=min(8, len(rounds)), fontsize=8, loc="upper right")
    n = len(set(trace.dialog.tolist()))
    fig.suptitle(f"Attention decay · {trace.model} · {n} dialog(s) · system span: {trace.meta.get('span_mode')}")
    return _save(fig, path)


def round_profile(trace: DecayTrace, layer: int, head: int, path: str | Path) -> Path:
    """Mean pi per round (tokens averaged within a dialog, then over dialogs), +-1 std across dialogs."""
    rounds = sorted(set(trace.round.tolist()))
    dialogs = sorted(set(trace.dialog.tolist()))
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    for values, label, color in ((trace.pi.mean(axis=(1, 2)), "mean over all heads", "#1f77b4"),
                                 (trace.pi[:, layer, head], f"layer {layer}, head {head}", "#d62728")):
        per = np.array([[values[(trace.dialog == d) & (trace.round == r)].mean()
                         if ((trace.dialog == d) & (trace.round == r)).any() else np.nan for r in rounds]
                        for d in dialogs])
        mean, std = np.nanmean(per, axis=0), np.nanstd(per, axis=0)
        ax.errorbar(rounds, mean, yerr=std, marker="o", capsize=3, color=color, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(r"mean $\pi$ over the agent's tokens")
    round_ticks(ax, rounds)
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8)
    ax.set_title(f"{trace.model}: attention on the system prompt per round (±1 std over dialogs)", fontsize=9)
    return _save(fig, path)


def drop_heatmap(trace: DecayTrace, path: str | Path) -> Path:
    """Where the decay happens: mean pi in the first round minus the last, per layer and head."""
    m = trace.round_means()
    drop = m[0] - m[-1]
    fig = Figure(figsize=(max(5, 0.45 * trace.n_heads + 2), max(4, 0.22 * trace.n_layers + 1.5)), layout="constrained")
    ax = fig.subplots()
    lim = float(np.abs(drop).max()) or 1.0
    im = ax.imshow(drop, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, label=r"$\pi$(round 1) $-$ $\pi$(last round)")
    ax.set_title(f"{trace.model}: decay of attention to the system prompt", fontsize=9)
    return _save(fig, path)


def compare_figure(traces: dict[str, DecayTrace], path: str | Path, caveat: str | None = None) -> Path:
    """Figure 8: pi (mean over heads) along the steps of each agent turn, one line per round, per model."""
    fig = Figure(figsize=(5.2 * len(traces), 4.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(traces), sharey=True))
    for ax, (name, trace) in zip(axes, traces.items(), strict=True):
        rounds = sorted(set(trace.round.tolist()))
        values = trace.pi.mean(axis=(1, 2))
        for r, color in zip(rounds, _round_colors(len(rounds)), strict=True):
            sel = trace.round == r
            steps = trace.step[sel]
            n = int(steps.max()) + 1
            sums = np.bincount(steps, weights=values[sel], minlength=n)
            counts = np.bincount(steps, minlength=n)
            keep = counts >= max(1, len(set(trace.dialog.tolist())) // 2)  # steps most dialogs reach
            ax.plot(np.arange(n)[keep], (sums / np.maximum(counts, 1))[keep], color=color, lw=1.4,
                    label=f"round {r}")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("decoding step within the agent's turn")
        ax.grid(alpha=0.25)
    axes[0].set_ylabel(r"$\pi(t)$, mean over layers and heads")
    axes[-1].legend(fontsize=8)
    title = "Attention to the system prompt, by round (deeper colour = later round)"
    fig.suptitle(title, fontsize=10)
    if caveat:
        fig.supxlabel(textwrap.fill(caveat, width=int(fig.get_figwidth() * 15)), fontsize=8, color="0.3")
    return _save(fig, path)


CAVEAT = (
    "Caveat: the models are different families, so the contrast mixes instruction tuning with "
    "architecture and training data."
)


@dataclass
class DecayFigures:
    """What `write_decay_figures` drew, and from what."""

    traces: dict[str, DecayTrace]  # model -> its trace, the run's model first
    layer: int  # the single-head panel's layer and head
    head: int
    notes: list[str]  # sliding-window caveats
    files: list[Path]


def write_decay_figures(run_dir: str | Path, layer: int | None = None, head: int | None = None) -> DecayFigures:
    """Figure 4, the per-round profile and the drop heatmap of a decay run's model (one head: the
    given one, else the steepest), and Figure 8 when it traced `compare` models too."""
    run_dir = Path(run_dir)
    found = traces(run_dir)
    trace = next(iter(found.values()))
    if layer is None or head is None:
        layer, head = trace.steepest_head()
    files = [figure4(trace, layer, head, run_dir / "decay_fig4.png"),
             round_profile(trace, layer, head, run_dir / "decay_rounds.png"),
             drop_heatmap(trace, run_dir / "decay_heatmap.png")]
    notes = [n for n in (t.sliding_note() for t in found.values()) if n]
    if len(found) > 1:
        files.append(compare_figure(found, run_dir / "decay_compare.png", " ".join([CAVEAT, *notes])))
    return DecayFigures(found, layer, head, notes, files)
