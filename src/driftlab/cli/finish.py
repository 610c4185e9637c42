"""What every command says when its run completes: where its results.json is (written by
`driftlab.api.runs.execute`, the one results contract of `driftlab.report.results`)."""

from __future__ import annotations

from pathlib import Path

import typer


def say_results(run_dir: Path) -> None:
    """Print where the run's results.json is (a run whose summary could not be made has none,
    and `execute` said why)."""
    from driftlab.report.results import RESULTS_JSON

    path = Path(run_dir) / RESULTS_JSON
    if path.exists():
        typer.echo(f"results: {path}")
