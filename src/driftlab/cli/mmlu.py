"""`driftlab mmlu`: what an intervention costs in MMLU accuracy at a turn of a dialog."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.cli.options import (
    ActorsOpt,
    ApiKeyEnvOpt,
    BaseUrlOpt,
    ConcurrencyOpt,
    DeviceOpt,
    DtypeOpt,
    HistoryTokensOpt,
    MMLUDataOpt,
    MMLUSeedOpt,
    ModelOpt,
    RayOpt,
    SpanOpt,
    SteerOpt,
    TurnOpt,
    build,
    runtime,
)


def mmlu(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    model: ModelOpt = "smollm2-135m",
    steer: SteerOpt = None,
    n: Annotated[int, typer.Option("--n", help="Questions, stratified by subject (1-14042).")] = 200,
    turn: TurnOpt = 4,
    history_tokens: HistoryTokensOpt = 64,
    seed: MMLUSeedOpt = 0,
    data: MMLUDataOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    span: SpanOpt = "content",
    base_url: BaseUrlOpt = None,
    api_key_env: ApiKeyEnvOpt = "OPENAI_API_KEY",
    concurrency: ConcurrencyOpt = 8,
    ray: RayOpt = None,
    actors: ActorsOpt = None,
    batch_size: Annotated[int, typer.Option(help="Questions scored per forward pass.")] = 8,
) -> None:
    """MMLU accuracy with and without --steer, the question asked at a turn of the agent's dialog.

    Letters are chosen by next-token log-likelihood (no generation). Prints the accuracy per
    condition with 95% CIs and the drop with a paired CI. Re-running the same command resumes.
    """
    from rich.console import Console
    from rich.table import Table

    from driftlab.protocol.mmlu import MMLUConfig, run_mmlu, summarize

    config = build(MMLUConfig, model=model, steer=steer or [], n=n, turn=turn, history_tokens=history_tokens,
                   seed=seed, data=str(data) if data else None, dtype=dtype, device=device, span=span,
                   batch_size=batch_size, runtime=runtime(base_url, api_key_env, concurrency, ray, actors))
    rundir = run_mmlu(config, str(out))
    s = summarize(rundir.path)
    table = Table(title=f"MMLU at turn {config.turn} · {model} · {s['n']} questions")
    for col in ("condition", "accuracy", "95% CI"):
        table.add_column(col)
    for condition in config.conditions:
        row = s[condition]
        label = "plain" if condition == "plain" else f"steered: {', '.join(config.steer)}"
        table.add_row(label, f"{row['accuracy']:.3f}", f"[{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]")
    if "drop" in s:
        d = s["drop"]
        table.add_row("drop (plain - steered)", f"{d['mean']:+.3f}", f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]")
    Console().print(table)
    typer.echo(f"records: {rundir.records_path}")
