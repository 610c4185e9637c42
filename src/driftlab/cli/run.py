"""`driftlab run`: the self-chat drift experiment, resumable, with a report at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import (
    GreedyOpt,
    MaxNewTokensOpt,
    ProbeAfterOpt,
    ProbeTokensOpt,
    SteerOpt,
    TemperatureOpt,
    TopPOpt,
    backend_options,
)


@backend_options(remote=True, ray=True)
def run(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    user_model: Annotated[str | None, typer.Option(help="Different model for the user LM (default: --model).")] = None,
    pairs: Annotated[int | None, typer.Option(
        help="Random (agent, user) persona pairs (default 10; 0 with --pair: only the pairs named).")] = None,
    pair: Annotated[
        list[str] | None, typer.Option("--pair", help="Explicit pair AGENT_ID:USER_ID (repeatable).")
    ] = None,
    categories: Annotated[
        str | None, typer.Option(help="Comma-separated agent persona categories, e.g. 'language,persona'.")
    ] = None,
    rounds: Annotated[int, typer.Option(help="Dialog rounds (paper: 8 rounds, i.e. 16 turns).")] = 8,
    probe_every: Annotated[int, typer.Option(help="Probe rounds i with i % k == 0.")] = 1,
    probe_repeats: Annotated[int, typer.Option(help="Probe replies per probed round.")] = 1,
    probe_after: ProbeAfterOpt = "agent",
    user_probe: Annotated[bool, typer.Option(help="Also probe with the user's persona (adoption).")] = False,
    user_probe_version: Annotated[str, typer.Option(
        help="p_A for --user-probe: 'own' (each user persona's own probe, as in Li et al. 2024, persona drift) or "
             "'crafted-or-generic' (the rule of the revised paper, Li et al., COLM 2024: a probe crafted to break "
             "the persona where the paper prints one, a generic question drawn from a set where the persona's own "
             "probe is generic). Runs recorded under the names earlier versions used resume as these.")] = "own",
    users: Annotated[str, typer.Option(
        help="Where user personas are drawn from: 'personas' (the 100 built-ins, as the papers) or 'drift-pushing' "
             "(users who push for meta-reflection, demand phenomenological accounts, ask for authorial voices, "
             "disclose vulnerability, or ask for role-play; docs/personas.md says where each comes from).")
    ] = "personas",
    starters: Annotated[str, typer.Option(
        help="Conversation starters a_1: 'reference' (the reference code's 45 topics) or 'driftlab'.")] = "reference",
    ablation: Annotated[bool, typer.Option(help="Also run each pair with an empty user system prompt.")] = False,
    max_new_tokens: MaxNewTokensOpt = 400,
    probe_tokens: ProbeTokensOpt = "400",
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 0.9,
    greedy: GreedyOpt = False,
    seed: Annotated[int, typer.Option(help="Run seed: pairs, starters and every sample derive from it.")] = 0,
    steer: SteerOpt = None,
    persona_file: Annotated[
        Path | None, typer.Option(help="JSONL/TOML file of extra personas (see docs/personas.md).")
    ] = None,
    system: Annotated[str | None, typer.Option(
        help="Your own system prompt: the agent of every pair (with --probe and --measure; users are drawn "
             "from the built-ins by --pairs).")] = None,
    probe: Annotated[str | None, typer.Option(help="The probe question that tests --system.")] = None,
    measure: Annotated[str | None, typer.Option(
        help="The measure that scores a probe reply for --system (`driftlab personas measures` lists them).")] = None,
    measure_params: Annotated[str | None, typer.Option(
        help='Its parameters as JSON, e.g. \'{"lang": "fr"}\' for the language measure; for `--measure judge`: '
             '\'{"model": "MODEL", "rubric": "..."}\'.')] = None,
    judge: Annotated[str | None, typer.Option(
        help="Also rate every probe reply with a judge model, beside its measure, and report how the two agree: "
             "a model (preset, directory, Hub id, openai:NAME) or model=...,rubric=...,base_url=....")] = None,
    kl: Annotated[bool, typer.Option(
        "--kl", help="Also measure drift in what the model would say, as each agent reply is generated: the "
                     "KL to the dialog with its system prompt restated before the turn, and to the dialog without "
                     "it (docs/measures.md). Local models only.")] = False,
    batch_size: Annotated[int, typer.Option(help="Most conversations generated together in one batch.")] = 32,
    report: Annotated[bool, typer.Option(help="Write report.html at the end.")] = True,
) -> None:
    """Measure instruction drift with self-chats between persona pairs (Fig. 2 of Li et al. 2024, persona drift).

    Re-running the same command on the same --out resumes: finished generations are kept.
    """
    options = {k: v for k, v in locals().items() if k not in ("out", "backend", "report")}  # the run's options
    from driftlab.api.options import FLAGS, selfchat_config
    from driftlab.api.runs import execute
    from driftlab.cli.finish import say_results
    from driftlab.protocol.selfchat import SelfChat

    config = selfchat_config(backend, FLAGS, options)
    rundir = execute(SelfChat(config), out)
    typer.echo(f"records: {rundir.records_path}")
    if report and any(r["kind"] == "probe" for r in rundir.records()):
        from driftlab.cli.finish import print_measures
        from driftlab.cli.report import print_summary
        from driftlab.report.html import write_report

        summary = print_summary(rundir.path)
        print_measures(rundir.path)
        typer.echo(f"report: {write_report(rundir.path, summary=summary)}")
        say_results(rundir.path)
