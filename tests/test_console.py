"""Progress on stderr: bars of runs nested in runs share one live display on a terminal."""

from __future__ import annotations

import io

from rich.console import Console

import driftlab.console as console


def test_nested_progress_bars_share_one_live_display(monkeypatch):
    """A decay trace runs its fresh self-chat inside its own bar; a terminal holds one live display,
    and a second one would raise rich's LiveError."""
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=100)
    monkeypatch.setattr(console, "err_console", lambda: terminal)
    with console.WorkProgress("decay", 2, unit="dialogs") as outer:
        with console.WorkProgress("self-chat", 3) as inner:
            inner.advance(3)
        outer.advance(2)
    with console.WorkProgress("next run", 1) as later:  # the display was released
        later.advance(1)
    shown = screen.getvalue()
    assert all(label in shown for label in ("decay", "self-chat", "next run"))
    assert console.WorkProgress._live is None


def test_progress_is_plain_lines_off_a_terminal(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(console, "err_console", lambda: Console(file=log, force_terminal=False, width=100))
    with console.WorkProgress("mmlu", 4, unit="questions") as bar:
        bar.advance(2)
        bar.advance(2)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("mmlu: 2/4 questions") and lines[1].startswith("mmlu: 4/4 questions")
