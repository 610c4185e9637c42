"""The equilibrium model fitted to runs' KL series (`driftlab equilibrium`): per run (a condition), D*,
the rate of return and the noise with their intervals, and the held-out comparison with a random
walk; with two runs, whether the second's D* is lower (a reminder such as SPR, Dongre et al.'s
prediction); and a figure of the series per round against each fitted D*, beside the share of
repeated turns (a dialog in a loop holds any measure still, restoring force or not). The fit itself
is `theory.equilibrium`.

A series is one conversation's agent turns in round order. The reminded KL of round 1 is 0 by
construction (the turn follows the system prompt), so by default the series start at round 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from driftlab.errors import DriftlabError
from driftlab.report.activation import measures_frame, round_bands
from driftlab.report.figures import round_ticks, save_png
from driftlab.report.tables import TextTable
from driftlab.theory.equilibrium import EquilibriumFit, compare_equilibria, fit_equilibrium

#: The KL columns of a measures frame a fit can read, and their labels.
MEASURES = {"reminded": "reminded KL", "influence": "prompt influence"}


def turns(run_dir: str | Path, measure: str = "reminded", from_round: int = 2) -> pd.DataFrame:
    """The run's agent turns from `from_round` on that have `measure` (one line where none has)."""
    frame = measures_frame(run_dir)
    if not frame[measure].notna().any():
        raise DriftlabError(f"{run_dir} has no {MEASURES[measure]} to fit.",
                            hint="Give a self-chat run made with --kl, or a `driftlab kl` run of it.")
    return frame[(frame.what == "turn") & (frame["round"] >= from_round)].dropna(subset=[measure])


def series(found: pd.DataFrame, measure: str = "reminded") -> list[list[float]]:
    """Per conversation, `measure` of its turns (`turns`) in round order."""
    return [list(one.sort_values("round")[measure]) for _, one in found.groupby("pair")]


def equilibrium_table(run_dirs: list[str | Path], measure: str = "reminded", from_round: int = 2,
                      n_boot: int = 2000, figure: str | Path | None = None) -> TextTable:
    """One row per run: D*, rate, sigma [95% intervals], held-out gain over the random walk; a last row
    comparing the second run's D* with the first's where two are given. `figure`: also draw
    `equilibrium_figure` there."""
    frames = [turns(path, measure, from_round) for path in run_dirs]
    found = [series(frame, measure) for frame in frames]
    rows, fits = [], []
    for path, one in zip(run_dirs, found, strict=True):
        fit = fit_equilibrium(one, n_boot=n_boot)
        fits.append(fit)
        rows.append([str(path), *(_cell(fit, name) for name in ("d_star", "rate", "sigma")),
                     f"{fit.heldout_gain:+.3f} ({fit.heldout_better} of {fit.n_conversations} better, "
                     f"p = {fit.heldout_p:.2g})", f"{fit.n_conversations} x {fit.n_steps} steps"])
    if len(found) == 2:
        diff = compare_equilibria(found[0], found[1], n_boot=n_boot)
        rows.append(["D* of the second minus the first", f"{diff['difference']:+.3g} [{diff['low']:+.3g}, "
                     f"{diff['high']:+.3g}]", "", "", f"p(not lower) = {diff['p_not_lower']:.3g}",
                     f"{diff['n_resamples']} resamples"])
    if figure is not None:
        equilibrium_figure([Path(path).name for path in run_dirs], frames, fits, measure, figure)
    return TextTable(
        f"the equilibrium of the {MEASURES[measure]}, rounds {from_round} on",
        ["run", "D* [95% CI]", "rate of return", "noise sigma", "held-out gain over a random walk", "n"], rows,
        "D_{t+1} - D_t = a + b D_t + noise, fitted by least squares (Dongre et al. 2025); D* = -a/b, rate = -b "
        "(near 1: no memory, noise around a level). Intervals: bootstrap over conversations. Held-out gain: log "
        "likelihood per step of the fit over a random walk, each conversation predicted by fits to the others.")


def _cell(fit: EquilibriumFit, name: str) -> str:
    low, high = fit.intervals[name]
    return f"{getattr(fit, name):.3g} [{low:.3g}, {high:.3g}]"


def equilibrium_figure(labels: list[str], frames: list[pd.DataFrame], fits: list[EquilibriumFit], measure: str,
                       path: str | Path) -> Path:
    """Left: each run's `measure` per round (mean over conversations, 95% interval as a band) and its
    fitted D* (dashed; none where the fit finds no equilibrium). Right: the share of those turns that
    repeat an earlier agent turn word for word, per round: where it nears 1 the series is the same
    text read again, and a level it holds says nothing of a restoring force."""
    fig = Figure(figsize=(9.5, 3.4), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    for k, (label, frame, fit) in enumerate(zip(labels, frames, fits, strict=True)):
        color = f"C{k}"
        rounds = sorted(frame["round"].unique())
        mean, low, high = round_bands(frame, measure)
        left.plot(rounds, mean, marker="o", ms=3, color=color, label=f"{label} (n = {fit.n_conversations})")
        left.fill_between(rounds, np.clip(low, 0, None), high, color=color, alpha=0.15)
        if np.isfinite(fit.d_star):
            left.axhline(fit.d_star, color=color, ls="--", lw=1, label=f"D* = {fit.d_star:.3g}")
        share, s_low, s_high = round_bands(frame, "repeated")
        right.plot(rounds, share, marker="o", ms=3, color=color, label=label)
        right.fill_between(rounds, s_low, s_high, color=color, alpha=0.15)
    left.set(title=f"{MEASURES[measure]} (nats/token) and its equilibrium", xlabel="round")
    right.set(title="agent turns repeating an earlier one", xlabel="round", ylim=(-0.02, 1.02))
    for ax in (left, right):
        round_ticks(ax, rounds)
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7, loc="best")
    return save_png(fig, path)
