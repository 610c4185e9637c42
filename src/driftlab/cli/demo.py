"""`driftlab demo`: drift measured five ways on the default model, in one command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import backend_options

#: The demo's self-chats: three agent personas the default model follows at least at first, each
#: against a user persona of another category.
PAIRS = ("user-named-sophie:very-happy", "users-sister:teen-slang", "secret-number-share:loves-tennis")
#: Its settings: short turns, so a CPU runs it in minutes; the probe gets a little more room.
ROUNDS, TURN_TOKENS, PROBE_TOKENS = 4, 48, 64
#: Its directions: each agent persona's probe and this many starters, with and without the prompt.
STARTERS, DIRECTION_TOKENS = 8, 32


def demo_options() -> dict:
    """The self-chat the demo runs: `driftlab run` with these options (and --directions)."""
    return {"pair": list(PAIRS), "rounds": ROUNDS, "max_new_tokens": TURN_TOKENS, "probe_tokens": PROBE_TOKENS,
            "user_probe": True, "steer": ["trace"], "kl": True, "seed": 0}


@backend_options(span=False)
def demo(
    backend: BackendSpec,
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write it (created, or resumed).")] = Path(
        "runs/demo"),
) -> None:
    """Measure instruction drift five ways on the default model, in one command.

    First the persona directions of three agents (OUT/directions), then their self-chats of four
    rounds, probed every round, with the attention on the system prompt (pi), the projection on
    each persona's direction and the two KLs of each reply (to the dialog with the prompt restated,
    and without it) recorded. Prints them per round and how far they agree. Writes OUT/report.html. The same as `driftlab directions`
    and `driftlab run` with the settings in docs/results/demo-smollm2; re-running resumes.
    """
    from driftlab.api.options import FLAGS, directions_config, selfchat_config
    from driftlab.api.runs import execute
    from driftlab.cli.finish import print_measures, say_results
    from driftlab.cli.report import print_summary
    from driftlab.protocol.directions import DirectionsProtocol
    from driftlab.protocol.selfchat import SelfChat
    from driftlab.report.html import write_report

    agents = sorted({p.split(":")[0] for p in PAIRS})
    found = execute(DirectionsProtocol(directions_config(backend, FLAGS, {
        "personas": agents, "starters": STARTERS, "max_new_tokens": DIRECTION_TOKENS})), out / "directions")
    steered = backend.model_copy(update={"directions": str(found.path)})
    rundir = execute(SelfChat(selfchat_config(steered, FLAGS, demo_options())), out)
    summary = print_summary(rundir.path)
    print_measures(rundir.path)
    typer.echo(f"report: {write_report(rundir.path, summary=summary)}")
    say_results(rundir.path)
