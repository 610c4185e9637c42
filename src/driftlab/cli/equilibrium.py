"""`driftlab equilibrium`: the equilibrium model of multi-turn drift, fitted to runs' KL series."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def equilibrium(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="One or two runs with KLs: a self-chat run with --kl, or a `driftlab kl` run. Two: the second's "
             "D* against the first's (e.g. SPR against plain).", metavar="RUN_DIR...")],
    measure: Annotated[str, typer.Option(help="The series to fit: 'reminded' (the reminded KL, Dongre et al.'s "
                                              "D_t) or 'influence' (the prompt's influence).")] = "reminded",
    from_round: Annotated[int, typer.Option(
        min=1, help="First round of each series (default 2: round 1's reminded KL is 0 by construction).")] = 2,
    figure: Annotated[Path | None, typer.Option(
        help="Also draw each run's series per round against its D*, beside the share of agent turns that repeat "
             "an earlier one, as a PNG here.", metavar="PNG")] = None,
) -> None:
    """Fit D_{t+1} - D_t = a + b D_t + noise per run: the equilibrium D*, the rate of return and the noise, with
    bootstrap intervals over conversations, against a random walk by held-out likelihood (docs/measures.md)."""
    from driftlab.cli.finish import print_text_table
    from driftlab.errors import DriftlabError
    from driftlab.report.equilibrium import MEASURES, equilibrium_table

    if measure not in MEASURES:
        raise DriftlabError(f"--measure {measure!r} is not a KL series.", hint=f"Use one of: {', '.join(MEASURES)}.")
    if len(run_dirs) > 2:
        raise DriftlabError(f"{len(run_dirs)} runs given; the fit takes one, or two to compare.",
                            hint="Give one run per condition, at most two.")
    if figure is not None and figure.suffix.lower() != ".png":
        raise DriftlabError(f"--figure {figure} is not a .png path.", hint="Name the figure's file, e.g. equilibrium.png.")
    print_text_table(equilibrium_table(run_dirs, measure, from_round, figure=figure))
    if figure is not None:
        print(f"figure: {figure}")
