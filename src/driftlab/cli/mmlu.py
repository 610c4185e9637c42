"""`driftlab mmlu`: what an intervention costs in MMLU accuracy at a turn of a dialog."""

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
    SteerOpt,
    TiesOpt,
    TurnCountingOpt,
    TurnOpt,
    backend_options,
)


@backend_options(remote=True, ray=True)
def mmlu(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    steer: SteerOpt = None,
    n: Annotated[int, typer.Option("--n", help="Questions, stratified by subject (1-14042).")] = 200,
    turn: TurnOpt = 4,
    turn_counting: TurnCountingOpt = "paper",
    histories: HistoriesOpt = 1,
    history_from: Annotated[Path | None, typer.Option(
        "--history-from", help="Ask after the recorded dialogs of this run (a replay or a self-chat; its first "
                               "--histories), the same under both conditions, instead of generating a history. "
                               "With --steer when-drifting:r=R,by=score, a question is steered where the replay's "
                               "last agent turn before it scored below R.")] = None,
    ties: TiesOpt = "random",
    history_tokens: HistoryTokensOpt = 64,
    seed: MMLUSeedOpt = 0,
    data: MMLUDataOpt = None,
    batch_size: Annotated[int, typer.Option(help="Questions scored per forward pass.")] = 8,
    effect: Annotated[float, typer.Option(
        help="Say how many questions a drop of this size would need (exact McNemar, alpha 0.05, power 0.8), "
             "in (0, 1].")] = 0.05,
) -> None:
    """MMLU accuracy with and without --steer, the question asked at a turn of the agent's dialog.

    Letters are chosen by next-token log-likelihood (no generation). Prints the accuracy per
    condition with 95% Wilson intervals, the drop with its paired interval and exact McNemar p,
    a warning where the questions are too few to support a drop, and how many questions a
    drop of --effect would need. Re-running the same command resumes.
    """
    options = {k: v for k, v in locals().items() if k not in ("out", "backend", "effect")}  # the run's options
    from driftlab.api.options import FLAGS, mmlu_config
    from driftlab.api.runs import execute
    from driftlab.cli.finish import say_results
    from driftlab.errors import DriftlabError
    from driftlab.protocol.mmlu import MMLU

    if not 0 < effect <= 1:  # also nan
        raise DriftlabError(f"Invalid --effect {effect}: give an accuracy drop in (0, 1], e.g. 0.05.",
                            hint="The command's --help lists every option with its valid values.")
    rundir = execute(MMLU(mmlu_config(backend, FLAGS, options)), out)
    print_mmlu(rundir.path, effect)
    say_results(rundir.path)
    typer.echo(f"records: {rundir.records_path}")


def print_mmlu(run_dir: Path, effect: float = 0.05) -> None:
    """The accuracy table of an MMLU run (also `driftlab report` of one): per condition with its
    interval, the drop with its paired test, the warnings its records call for, and the power."""
    from rich.console import Console
    from rich.table import Table

    from driftlab.protocol.mmlu import MMLUConfig, answers, correctness, questions_needed, summarize
    from driftlab.protocol.runner import config_of
    from driftlab.records.rundir import RunDir

    config = MMLUConfig.model_validate({**MMLUConfig.LEGACY, **config_of(RunDir(run_dir).read_manifest())})
    backend = config.backend
    s = summarize(run_dir)
    after = f" after {config.histories} dialog(s)" if config.round else ""
    table = Table(title=f"MMLU at turn {config.turn} ({config.turn_counting} counting, round {config.round}) · "
                        f"{backend.model} · {s['n']} questions{after}")
    for col in ("condition", "n", "accuracy", "95% CI", "method", "p"):
        table.add_column(col)
    for condition in config.conditions:
        row = s[condition]
        label = "plain" if condition == "plain" else f"steered: {', '.join(config.steer.specs())}"
        table.add_row(label, str(row["n"]), f"{row['accuracy']:.3f}", f"[{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]",
                      row["ci_method"], "")
    console = Console()
    broken = "at random, seeded" if config.ties == "random" else "towards the first letter"
    notes = []
    for c in config.conditions:
        h = s[c]
        if h["collapsed"]:
            notes.append(f"{c}: {h['top_share']:.0%} of answers are {h['top_letter']}: its predictions collapsed, so "
                         f"its accuracy is the share of questions whose answer is {h['top_letter']}, not knowledge.")
        if h["history_turns_cut"] == h["history_turns_cut"] and h["history_turns_cut"] > 0:
            notes.append(f"{c}: {h['history_turns_cut']:.0%} of the dialog turns before the questions were cut at "
                         "--history-tokens.")
        if h["tied"]:
            notes.append(f"{c}: {h['tied']} questions had tied top letters (broken {broken}).")
    if "drop" in s:
        d = s["drop"]
        table.add_row("drop (plain - steered)", str(d["n"]), f"{d['mean']:+.3f}",
                      f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]", f"{d['ci_method']}; {d['method']}", f"{d['p']:.3g}")
        console.print(table)
        console.print(f"{d['lost']} questions lost and {d['gained']} gained under steering.", highlight=False)
        gated = [r.gate["steered"] for r in answers(run_dir)["steered"].values() if getattr(r, "gate", None)]
        if gated:  # when-drifting:by=score: steered only after a dialog whose last agent turn failed
            console.print(f"The gate steered {sum(gated)} of {len(gated)} questions (those after a failing turn).",
                          highlight=False)
        if d["dialogs"] == 1 and config.round:
            console.print("The drop rests on one dialog: every question was asked after the same context "
                          "(--histories N spreads them over N dialogs).", highlight=False)
        if d["warning"]:
            console.print(f"[yellow]Warning:[/] {d['warning']}.", highlight=False)
        correct = correctness(run_dir)
        need = questions_needed(effect, correct["plain"], correct["steered"])
        console.print(f"Power: a drop of {effect:g} needs about {need['n']} questions (exact McNemar, alpha "
                      f"{need['alpha']:g}, power {need['power']:g}, {need['discordant']:.0%} of questions answered "
                      f"differently); this run has {d['n']}.", highlight=False)
    else:
        console.print(table)
    for note in notes:
        console.print(f"[yellow]Warning:[/] {note}", highlight=False)
