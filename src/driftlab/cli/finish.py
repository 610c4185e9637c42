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


def print_text_table(table) -> None:
    """A report's `TextTable` on stderr, cells as plain text ("[0.31, 0.55]" is no rich style tag)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    shown = Table(title=table.title, caption=table.note, box=box.SIMPLE_HEAD)
    for column in table.columns:
        shown.add_column(Text(column))
    for row in table.rows:
        shown.add_row(*(Text(cell) for cell in row))
    Console(stderr=True).print(shown)


def print_measures(*run_dirs: Path, figure_title: str = "") -> None:
    """Print the drift measures of runs over the same dialogs side by side (per round, how far they
    agree, the projection's checks) and draw their figure into the first run, where any measure beside
    the probe score was taken (`report.activation`)."""
    from driftlab.report.activation import FIGURE, measure_tables, measured, measures_frame, three_ways_figure

    frame = measures_frame(*run_dirs)
    if not measured(frame):
        return
    for table in measure_tables(frame):
        print_text_table(table)
    typer.echo(str(three_ways_figure(frame, Path(run_dirs[0]) / FIGURE, title=figure_title)))
