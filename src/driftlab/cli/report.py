"""`driftlab report RUN_DIR`: write report.html + summary.csv and print the drift table.

Mounted in driftlab.cli with `app.command("report")(report)`. `driftlab run` prints the same
table at its end with `print_summary(run_dir)`. Heavy imports (pandas, matplotlib,
jinja2) happen inside the functions so `driftlab --help` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from driftlab.report.metrics import RunSummary


class ErrorDisplay(str, Enum):
    ci = "ci"
    std = "std"


def summary_table(summary: RunSummary) -> Table:
    """The per-round table (rounds as rows; agent stability, user adoption per condition) for a terminal."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from driftlab.report.figures import model_title
    from driftlab.report.tables import round_table

    tt = round_table(summary)
    n_pairs = summary.scores["pair"].nunique()
    n_cond = summary.scores["condition"].nunique()
    table = Table(
        title=f"Instruction drift · {model_title(summary.manifest)} · {n_pairs} persona pairs"
        + (f" × {n_cond} conditions" if n_cond > 1 else ""),
        caption=tt.note,
        box=box.SIMPLE_HEAD,
    )
    for i, col in enumerate(tt.columns):
        table.add_column(Text(col), justify="right" if i == 0 else "left", no_wrap=i == 0)
    for k, row in enumerate(tt.rows):
        # Text(), not markup: "[0.31, 0.55]" would otherwise be read as a rich style tag.
        table.add_row(*(Text(cell) for cell in row), end_section=k == len(tt.rows) - 2)
    return table


def _num(value: float, fmt: str) -> str:
    """A number as `fmt`, or '-' where it is undefined (NaN: a constant score, too few values)."""
    return format(value, fmt) if value == value else "-"


def print_summary(run_dir: str | Path, console: Console | None = None) -> RunSummary:
    """Summarise a run directory and print its drift table (for the end of `driftlab run`)."""
    from rich.console import Console

    from driftlab.report.metrics import summarize_run

    summary = summarize_run(run_dir)
    console = console or Console()
    console.print(summary_table(summary))
    for r in summary.drift.itertuples():
        console.print(f"drift, {r.condition} ({r.target}): round {r.last} - round {r.first} = {r.diff:+.3f} "
                      f"[{r.diff_ci_low:+.3f}, {r.diff_ci_high:+.3f}] over n={r.n} conversations, {r.better} higher / "
                      f"{r.worse} lower / {r.tied} tied, {r.method} p={r.p:.3g} (Holm {r.p_holm:.3g})",
                      highlight=False, markup=False)
        if r.warning:
            console.print(f"Warning: {r.warning}.", highlight=False, markup=False, style="yellow")
    cmp = summary.comparisons
    for r in cmp.itertuples() if cmp is not None else ():
        console.print(f"{r.condition} - {r.versus} ({r.target}): {r.diff:+.3f} [{r.diff_ci_low:+.3f}, "
                      f"{r.diff_ci_high:+.3f}] over n={r.n} pairs, {r.better} better / {r.worse} worse / {r.tied} tied, "
                      f"{r.method} p={r.p:.3g} (Holm {r.p_holm:.3g})", highlight=False, markup=False)
        if r.warning:
            console.print(f"Warning: {r.warning}.", highlight=False, markup=False, style="yellow")
    from driftlab.report.html import progress

    unscored = int(summary.truncation.probes_unscored.sum()) if len(summary.truncation) else 0
    overall = summary.overall.set_index(["condition", "target", "category"])
    uncut = summary.overall_uncut.set_index(["condition", "target", "category"])
    for r in summary.cut.itertuples():
        key = (r.condition, "agent", "all")
        without = (f"; agent stability {overall.loc[key, 'mean']:.3f}, without cut probes "
                   f"{uncut.loc[key, 'mean']:.3f} (n={int(uncut.loc[key, 'n'])})"
                   if key in overall.index and key in uncut.index else "")
        console.print(f"Replies cut at their token limit, {r.condition}: {round(r.turns_cut * r.turns)} of {r.turns} "
                      f"turns ({r.turns_cut:.0%}), {round(r.probes_cut * r.probes)} of {r.probes} agent probes "
                      f"({r.probes_cut:.0%}){without}.", highlight=False, markup=False,
                      style="yellow" if r.flag else None)
        if r.flag:
            console.print(f"Warning: {r.condition} is cut more or less often than {summary.cut.condition.iloc[0]} "
                          "by more than 10 points: compare them without cut probes (report.html).",
                          highlight=False, markup=False, style="yellow")
    if unscored:
        console.print(f"{unscored} probes unscored: cut, and their measure needs a complete reply.", highlight=False)
    failed = int(summary.truncation.probes_error.sum()) if len(summary.truncation) else 0
    if failed:
        console.print(f"[yellow]Warning:[/] {failed} probes unscored: their measure failed (raised, or gave no score "
                      "in [0, 1]); each record's `error` says why.", highlight=False)
    for r in summary.judge.itertuples():
        unrated = f"; {r.judge_errors} replies the judge did not rate" if r.judge_errors else ""
        if not r.n:
            console.print(f"Judge vs measure ({r.target} probes): no reply scored by both{unrated}.",
                          highlight=False, markup=False)
            continue
        console.print(f"Judge vs measure ({r.target} probes, n={r.n}): Spearman rho {_num(r.spearman, '.2f')} "
                      f"(p={_num(r.spearman_p, '.2g')}), same pass/fail at 0.5 {r.agree:.0%} [{r.agree_low:.0%}, "
                      f"{r.agree_high:.0%}], Cohen's kappa {_num(r.kappa, '.2f')}, mean |difference| {r.mad:.2f}"
                      f"{unrated}.", highlight=False, markup=False)
    state = progress(summary)
    if not state["complete"]:
        counts = ", ".join(f"{state['present'][k]} of {n} {k}s" for k, n in state["expected"].items())
        console.print(f"[yellow]Incomplete run ({counts}):[/] these numbers cover the records written so far. "
                      "Re-run the same `driftlab run` command to finish it.")
    return summary


# How `driftlab report` draws a run of each built-in protocol other than self-chat and MMLU (printed
# below): "module:function" (imported when used: matplotlib is slow to load), and how to read back
# the files it wrote. A plugin's protocol draws itself (`Protocol.report`).
_REPORTERS: dict[str, tuple[str, Callable[[Any], list[Path]]]] = {
    **dict.fromkeys(("pasta-eval", "pasta-profile", "pasta-tune"),
                    ("driftlab.report.pasta:write_pasta_figures", lambda path: [path])),
    "calibrate": ("driftlab.report.calibration:write_calibration_figure", lambda path: [path]),
    "sweep": ("driftlab.report.sweep:write_sweep_report", lambda path: [path]),
    "decay": ("driftlab.report.decay_figures:write_decay_figures", lambda figures: list(figures.files)),
    "replay": ("driftlab.report.replay:write_replay_figures", list),
}


def _figures(protocol: str, run_dir: Path) -> list[Path]:
    """Draw a non-self-chat run's figures and return their paths (a plugin's, by its own `report`)."""
    if protocol not in _REPORTERS:
        from driftlab.protocol.registry import protocol_class

        return list(protocol_class(protocol).report(run_dir))
    import importlib

    target, files = _REPORTERS[protocol]
    module, function = target.split(":")
    return files(getattr(importlib.import_module(module), function)(run_dir))


def _status(run_dir: Path, manifest: dict[str, Any]) -> str:
    """'pasta-eval run: 120 of 120 records, complete' (what any protocol's run can say of itself)."""
    from driftlab.protocol.registry import protocol_of
    from driftlab.records.rundir import RunDir

    expected = sum(protocol_of(manifest).expected(manifest).values())
    present = len(RunDir(run_dir).records())
    state = "complete" if manifest.get("completed") else "incomplete: re-run its command to finish it"
    return f"{manifest.get('protocol', 'selfchat')} run: {present} of {expected} records, {state}"


def report(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="A run directory (the --out of `driftlab run` or any protocol); several: "
                                        "one page comparing them.", metavar="RUN_DIR...")
    ],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Where the comparison of several runs goes (default: ./compare).")
    ] = None,
    open_browser: Annotated[
        bool, typer.Option("--open", help="Open report.html in the default web browser.")
    ] = False,
    errors: Annotated[
        ErrorDisplay,
        typer.Option(
            "--errors",
            help="Figure uncertainty: ci = 95% CI band (t below 30 conversations, bootstrap from 30), "
            "std = ±1 std bars (the paper's).",
        ),
    ] = ErrorDisplay.ci,
    transcripts: Annotated[
        int | None,
        typer.Option(
            "--transcripts", min=0, help="Transcripts of the first N persona pairs only (default: all)."
        ),
    ] = None,
) -> None:
    """Write RUN_DIR/report.html (figures, tables, transcripts) and summary.csv; print the drift table.

    For a run of another protocol (sweep, calibrate, decay, pasta profile|tune|eval, a plugin's) it
    redraws that run's figures from its records; for an MMLU run it prints the accuracy table (per
    condition, the drop with its paired test) that `driftlab mmlu` printed. Every run also gets
    results.json and results.csv (the one results contract: estimates with n, interval and test).
    Several RUN_DIRs: OUT/compare.html (their headline estimates side by side) and compare.csv.
    """
    from rich.console import Console
    from rich.markup import escape

    from driftlab.errors import DriftlabError
    from driftlab.records.rundir import RunDir

    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise DriftlabError(f"{run_dir} is not a directory.", hint="Give the --out directory of a `driftlab run`.")
    if len(run_dirs) > 1:
        from driftlab.report.compare import compare_page

        typer.echo(str(compare_page(run_dirs, out or Path("compare"))))
        return
    run_dir = run_dirs[0]
    manifest = RunDir(run_dir).read_manifest()
    protocol = manifest.get("protocol", "selfchat")
    if protocol == "mmlu":  # a table, no figures: accuracy per condition, the drop and its paired test
        from driftlab.cli.mmlu import print_mmlu

        print_mmlu(run_dir)
    elif protocol in ("kl", "project"):  # a recorded self-chat's measures, read again: beside its own
        from driftlab.cli.finish import print_measures

        print_measures(run_dir)
        typer.echo(_status(run_dir, manifest))
    elif protocol != "selfchat":
        for path in _figures(protocol, run_dir):
            typer.echo(str(path))
        if protocol == "replay":  # pi, the projection and the KLs of every agent turn, where taken
            from driftlab.cli.finish import print_measures

            print_measures(run_dir)
        typer.echo(_status(run_dir, manifest))
    else:
        from driftlab.cli.finish import print_measures
        from driftlab.report.html import (  # matplotlib and pandas: after the manifest
            SUMMARY_CSV,
            write_report,
        )

        console = Console()
        summary = print_summary(run_dir, console)
        print_measures(run_dir)
        path = write_report(run_dir, errors=ErrorDisplay(errors).value, summary=summary, max_pairs=transcripts)
        console.print(f"Report: [bold]{escape(str(path))}[/]", highlight=False)
        console.print(f"Per-round summary: {escape(str(run_dir / SUMMARY_CSV))}", highlight=False)
        if open_browser:
            import webbrowser

            webbrowser.open(path.resolve().as_uri())
    from driftlab.api.runs import write_results

    write_results(run_dir)  # after the protocol's own report: an error there is the one to see
