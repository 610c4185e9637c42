"""`driftlab replay`: real user turns under a system prompt, every agent turn scored, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import (
    GreedyOpt,
    MaxNewTokensOpt,
    SteerOpt,
    TemperatureOpt,
    TopPOpt,
    backend_options,
)


@backend_options(remote=True, ray=True)
def replay(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    source: Annotated[str, typer.Option(
        help="Where the user turns come from: 'sharegpt-chain' (first turns of distinct ShareGPT conversations, one "
             "per round: no turn refers to an answer the model never gave), 'sharegpt' (whole dialogs), 'mtbench' "
             "(its two-turn questions); `driftlab data pull sharegpt|mtbench` first. Or --conversations.")
    ] = "sharegpt-chain",
    conversations: Annotated[Path | None, typer.Option(
        help='Your own logs: a JSONL file, one conversation per line as {"messages": [{"role": ..., "content": ...}]} '
             "(OpenAI's chat format). Their user turns are replayed in order; their assistant turns are never shown "
             "to the model, which writes its own.")] = None,
    dialogs: Annotated[int | None, typer.Option(
        help="Dialogs to replay (default 10; with --conversations every conversation of the file).")] = None,
    rounds: Annotated[int, typer.Option(help="Most user turns per dialog.")] = 10,
    max_words: Annotated[int, typer.Option(help="Longest user turn drawn from ShareGPT, in words.")] = 60,
    categories: Annotated[str | None, typer.Option(
        help="Agent persona categories whose measure scores every reply (default 'language,pattern'; 'ifeval', 'ifbench': IFEval's or IFBench's instructions, scored by their own checkers).")] = None,
    agents: Annotated[str | None, typer.Option(help="Agent persona ids, comma-separated (any category).")] = None,
    system: Annotated[str | None, typer.Option(
        help="Your own system prompt: the agent of every dialog, its turns scored by --measure.")] = None,
    measure: Annotated[str | None, typer.Option(
        help="The measure that scores each reply for --system (`driftlab personas measures` lists them).")] = None,
    measure_params: Annotated[str | None, typer.Option(
        help='Its parameters as JSON, e.g. \'{"lang": "fr"}\' for the language measure.')] = None,
    probe: Annotated[str | None, typer.Option(help="A probe question for --system (asked only with --probes).")] = None,
    probes: Annotated[bool, typer.Option(help="Also probe the agent every --probe-every rounds, as `run` does.")] = False,
    probe_every: Annotated[int, typer.Option(help="With --probes: probe rounds i with i % k == 0.")] = 1,
    max_new_tokens: MaxNewTokensOpt = 200,
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 0.9,
    greedy: GreedyOpt = False,
    seed: Annotated[int, typer.Option(help="Run seed: dialogs, personas and every sample derive from it.")] = 0,
    steer: SteerOpt = None,
    persona_file: Annotated[
        Path | None, typer.Option(help="JSONL/TOML file of extra personas (see docs/personas.md).")
    ] = None,
    kl: Annotated[bool, typer.Option(
        "--kl", help="Also measure each agent turn's drift in next-token distributions (docs/measures.md).")] = False,
    batch_size: Annotated[int, typer.Option(help="Most conversations generated together in one batch.")] = 32,
) -> None:
    """Replay real user turns to an agent under its system prompt, and score every agent turn.

    Re-running the same command on the same --out resumes: finished turns are kept.
    """
    options = {k: v for k, v in locals().items() if k not in ("out", "backend")}
    from driftlab.api.options import FLAGS, replay_config
    from driftlab.api.runs import execute
    from driftlab.cli.finish import print_measures, say_results
    from driftlab.protocol.replay import Replay
    from driftlab.report.replay import write_replay_figures

    config = replay_config(backend, FLAGS, options)
    rundir = execute(Replay(config), out)
    typer.echo(f"records: {rundir.records_path}")
    for path in write_replay_figures(rundir.path):
        typer.echo(f"figure: {path}")
    print_measures(rundir.path)  # pi, the projection and the KLs per turn, where the run took them
    say_results(rundir.path)
