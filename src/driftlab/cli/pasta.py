"""`driftlab pasta profile | select | eval`: PASTA's head profiling, head selection and tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import backend_options, build

app = typer.Typer(help="PASTA (Zhang et al., ICLR 2024): emphasise spans by attention steering on profiled heads.",
                  no_args_is_help=True)

TaskOpt = Annotated[str, typer.Option("--task", "-t", help="json, pronouns, biasbios or counterfact.")]
DataOpt = Annotated[Path | None, typer.Option(
    "--data", help="A real data file (BiasBios pickle/JSON, CounterFact JSON) instead of the bundled set.")]
MaxTokensOpt = Annotated[int | None, typer.Option(help="Most new tokens per reply (default: the task's).")]
AlphaOpt = Annotated[float, typer.Option(help="PASTA's scaling coefficient, in (0, 1).")]
SelectOpt = Annotated[str, typer.Option("--select", help="intersection (PASTA's default), union or task-specific.")]
PromptOpt = Annotated[str, typer.Option(
    help="The instruction's wording (App. A.1, Table 4): original, shortened or rephrased (json and pronouns).")]


@app.command()
@backend_options(span=False)
def profile(
    task: TaskOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    n: Annotated[int, typer.Option("--n", help="Train examples per head.")] = 16,
    alpha: AlphaOpt = 0.01,
    layers: Annotated[str | None, typer.Option(help="Only these layers, e.g. '0-5+9' (default: all).")] = None,
    score: Annotated[str, typer.Option(
        help="Rank heads by the task 'metric' (the paper), or by the 'likelihood' of the reference answer "
             "(graded and cheap: for small models whose metric is 0 under every head).")] = "metric",
    prompt: PromptOpt = "original",
    max_new_tokens: MaxTokensOpt = None,
    data: DataOpt = None,
    batch_size: Annotated[int, typer.Option(help="(head, example) rows per batch.")] = 16,
) -> None:
    """Score every attention head by steering it alone on N train examples; write the ranking.

    Writes OUT/profile.json (heads ranked best first, usable as --heads FILE --topk K) and
    OUT/profile.png (a layer x head heatmap). Re-running the same command resumes.
    """
    from rich.console import Console

    from driftlab.api.runs import execute
    from driftlab.pasta.profile import HeadProfiler, ProfileConfig, build_profile

    config = build(ProfileConfig, backend=backend, task=task, n=n, alpha=alpha, layers=layers, score=score,
                   prompt=prompt, max_new_tokens=max_new_tokens, data=str(data) if data else None,
                   batch_size=batch_size)
    rundir = execute(HeadProfiler(config), out)
    from driftlab.cli.finish import say_results
    say_results(rundir.path)
    from driftlab.report.pasta import write_pasta_figures  # matplotlib: only once the run is done
    figure = write_pasta_figures(rundir.path)
    result = build_profile(rundir.path)
    console = Console()
    base = f"{result.baseline:.3f}" if result.baseline is not None else "-"
    console.print(f"{task}: {len(result.scores)} heads profiled on {result.n} examples; "
                  f"{result.metric} without steering {base}")
    for layer, head, score in result.scores[:10]:
        console.print(f"  layer {layer:>2} head {head:>2}  {score:.3f}")
    typer.echo(f"profile: {out / 'profile.json'}\nheatmap: {figure}")


@app.command()
def select(
    profiles: Annotated[list[Path], typer.Argument(help="profile.json files of `driftlab pasta profile`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Head config to write (pastalib's JSON format).")],
    how: SelectOpt = "intersection",
    topk: Annotated[int, typer.Option(help="Top-k heads of each profile.")] = 20,
) -> None:
    """Build the steered head set from several tasks' profiles (the PASTA paper, Sec. 3.2 and 5.3)."""
    from driftlab.steering.heads import check_selection, load_profile, save_heads
    from driftlab.steering.heads import select as choose

    check_selection(how)  # before reading any file
    heads = choose([load_profile(p) for p in profiles], how, topk)
    save_heads(heads, out)
    typer.echo(f"{len(heads)} heads ({how} of the top {topk}) -> {out}")


@app.command("eval")
@backend_options(span=False)
def evaluate(
    task: TaskOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    baseline: Annotated[list[str] | None, typer.Option(
        "--baseline", help="zero-shot, marked, quoted, few-shot or pasta; repeatable (default: all; pasta with --heads)."
    )] = None,
    heads: Annotated[str | None, typer.Option(
        help="Heads PASTA steers: a head config or profile JSON, or a selection like '3.1+5.2'.")] = None,
    topk: Annotated[int | None, typer.Option(help="With a profile as --heads: steer its top K heads.")] = None,
    alpha: Annotated[float, typer.Option(help="PASTA's scaling coefficient, in (0, 1].")] = 0.01,
    n: Annotated[int | None, typer.Option("--n", help="Test examples (default: all).")] = None,
    split: Annotated[str, typer.Option(help="test (results) or valid (while choosing heads).")] = "test",
    prompt: PromptOpt = "original",
    max_new_tokens: MaxTokensOpt = None,
    generate_tokens: Annotated[int, typer.Option(
        help="biasbios/counterfact: also generate N tokens per example and score their fluency and "
             "consistency (App. E; 0: off).")] = 0,
    data: DataOpt = None,
    batch_size: Annotated[int, typer.Option(help="Examples per batch.")] = 8,
) -> None:
    """Run a PASTA task under several baselines; print each metric with a 95% CI.

    Then each baseline against zero-shot on the same examples: the mean difference, the
    counts better/worse/tied, and the exact McNemar (0/1 metrics) or Wilcoxon signed-rank
    (graded) p, Holm-corrected across the baselines, with a warning where n is too small.
    """
    from rich.console import Console
    from rich.table import Table

    from driftlab.api.runs import execute
    from driftlab.pasta.evaluate import PastaEval, PastaEvalConfig, paired_gains
    from driftlab.pasta.tasks import BASELINES
    from driftlab.steering import Pasta

    steer = []
    if heads is not None:
        steer = [build(Pasta, heads=heads, alpha=alpha, **({"topk": topk} if topk is not None else {}))]

    default = [b for b in BASELINES if b != "pasta" or heads is not None]
    config = build(PastaEvalConfig, {"steer": "--heads", "baselines": "--baseline"}, backend=backend, task=task,
                   baselines=baseline or default, steer=steer, n=n, split=split, prompt=prompt,
                   max_new_tokens=max_new_tokens, generate_tokens=generate_tokens,
                   data=str(data) if data else None, batch_size=batch_size)
    rundir = execute(PastaEval(config), out)
    from driftlab.cli.finish import say_results
    say_results(rundir.path)
    from driftlab.report.pasta import write_pasta_figures  # matplotlib: only once the run is done
    figure = write_pasta_figures(rundir.path)
    from driftlab.pasta.evaluate import RECORDS, metric_intervals
    from driftlab.records.rundir import RunDir

    summary = metric_intervals(RunDir(rundir.path).records(RECORDS), lambda r: r.baseline)
    names = list(next(iter(summary.values())))
    n_examples = len(rundir.read_manifest()["examples"])
    table = Table(title=f"PASTA {task} · {backend.model} · {n_examples} {split} examples")
    table.add_column("baseline")
    for name in names:
        table.add_column(f"{name} [95% CI]")
    for b in config.baselines:
        table.add_row(b, *[summary[b][m].cell(3) for m in names])
    console = Console()
    console.print(table)
    methods = sorted({iv.method for ivs in summary.values() for iv in ivs.values()})
    console.print(f"intervals: {', '.join(methods)} (0/1 metrics: Wilson; graded: t below 30 examples, BCa "
                  f"bootstrap from 30)", highlight=False)
    gains = paired_gains(rundir.path)
    if gains:
        paired = Table(title="paired difference from zero-shot (same examples): mean [95% CI], "
                             "better/worse/tied, p (Holm across baselines)")
        paired.add_column("baseline")
        for name in names:
            paired.add_column(name)
        warnings = []
        for b in (b for b in config.baselines if b in gains):
            cells = []
            for m in names:
                t = gains[b].get(m)
                if t is None:
                    cells.append("-")
                    continue
                cells.append(f"{t.diff.cell(3, sign=True)} {t.better}/{t.worse}/{t.tied} "
                             f"p={t.p:.3g} p_holm={t.p_adjusted:.3g}")
                if t.warning():
                    warnings.append(f"{b} {m}: {t.warning()}")
            paired.add_row(b, *cells)
        console.print(paired)
        tests = sorted({t.method for ts in gains.values() for t in ts.values()})
        console.print(f"tests: {', '.join(tests)}; n = {n_examples} pairs", highlight=False)
        for w in warnings:
            console.print(f"[yellow]Warning:[/] {w}", highlight=False)
    typer.echo(f"records: {rundir.records_path}\nplot: {figure}")


@app.command()
@backend_options(span=False)
def tune(
    profiles: Annotated[list[Path], typer.Argument(help="profile.json files the head sets are selected from.")],
    task: TaskOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    how: SelectOpt = "intersection",
    topk: Annotated[list[int] | None, typer.Option(help="Top-k values to try; repeatable (default: 10 20 40 80).")]
    = None,
    n: Annotated[int, typer.Option("--n", help="Validation examples.")] = 16,
    alpha: AlphaOpt = 0.01,
    prompt: PromptOpt = "original",
    max_new_tokens: MaxTokensOpt = None,
    data: DataOpt = None,
    batch_size: Annotated[int, typer.Option(help="Examples per batch.")] = 8,
) -> None:
    """Choose how many heads to steer: PASTA with each top-k on the validation split.

    Writes OUT/tune.json (each point's metrics with 95% CIs), OUT/heads.json (the best set,
    for --heads) and OUT/tune.png (the metric against the number of heads). Re-running the
    same command resumes.
    """
    from rich.console import Console
    from rich.table import Table

    from driftlab.api.runs import execute
    from driftlab.pasta.tune import HeadTuner, TuneConfig, summarize

    values = {"backend": backend, "task": task, "profiles": [str(p) for p in profiles], "select": how, "n": n,
              "alpha": alpha, "prompt": prompt, "max_new_tokens": max_new_tokens,
              "data": str(data) if data else None, "batch_size": batch_size}
    if topk:
        values["topk"] = topk
    config = build(TuneConfig, {"select": "--select"}, **values)
    rundir = execute(HeadTuner(config), out)
    from driftlab.cli.finish import say_results
    say_results(rundir.path)
    from driftlab.report.pasta import write_pasta_figures  # matplotlib: only once the run is done
    figure = write_pasta_figures(rundir.path)
    result = summarize(rundir.path)
    metric = result["metric"]
    table = Table(title=f"PASTA head count · {task} · {backend.model} · {result['examples']} validation examples")
    for col in ("top-k", "heads", f"{metric} [95% CI]", ""):
        table.add_column(col)
    if metric in result["unsteered"]:
        m, lo, hi = result["unsteered"][metric]
        table.add_row("-", "0", f"{m:.3f} [{lo:.2f}, {hi:.2f}]", "no steering")
    best = result["best"]["topk"] if result["best"] else None
    for p in result["points"]:
        if metric in p["metrics"]:
            m, lo, hi = p["metrics"][metric]
            note = "chosen" if p["topk"] == best else "" if p["fluent"] else \
                f"degenerate: fluency {p['metrics']['fluency'][0]:.2f}"
            table.add_row(str(p["topk"]), str(p["n_heads"]), f"{m:.3f} [{lo:.2f}, {hi:.2f}]", note)
    Console().print(table)
    if best is None:
        from driftlab.errors import DriftlabError

        raise DriftlabError("Every head count made the replies degenerate (mean fluency below 3.0); no head set "
                            "was chosen.", hint=f"See {figure}; try smaller --topk values.")
    typer.echo(f"heads: {out / 'heads.json'}\nplot: {figure}")
