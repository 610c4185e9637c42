"""`driftlab mmlu`: what an intervention costs in MMLU accuracy at a turn of a dialog."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import (
    HistoryTokensOpt,
    MMLUDataOpt,
    MMLUSeedOpt,
    SteerOpt,
    TurnOpt,
    backend_options,
    build,
)


@backend_options(remote=True, ray=True)
def mmlu(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    steer: SteerOpt = None,
    n: Annotated[int, typer.Option("--n", help="Questions, stratified by subject (1-14042).")] = 200,
    turn: TurnOpt = 4,
    history_tokens: HistoryTokensOpt = 64,
    seed: MMLUSeedOpt = 0,
    data: MMLUDataOpt = None,
    batch_size: Annotated[int, typer.Option(help="Questions scored per forward pass.")] = 8,
) -> None:
    """MMLU accuracy with and without --steer, the question asked at a turn of the agent's dialog.

    Letters are chosen by next-token log-likelihood (no generation). Prints the accuracy per
    condition with 95% CIs and the drop with a paired CI. Re-running the same command resumes.
    """
    from rich.console import Console
    from rich.table import Table

    from driftlab.protocol.mmlu import MMLU, MMLUConfig, summarize
    from driftlab.protocol.runner import run_protocol

    config = build(MMLUConfig, backend=backend, steer=steer or [], n=n, turn=turn, history_tokens=history_tokens,
                   seed=seed, data=str(data) if data else None, batch_size=batch_size)
    rundir = run_protocol(MMLU(config), out)
    s = summarize(rundir.path)
    table = Table(title=f"MMLU at turn {config.turn} · {backend.model} · {s['n']} questions")
    for col in ("condition", "accuracy", "95% CI"):
        table.add_column(col)
    for condition in config.conditions:
        row = s[condition]
        label = "plain" if condition == "plain" else f"steered: {', '.join(config.steer.specs())}"
        table.add_row(label, f"{row['accuracy']:.3f}", f"[{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]")
    if "drop" in s:
        d = s["drop"]
        table.add_row("drop (plain - steered)", f"{d['mean']:+.3f}", f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]")
    Console().print(table)
    typer.echo(f"records: {rundir.records_path}")
