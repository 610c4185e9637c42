"""Conversation starters: the user LM's first turn a_1 in a self-chat (seed 000, Table 1).

Written for this project (the paper's own list was not published with it): open,
opinion-seeking questions on everyday topics, none of which touches a probe question,
so that a persona is exercised by ordinary talk before it is probed.
"""

from __future__ import annotations

from importlib import resources


def _load() -> tuple[str, ...]:
    text = (resources.files("driftlab.bench") / "data" / "starters.txt").read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


#: About 45 discussion openers, one per self-chat, drawn by the protocol.
STARTERS: tuple[str, ...] = _load()
