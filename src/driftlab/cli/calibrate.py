"""`driftlab calibrate`: the strongest setting of a mitigation within an MMLU-drop budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import (
    HistoriesOpt,
    HistoryTokensOpt,
    MMLUDataOpt,
    MMLUSeedOpt,
    TiesOpt,
    TurnCountingOpt,
    TurnOpt,
    backend_options,
)


@backend_options(remote=True, ray=True)
def calibrate(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the points, calibration.json/png.")],
    method: Annotated[str, typer.Option(help="split-softmax, instaboost, cfg or spr.")],
    max_mmlu_drop: Annotated[float, typer.Option(help="Budget: the most MMLU accuracy to give up, e.g. 0.02.")],
    backend: BackendSpec,
    n: Annotated[int, typer.Option("--n", help="MMLU questions per point, stratified by subject.")] = 200,
    turn: TurnOpt = 4,
    turn_counting: TurnCountingOpt = "paper",
    steps: Annotated[int, typer.Option(help="Bisection halvings after checking the strongest setting.")] = 5,
    histories: HistoriesOpt = 1,
    ties: TiesOpt = "random",
    history_tokens: HistoryTokensOpt = 64,
    seed: MMLUSeedOpt = 0,
    data: MMLUDataOpt = None,
) -> None:
    """Find the strongest --steer setting of METHOD whose MMLU drop stays within the budget.

    Prints the spec to use on stdout (e.g. `--steer "$(driftlab calibrate ...)"`), the points
    measured on stderr, and writes calibration.json and calibration.png. Resumable.
    """
    options = {k: v for k, v in locals().items() if k not in ("out", "backend")}  # the run's options
    from rich.console import Console
    from rich.table import Table

    from driftlab.api.options import FLAGS, calibrate_config
    from driftlab.api.runs import execute
    from driftlab.cli.finish import say_results
    from driftlab.errors import DriftlabError
    from driftlab.protocol.calibrate import Calibration, summary

    config = calibrate_config(backend, FLAGS, options)
    rundir = execute(Calibration(config), out)
    from driftlab.report.calibration import write_calibration_figure  # matplotlib: only once the run is done
    write_calibration_figure(rundir.path)
    say_results(rundir.path)
    found = summary(rundir.path)
    console = Console(stderr=True)
    table = Table(title=f"{method}: MMLU drop at turn {turn} ({turn_counting} counting, round {config.mmlu.round}; "
                        f"{n} questions after {histories} dialog(s)), budget {max_mmlu_drop:g}")
    for col in ("--steer", "n", "drop", "95% CI", "p", "within budget"):
        table.add_column(col)
    for p in found["points"]:
        pval = "" if p.get("p") is None else f"{p['p']:.3g}"
        table.add_row(p["steer"], str(p.get("n") or ""), f"{p['drop']:+.3f}", f"[{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}]",
                      pval, "yes" if p["within"] else (
                          f"no (collapsed: {p['top_share']:.0%} {p['top_letter']})" if p.get("collapsed") else "no"))
    console.print(table)
    console.print(found["note"], highlight=False, markup=False)
    if found["best"] is None:
        raise DriftlabError(found["note"])
    typer.echo(found["best"]["steer"])
