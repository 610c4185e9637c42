"""`driftlab calibrate`: the strongest setting of a mitigation within an MMLU-drop budget."""

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
    TurnOpt,
    build,
    runtime,
)


def calibrate(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the points, calibration.json/png.")],
    method: Annotated[str, typer.Option(help="split-softmax, instaboost, cfg or spr.")],
    max_mmlu_drop: Annotated[float, typer.Option(help="Budget: the most MMLU accuracy to give up, e.g. 0.02.")],
    model: ModelOpt = "smollm2-135m",
    n: Annotated[int, typer.Option("--n", help="MMLU questions per point, stratified by subject.")] = 200,
    turn: TurnOpt = 4,
    steps: Annotated[int, typer.Option(help="Bisection halvings after checking the strongest setting.")] = 5,
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
) -> None:
    """Find the strongest --steer setting of METHOD whose MMLU drop stays within the budget.

    Prints the spec to use on stdout (e.g. `--steer "$(driftlab calibrate ...)"`), the points
    measured on stderr, and writes calibration.json and calibration.png. Resumable.
    """
    from rich.console import Console
    from rich.table import Table

    from driftlab.chat import make_backend
    from driftlab.errors import DriftlabError
    from driftlab.protocol.calibrate import CalibrationConfig
    from driftlab.protocol.calibrate import calibrate as run_calibration
    from driftlab.protocol.mmlu import MMLUConfig, load_questions

    mmlu = build(MMLUConfig, model=model, n=n, turn=turn, history_tokens=history_tokens, seed=seed,
                 data=str(data) if data else None, dtype=dtype, device=device, span=span,
                 runtime=runtime(base_url, api_key_env, concurrency, ray, actors))
    config = build(CalibrationConfig, {"max_drop": "--max-mmlu-drop"}, method=method, max_drop=max_mmlu_drop,
                   steps=steps, mmlu=mmlu)
    load_questions(mmlu.data)  # the data set must be there before the model loads
    from driftlab.records.rundir import RunDir

    with RunDir(out).writing():
        summary = run_calibration(config, out, make_backend(mmlu.backend_spec(), run_dir=out))
    console = Console(stderr=True)
    table = Table(title=f"{method}: MMLU drop at turn {turn} ({n} questions), budget {max_mmlu_drop:g}")
    for col in ("--steer", "drop", "95% CI", "within budget"):
        table.add_column(col)
    for p in summary["points"]:
        table.add_row(p["steer"], f"{p['drop']:+.3f}", f"[{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}]",
                      "yes" if p["within"] else "no")
    console.print(table)
    console.print(summary["note"], highlight=False, markup=False)
    if summary["best"] is None:
        raise DriftlabError(summary["note"])
    typer.echo(summary["best"]["steer"])
