"""The `driftlab` command line: one Typer app, one module per command group.

Command modules import torch/transformers inside their functions, so `driftlab --help`
and data-only commands start quickly.
"""

from __future__ import annotations

import os
import sys

import typer

from driftlab.cli import data, models, pasta, personas, protocol
from driftlab.cli.calibrate import calibrate
from driftlab.cli.chat import chat
from driftlab.cli.decay import decay
from driftlab.cli.demo import demo
from driftlab.cli.directions import directions, export_directions
from driftlab.cli.equilibrium import equilibrium
from driftlab.cli.kl import kl
from driftlab.cli.mmlu import mmlu
from driftlab.cli.project import project
from driftlab.cli.replay import replay
from driftlab.cli.report import report
from driftlab.cli.run import run
from driftlab.cli.serve import serve
from driftlab.cli.sweep import sweep
from driftlab.cli.theory import theory
from driftlab.cli.warn import warn

app = typer.Typer(
    name="driftlab",
    help="Measure and control instruction drift in language-model dialogs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _global(verbose: bool = typer.Option(False, "--verbose", "-v", help=(
        "Show the engines' own logs: vLLM's INFO lines (on stderr; without -v only its warnings), as "
        "VLLM_LOGGING_LEVEL would."))) -> None:
    """Measure and control instruction drift in language-model dialogs."""
    if verbose:
        from driftlab.chat.vllm_engine.install import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"


app.add_typer(models.app, name="models")
app.add_typer(personas.app, name="personas")
app.add_typer(data.app, name="data")
app.add_typer(pasta.app, name="pasta")
app.add_typer(protocol.app, name="protocol")
app.command("chat")(chat)
app.command("demo")(demo)
app.command("run")(run)
app.command("replay")(replay)
app.command("warn")(warn)
app.command("report")(report)
app.command("decay")(decay)
app.command("directions")(directions)
app.command("export-directions")(export_directions)
app.command("project")(project)
app.command("kl")(kl)
app.command("equilibrium")(equilibrium)
app.command("mmlu")(mmlu)
app.command("calibrate")(calibrate)
app.command("sweep")(sweep)
app.command("theory")(theory)
app.command("serve")(serve)


def main() -> None:
    """Entry point that turns DriftlabError into a two-line message and exit code 2.

    Messages and hints carry user text (ids, paths, patterns such as "[a-z]"), so they are
    printed as plain Text, never parsed as rich markup; each stays on one line (soft wrap).
    """
    from rich.console import Console
    from rich.text import Text

    from driftlab.errors import DriftlabError

    try:
        app(standalone_mode=True)
    except DriftlabError as err:  # pragma: no cover - exercised through subprocess tests
        console = Console(stderr=True, soft_wrap=True, highlight=False)
        console.print(Text.assemble(("Error:", "bold red"), " ", " ".join(str(err.message).split())))
        if err.hint:
            console.print(Text.assemble(("Hint:", "yellow"), " ", " ".join(str(err.hint).split())))
        sys.exit(2)


if __name__ == "__main__":
    main()
