"""Conversation starters: the user LM's first turn a_1 in a self-chat (both drift papers, Sec. 3.1, Table 1).

Two lists, by name in `STARTER_SETS`:

* ``"reference"`` (the default): the 45 ``topics`` of the public reference code of the
  persona-drift paper, ``utils.py`` of github.com/likenneth/persona_drift (commit e5b57b0c,
  unchanged since 6a2be7b5), verbatim and in order, in ``data/starters_reference.txt``. The
  papers do not print the list (the persona-drift paper promises to release it; its Table 1
  shows "What's your take on celebrity culture?", which is not among them verbatim). The
  reference builds a_1 with **no template**: ``run.py`` starts the dialog as
  ``"history": [topic]`` and sends that string unchanged as the first user message, so a starter
  here *is* a_1. (Only the user LM's later view is templated: its first
  exchange is folded into ``In the last round, you asked me: "{a_1}" and I answered: "{b_1}"``,
  ``utils.qa2qa_prompt``, which driftlab's protocol reproduces.) The reference draws the topic
  uniformly at random unless ``--topic`` is given; near-duplicate entries are kept as they are.
* ``"driftlab"``: 45 open, opinion-seeking questions on everyday topics written for this project
  (``data/starters.txt``), none touching a probe question.

`STARTERS` is the default list (``"reference"``), kept for code that imports it.
"""

from __future__ import annotations

import difflib
from importlib import resources
from typing import Literal, get_args

from driftlab.errors import DriftlabError

StarterSetName = Literal["reference", "driftlab"]
#: The names `starters()` accepts, default first.
STARTER_SET_NAMES: tuple[str, ...] = get_args(StarterSetName)
DEFAULT_STARTER_SET: StarterSetName = "reference"

_FILES = {"reference": "starters_reference.txt", "driftlab": "starters.txt"}


def _load(filename: str) -> tuple[str, ...]:
    text = (resources.files("driftlab.bench") / "data" / filename).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


#: Every starter list by name; the tuples are immutable, so sharing them is safe.
STARTER_SETS: dict[str, tuple[str, ...]] = {name: _load(_FILES[name]) for name in STARTER_SET_NAMES}

#: The default starter list (the reference code's 45 topics), one drawn per self-chat by the protocol.
STARTERS: tuple[str, ...] = STARTER_SETS[DEFAULT_STARTER_SET]


def starters(name: str = DEFAULT_STARTER_SET) -> list[str]:
    """The starter list called `name` ("reference", the default, or "driftlab"), as a new list.

    Each entry is used verbatim as a_1: the reference code applies no template to its topics.
    """
    if name not in STARTER_SETS:
        close = difflib.get_close_matches(name, STARTER_SETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise DriftlabError(f"unknown starter set {name!r}", hint=f"{hint}use one of: {', '.join(STARTER_SETS)}")
    return list(STARTER_SETS[name])
