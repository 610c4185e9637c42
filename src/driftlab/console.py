"""Where human-facing output goes: progress and notes on stderr, results on stdout.

Commands like `driftlab chat` print only their result on stdout so they compose in pipes.
"""

from __future__ import annotations

import functools

from rich.console import Console


@functools.cache
def err_console() -> Console:
    return Console(stderr=True)
