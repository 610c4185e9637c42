"""A scripted chat backend: exact, instant replies for protocol tests.

Each reply is derived from (seed, the whole conversation) by a hash, so it is unique,
reproducible across processes and changes whenever the context does: a protocol that
shows a model the wrong history, reuses a seed or loses a turn gives different text, and
an exact test notices. Real-model protocol tests live beside these, fewer and slower.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from driftlab.chat.base import Capabilities, ChatRequest, Reply
from driftlab.steering.interventions import KINDS


def scripted_text(conversation, seed: int, fingerprint: str = "") -> str:
    digest = hashlib.sha256(json.dumps([conversation, seed, fingerprint]).encode()).hexdigest()
    return f"reply {digest[:12]}"


class ScriptedBackend:
    """Implements the ChatBackend protocol without a model; keeps every request it served."""

    def __init__(self, name: str = "scripted", interventions: frozenset[str] = frozenset(KINDS),
                 finish_reason: str = "stop") -> None:
        self.name = name
        self.finish_reason = finish_reason  # "length": every reply reads as cut at the token limit
        self.capabilities = Capabilities(interventions=interventions)
        self.requests: list[ChatRequest] = []

    def generate(self, request: ChatRequest) -> list[Reply]:
        self.capabilities.require(self.name, request.interventions)
        self.requests.append(request)
        fp = request.interventions.fingerprint()
        out = []
        for conv, seed in zip(request.conversations, request.row_seeds(), strict=True):
            text = scripted_text(request.interventions.model_view(conv), seed, fp)
            out.append(Reply(text=text, n_tokens=2, finish_reason=self.finish_reason))
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "backend": "scripted", "dtype": "float32"}

    @property
    def seen(self) -> list[tuple[list, str]]:
        """(conversation, reply text) of every row served, in order."""
        fp = lambda r: r.interventions.fingerprint()  # noqa: E731
        return [(c, scripted_text(r.interventions.model_view(c), s, fp(r))) for r in self.requests
                for c, s in zip(r.conversations, r.row_seeds(), strict=True)]
