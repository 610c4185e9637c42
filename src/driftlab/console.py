"""Where human-facing output goes: progress and notes on stderr, results on stdout.

Commands like `driftlab chat` print only their result on stdout so they compose in pipes.
"""

from __future__ import annotations

import functools
import time
from typing import Any, ClassVar

from rich.console import Console


@functools.cache
def err_console() -> Console:
    return Console(stderr=True)


class WorkProgress:
    """A rich progress bar over units of work (generations, questions) on stderr; plain log
    lines, one per update, when stderr is not a terminal (e.g. a log file or CI).

    Bars nest: a run that runs another inside it (a decay trace's fresh self-chat) shows the
    inner bar as a second line of the same live display (a terminal holds one at a time)."""

    _live: ClassVar[Any] = None  # the Progress on screen, owned by the outermost bar

    def __init__(self, label: str, total: int, enabled: bool = True, unit: str = "generations") -> None:
        self.label, self.total, self.enabled, self.unit, self.done = label, total, enabled, unit, 0

    def __enter__(self) -> WorkProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._console = err_console()
            self._start = time.monotonic()
            self._owner = WorkProgress._live is None
            if self._owner:
                self._p = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                   TimeRemainingColumn(), console=self._console, disable=not self._console.is_terminal)
                self._p.__enter__()
                WorkProgress._live = self._p
            else:
                self._p = WorkProgress._live
            self._task = self._p.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int) -> None:
        if not self.enabled:
            return
        self.done += n
        self._p.update(self._task, advance=n)
        if not self._console.is_terminal:
            elapsed = time.monotonic() - self._start
            left = elapsed / self.done * (self.total - self.done)
            self._console.print(f"{self.label}: {self.done}/{self.total} {self.unit}, "
                                f"{elapsed / 60:.1f} min elapsed, ~{left / 60:.1f} min left",
                                highlight=False, markup=False)

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._owner:
            WorkProgress._live = None
            self._p.__exit__(*exc)
        else:
            self._p.remove_task(self._task)
