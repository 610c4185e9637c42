"""`driftlab directions`: persona directions in the residual stream, with their held-out separation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.activation.config import Format
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
    from_file: Annotated[Path | None, typer.Option(
        help="Import this direction from another tool's file (see --format) and calibrate it on these replies.")
    ] = None,
    format: Annotated[Format | None, typer.Option(  # noqa: A002 (the option's name)
        help="The --from-file format: assistant-axis (its axis), persona-vectors or steering-vectors (the one "
             "persona or --system given).")] = None,
    capping: Annotated[Path | None, typer.Option(
        help="The Assistant Axis's capping_config.pt: its thresholds, for --steer cap:q=file.")] = None,
    experiment: Annotated[str | None, typer.Option(
        help="Which capping experiment, e.g. layers_46:54-p0.25 (needed when the config holds several).")] = None,
) -> None:
    """Compute each system prompt's direction in the residual stream, per layer.

    A direction is the mean activation of replies with the prompt minus without it. Prints each
    band's held-out separation (AUROC) and a shuffled control's; use the output with --directions
    (monitoring) and --steer vector/cap. With --from-file, one direction comes from the Assistant
    Axis, persona vectors or steering-vectors instead, judged on the same replies.

    Re-running the same command on the same --out resumes.
    """
    from driftlab.api.options import FLAGS, directions_config
    from driftlab.api.runs import execute
    from driftlab.protocol.directions import DirectionsProtocol

    config = directions_config(backend, FLAGS, {
        "personas": personas, "system": system, "axis": axis, "prompts": prompts, "starters": starters,
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "greedy": greedy,
        "seed": seed, "batch_size": batch_size, "from_file": from_file, "format": format, "capping": capping,
        "experiment": experiment})
    rundir = execute(DirectionsProtocol(config), out)
    from driftlab.cli.finish import print_text_table
    from driftlab.report.directions import separation_figure, separation_table

    figure = separation_figure(rundir.path)
    print_text_table(separation_table(rundir.path))
    typer.echo(str(rundir.path / "directions.safetensors"))
    typer.echo(str(figure))


def export_directions(
    directions: Annotated[Path, typer.Argument(help="A directory `driftlab directions` wrote.")],
    format: Annotated[Format, typer.Option(help="assistant-axis, persona-vectors or steering-vectors.")],  # noqa: A002
    out: Annotated[Path, typer.Option("--out", "-o", help="The file to write (.pt).")],
    persona: Annotated[str | None, typer.Option(
        help="Whose direction: a persona id or system-XXXXXXXX (default: the axis, else the only one).")] = None,
    cap_q: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="assistant-axis only: also write capping_config.pt, capping the band at this "
                               "quantile of the with-prompt projections (or at the imported thresholds).")] = None,
) -> None:
    """Write one of driftlab's directions in another tool's format.

    The file holds the raw difference of means per layer (unit vector times its norm), in the tool's
    layer convention: the Assistant Axis and steering-vectors key decoder layer l as l, persona
    vectors as l + 1 (row 0, the embeddings', is zeros). Prints the files written.
    """
    from driftlab.activation.directions import Directions

    for path in Directions.load(directions).export(format, out, persona=persona, cap_q=cap_q):
        typer.echo(str(path))
