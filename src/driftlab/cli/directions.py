"""`driftlab directions`: persona directions in the residual stream, with their held-out separation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import (
    GreedyOpt,
    MaxNewTokensOpt,
    SeedOpt,
    TemperatureOpt,
    TopPOpt,
    backend_options,
)


@backend_options(span=False)
def directions(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory: directions.safetensors/json, the figure.")],
    backend: BackendSpec,
    personas: Annotated[str | None, typer.Option(help="Benchmark persona ids, comma-separated.")] = None,
    system: Annotated[list[str] | None, typer.Option(help="Your own system prompt (repeatable).")] = None,
    axis: Annotated[bool, typer.Option(help="Also the Assistant Axis: no system prompt vs all prompts given.")] = False,
    prompts: Annotated[Path | None, typer.Option(
        help="User prompts, one per line, for every persona (default: its probe question and --starters starters).")
    ] = None,
    starters: Annotated[int, typer.Option(help="Reference starters added to each persona's probe question.")] = 20,
    max_new_tokens: MaxNewTokensOpt = 48,
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 0.9,
    greedy: GreedyOpt = False,
    seed: SeedOpt = 0,
    batch_size: Annotated[int, typer.Option(help="Most conversations per generate call.")] = 32,
) -> None:
    """Compute each system prompt's direction in the residual stream, per layer.

    A direction is the mean activation of replies with the prompt minus without it. Prints each
    band's held-out separation (AUROC) and a shuffled control's; use the output with --directions
    (monitoring) and --steer vector/cap.

    Re-running the same command on the same --out resumes.
    """
    from driftlab.api.options import FLAGS, directions_config
    from driftlab.api.runs import execute
    from driftlab.protocol.directions import DirectionsProtocol

    config = directions_config(backend, FLAGS, {
        "personas": personas, "system": system, "axis": axis, "prompts": prompts, "starters": starters,
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "greedy": greedy,
        "seed": seed, "batch_size": batch_size})
    rundir = execute(DirectionsProtocol(config), out)
    from driftlab.cli.finish import print_text_table
    from driftlab.report.directions import separation_figure, separation_table

    figure = separation_figure(rundir.path)
    print_text_table(separation_table(rundir.path))
    typer.echo(str(rundir.path / "directions.safetensors"))
    typer.echo(str(figure))
