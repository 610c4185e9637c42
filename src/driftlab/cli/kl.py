"""`driftlab kl`: a recorded self-chat's drift in its next-token distributions, teacher-forced."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import backend_options, build


@backend_options()
def kl(
    from_run: Annotated[Path, typer.Option(help="The self-chat run directory whose dialogs to read again.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory: the divergences per turn.")],
    backend: BackendSpec,
    dialogs: Annotated[int | None, typer.Option(help="At most this many dialogs (default: all).")] = None,
    batch_size: Annotated[int, typer.Option(help="Dialogs read together, turn by turn.")] = 8,
) -> None:
    """Measure drift in what the model would say, teacher-forced on a recorded self-chat: no generation.

    Per agent turn and probe reply, the KL divergence of the model's next-token distributions over the
    reply's tokens between the dialog as it was and (1) the same dialog with the system prompt restated
    just before the turn (the reminded KL of Dongre et al., "Drift No More?"), (2) the same dialog
    with its system prompt emptied (the prompt's influence). Prints both per round beside the run's
    other measures (probe score; pi and the projection where it took them) and how far they agree,
    and draws them into OUT/three_ways.png.

    Re-running the same command on the same --out resumes.
    """
    from driftlab.api.runs import execute
    from driftlab.cli.finish import print_measures
    from driftlab.protocol.kl import KL, KLConfig

    config = build(KLConfig, backend=backend, from_run=str(from_run), dialogs=dialogs,
                   batch_size=batch_size)
    rundir = execute(KL(config), out)
    print_measures(rundir.path, figure_title=str(from_run))
