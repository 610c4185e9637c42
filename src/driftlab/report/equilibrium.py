"""The equilibrium model fitted to runs' KL series (`driftlab equilibrium`): per run (a condition), D*,
the rate of return and the noise with their intervals, and the held-out comparison with a random
walk; with two runs, whether the second's D* is lower (a reminder such as SPR, Dongre et al.'s
prediction). The fit itself is `theory.equilibrium`.

A series is one conversation's agent turns in round order. The reminded KL of round 1 is 0 by
construction (the turn follows the system prompt), so by default the series start at round 2.
"""

from __future__ import annotations

from pathlib import Path

from driftlab.errors import DriftlabError
from driftlab.report.activation import measures_frame
from driftlab.report.tables import TextTable
from driftlab.theory.equilibrium import EquilibriumFit, compare_equilibria, fit_equilibrium

#: The KL columns of a measures frame a fit can read, and their labels.
MEASURES = {"reminded": "reminded KL", "influence": "prompt influence"}


def series(run_dir: str | Path, measure: str = "reminded", from_round: int = 2) -> list[list[float]]:
    """Per conversation, `measure` of its agent turns from `from_round` on, in round order."""
    frame = measures_frame(run_dir)
    if not frame[measure].notna().any():
        raise DriftlabError(f"{run_dir} has no {MEASURES[measure]} to fit.",
                            hint="Give a self-chat run made with --kl, or a `driftlab kl` run of it.")
    turns = frame[(frame.what == "turn") & (frame["round"] >= from_round)].dropna(subset=[measure])
    return [list(one.sort_values("round")[measure]) for _, one in turns.groupby("pair")]


def equilibrium_table(run_dirs: list[str | Path], measure: str = "reminded", from_round: int = 2,
                      n_boot: int = 2000) -> TextTable:
    """One row per run: D*, rate, sigma [95% intervals], held-out gain over the random walk; a last row
    comparing the second run's D* with the first's where two are given."""
    found = [series(path, measure, from_round) for path in run_dirs]
    rows = []
    for path, one in zip(run_dirs, found, strict=True):
        fit = fit_equilibrium(one, n_boot=n_boot)
        rows.append([str(path), *(_cell(fit, name) for name in ("d_star", "rate", "sigma")),
                     f"{fit.heldout_gain:+.3f} ({fit.heldout_better} of {fit.n_conversations} better, "
                     f"p = {fit.heldout_p:.2g})", f"{fit.n_conversations} x {fit.n_steps} steps"])
    if len(found) == 2:
        diff = compare_equilibria(found[0], found[1], n_boot=n_boot)
        rows.append(["D* of the second minus the first", f"{diff['difference']:+.3g} [{diff['low']:+.3g}, "
                     f"{diff['high']:+.3g}]", "", "", f"p(not lower) = {diff['p_not_lower']:.3g}",
                     f"{diff['n_resamples']} resamples"])
    return TextTable(
        f"the equilibrium of the {MEASURES[measure]}, rounds {from_round} on",
        ["run", "D* [95% CI]", "rate of return", "noise sigma", "held-out gain over a random walk", "n"], rows,
        "D_{t+1} - D_t = a + b D_t + noise, fitted by least squares (Dongre et al. 2025); D* = -a/b, rate = -b "
        "(near 1: no memory, noise around a level). Intervals: bootstrap over conversations. Held-out gain: log "
        "likelihood per step of the fit over a random walk, each conversation predicted by fits to the others.")


def _cell(fit: EquilibriumFit, name: str) -> str:
    low, high = fit.intervals[name]
    return f"{getattr(fit, name):.3g} [{low:.3g}, {high:.3g}]"
