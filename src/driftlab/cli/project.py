"""`driftlab project`: a recorded self-chat's projections onto persona directions, teacher-forced."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import backend_options, build


@backend_options()
def project(
    from_run: Annotated[Path, typer.Option(help="The self-chat run directory whose dialogs to project.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory: the projections, the figure.")],
    backend: BackendSpec,
    dialogs: Annotated[int | None, typer.Option(help="At most this many dialogs (default: all).")] = None,
) -> None:
    """Project a recorded self-chat onto persona directions, teacher-forced: no generation.

    Each agent turn and probe reply is read once more, and its projection onto its persona's
    direction (--directions) recorded. Prints the projection per round beside the probe score and
    pi, and whether the projection falls, tracks the probe score, and predicts a passing probe.

    Re-running the same command on the same --out resumes.
    """
    from driftlab.api.runs import execute
    from driftlab.cli.finish import print_measures
    from driftlab.protocol.project import Project, ProjectConfig

    config = build(ProjectConfig, backend=backend, from_run=str(from_run), dialogs=dialogs)
    rundir = execute(Project(config), out)
    print_measures(rundir.path, figure_title=str(from_run))
