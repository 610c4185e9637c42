"""`driftlab theory --out DIR`: numerical checks of the cone geometry of the persona-drift paper, Sec. 5.

Mounted in driftlab.cli with `app.command("theory")(theory)`. numpy/scipy/matplotlib only,
imported inside the function so `driftlab --help` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer


def theory(
    out: Annotated[
        Path, typer.Option("--out", help="Directory for plots, tables (CSV/markdown) and summary.json.")
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model", help="Preset name or model directory: adds Figure 7 (histogram of embedding norms)."
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Small simulations that finish in seconds (smoke test).")
    ] = False,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of every simulation; same seed, same numbers.")
    ] = 0,
) -> None:
    """Check Theorem 5.1, Propositions 5.2 and 5.3 (and Figure 7) of the persona-drift paper by simulation."""
    from rich.console import Console
    from rich.table import Table

    from driftlab.errors import DriftlabError
    from driftlab.report.theory import write_theory

    if seed < 0:
        raise DriftlabError(
            f"--seed must be >= 0, got {seed}.", hint="numpy seeds are non-negative integers."
        )
    console = Console()
    t0 = time.perf_counter()
    with console.status("running theory checks") as status:
        rep = write_theory(out, model=model, quick=quick, seed=seed, progress=lambda msg: status.update(msg))
    elapsed = time.perf_counter() - t0

    table = Table(title=f"driftlab theory ({'quick' if quick else 'full'}, seed {seed})", show_lines=True)
    table.add_column("claim", ratio=3)
    table.add_column("measured", ratio=3)
    table.add_column("expected / bound", ratio=2)
    table.add_column("", no_wrap=True)
    style = {"pass": "[green]pass[/]", "FAIL": "[bold red]FAIL[/]", "info": "[cyan]info[/]"}
    for c in rep.checks:
        table.add_row(c.claim, c.measured, c.expected, style[c.status])
    console.print(table)
    n_fail = sum(c.status == "FAIL" for c in rep.checks)
    verdict = "[green]all checks passed[/]" if not n_fail else f"[bold red]{n_fail} check(s) failed[/]"
    console.print(f"{verdict} in {elapsed:.1f} s. Files in [bold]{out}[/]:", highlight=False)
    for f in rep.files:
        console.print(f"  {f.name}", highlight=False)
    if n_fail:
        raise typer.Exit(code=1)
