"""Does a self-chat fit the model's context window? Asked before any work, so a 100-round run never
dies at round 61 with most of its compute spent.

The policy is the worst case: every user and agent turn, and every probe reply, at its token
limit. A dialog whose agent context could then pass the window at some round is refused, naming
that round; the user LM's context is about as long (the same turns, roles swapped) and is not
counted apart. Turns that stop early leave room the check does not count on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from driftlab.chat.base import Conversation, TokenBackend


@dataclass(frozen=True)
class Overflow:
    """The first round whose worst-case agent context passes the window, and that context's tokens."""

    round: int
    tokens: int
    window: int


def first_overflow(backend: TokenBackend, dialogs: Sequence[tuple[str, str, Sequence[str]]], rounds: int,
                   turn_tokens: int, probe_tokens: int, probe_rounds: Sequence[int]) -> Overflow | None:
    """Over `dialogs` (agent system prompt, starter, the probes asked of the agent), the first round
    whose agent context (the probe's where probed: it follows b_i) can pass the model's window."""
    window = backend.shape.max_context
    if not window:
        return None
    probed = set(probe_rounds)
    size = lambda conv: len(backend.render(conv).ids)  # noqa: E731 - the prompt as the model sees it
    worst: Overflow | None = None
    for system, starter, probes in dialogs:
        opening: Conversation = [{"role": "system", "content": system}, {"role": "user", "content": starter}]
        blank = [*opening, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]
        base, with_blank = size(opening), size(blank)
        per_turn = -(-(with_blank - base) // 2)  # a turn's template tokens around its text
        probe = max((size([*blank[:-1], {"role": "user", "content": p}]) - with_blank for p in probes), default=0)
        for r in range(1, (worst.round if worst else rounds + 1)):
            # [s, a_1, b_1, ..., a_r] and b_r; where probed, b_r's template, the probe and its reply
            tokens = base + (r - 1) * 2 * (turn_tokens + per_turn) + turn_tokens
            if r in probed:
                tokens += 2 * per_turn + probe + probe_tokens
            if tokens > window:
                worst = Overflow(r, tokens, window)
                break
    return worst
