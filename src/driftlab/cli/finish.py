"""What every command does when its run completes: the run's results.json and results.csv
(the one results contract, `driftlab.report.results`), so any run reads the same way."""

from __future__ import annotations

from pathlib import Path

import typer


def write_results(run_dir: Path, *, say: bool = False) -> None:
    """results.json / results.csv of any run (every command that completes a run writes them),
    said in one line on stderr if they cannot be made (an incomplete run may lack what its
    summary needs; its own report says more); `say`: print where they are."""
    from driftlab.errors import DriftlabError
    from driftlab.report.results import summarize

    try:
        written = summarize(run_dir).write(run_dir)
    except (DriftlabError, OSError, KeyError, ValueError) as err:
        typer.echo(f"note: no results.json for {run_dir} ({type(err).__name__}: {err})".splitlines()[0], err=True)
        return
    if say:
        typer.echo(f"results: {written[0]}")
