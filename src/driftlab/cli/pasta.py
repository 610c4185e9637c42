"""`driftlab pasta profile | select | eval`: PASTA's head profiling, head selection and tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.cli.options import DeviceOpt, DtypeOpt, ModelOpt, build

app = typer.Typer(help="PASTA (seed 002): emphasise spans by attention steering on profiled heads.",
                  no_args_is_help=True)

TaskOpt = Annotated[str, typer.Option("--task", "-t", help="json, pronouns, biasbios or counterfact.")]
DataOpt = Annotated[Path | None, typer.Option(
    "--data", help="A real data file (BiasBios pickle/JSON, CounterFact JSON) instead of the bundled set.")]
MaxTokensOpt = Annotated[int | None, typer.Option(help="Most new tokens per reply (default: the task's).")]


@app.command()
def profile(
    task: TaskOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    model: ModelOpt = "smollm2-135m",
    n: Annotated[int, typer.Option("--n", help="Train examples per head.")] = 16,
    alpha: Annotated[float, typer.Option(help="PASTA's scaling coefficient, in (0, 1).")] = 0.01,
    layers: Annotated[str | None, typer.Option(help="Only these layers, e.g. '0-5+9' (default: all).")] = None,
    score: Annotated[str, typer.Option(
        help="Rank heads by the task 'metric' (the paper), or by the 'likelihood' of the reference answer "
             "(graded and cheap: for small models whose metric is 0 under every head).")] = "metric",
    max_new_tokens: MaxTokensOpt = None,
    data: DataOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    batch_size: Annotated[int, typer.Option(help="(head, example) rows per batch.")] = 16,
) -> None:
    """Score every attention head by steering it alone on N train examples; write the ranking.

    Writes OUT/profile.json (heads ranked best first, usable as --heads FILE --topk K) and
    OUT/profile.png (a layer x head heatmap). Re-running the same command resumes.
    """
    from rich.console import Console

    from driftlab.pasta.profile import ProfileConfig, run_profile

    config = build(ProfileConfig, model=model, task=task, n=n, alpha=alpha, layers=layers, score=score,
                   max_new_tokens=max_new_tokens, data=str(data) if data else None, dtype=dtype, device=device,
                   batch_size=batch_size)
    result = run_profile(config, str(out))
    console = Console()
    base = f"{result.baseline:.3f}" if result.baseline is not None else "-"
    console.print(f"{task}: {len(result.scores)} heads profiled on {result.n} examples; "
                  f"{result.metric} without steering {base}")
    for layer, head, score in result.scores[:10]:
        console.print(f"  layer {layer:>2} head {head:>2}  {score:.3f}")
    typer.echo(f"profile: {out / 'profile.json'}\nheatmap: {out / 'profile.png'}")


@app.command()
def select(
    profiles: Annotated[list[Path], typer.Argument(help="profile.json files of `driftlab pasta profile`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Head config to write (pastalib's JSON format).")],
    how: Annotated[str, typer.Option("--select", help="intersection (PASTA's default), union or task-specific.")]
    = "intersection",
    topk: Annotated[int, typer.Option(help="Top-k heads of each profile.")] = 20,
) -> None:
    """Build the steered head set from several tasks' profiles (seed 002 Sec. 3.2 and 5.3)."""
    from driftlab.pasta.heads import check_selection, load_profile, save_heads
    from driftlab.pasta.heads import select as choose

    check_selection(how)  # before reading any file
    heads = choose([load_profile(p) for p in profiles], how, topk)
    save_heads(heads, out)
    typer.echo(f"{len(heads)} heads ({how} of the top {topk}) -> {out}")


@app.command("eval")
def evaluate(
    task: TaskOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    model: ModelOpt = "smollm2-135m",
    baseline: Annotated[list[str] | None, typer.Option(
        "--baseline", help="zero-shot, marked, quoted, few-shot or pasta; repeatable (default: all; pasta with --heads)."
    )] = None,
    heads: Annotated[str | None, typer.Option(
        help="Heads PASTA steers: a head config or profile JSON, or a selection like '3.1+5.2'.")] = None,
    topk: Annotated[int | None, typer.Option(help="With a profile as --heads: steer its top K heads.")] = None,
    alpha: Annotated[float, typer.Option(help="PASTA's scaling coefficient, in (0, 1].")] = 0.01,
    n: Annotated[int | None, typer.Option("--n", help="Test examples (default: all).")] = None,
    max_new_tokens: MaxTokensOpt = None,
    data: DataOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    batch_size: Annotated[int, typer.Option(help="Examples per batch.")] = 8,
) -> None:
    """Run a PASTA task under several baselines; print each metric with a 95% CI."""
    from rich.console import Console
    from rich.table import Table

    from driftlab.pasta.evaluate import PastaEvalConfig, run_eval, summarize

    steer = []
    if heads is not None:
        steer = [f"pasta:heads={heads},alpha={alpha}" + (f",topk={topk}" if topk is not None else "")]
    from driftlab.pasta.tasks import BASELINES

    default = [b for b in BASELINES if b != "pasta" or heads is not None]
    config = build(PastaEvalConfig, {"steer": "--heads", "baselines": "--baseline"}, model=model, task=task,
                   baselines=baseline or default, steer=steer, n=n, max_new_tokens=max_new_tokens,
                   data=str(data) if data else None, dtype=dtype, device=device, batch_size=batch_size)
    rundir = run_eval(config, str(out))
    summary = summarize(rundir.path)
    names = list(next(iter(summary.values())))
    table = Table(title=f"PASTA {task} · {model} · {len(rundir.read_manifest()['examples'])} test examples")
    table.add_column("baseline")
    for name in names:
        table.add_column(f"{name} [95% CI]")
    for b in config.baselines:
        table.add_row(b, *[f"{summary[b][m][0]:.3f} [{summary[b][m][1]:.2f}, {summary[b][m][2]:.2f}]"
                           for m in names])
    Console().print(table)
    typer.echo(f"records: {rundir.records_path}")
