"""`driftlab personas ...`: browse the benchmark's system prompts and score replies."""

from __future__ import annotations

import typer

app = typer.Typer(help="The benchmark's 100 system prompts, probes and measures.", no_args_is_help=True)
