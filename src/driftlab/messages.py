"""A conversation as data: the one message type every layer shares.

It sits at the bottom of the package (it imports nothing of driftlab but the error type),
because interventions edit conversations, backends render them and protocols build them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypedDict

from driftlab.errors import DriftlabError


class Message(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


Conversation = list[Message]
ROLES = ("system", "user", "assistant")


def validate_conversation(conversation: Sequence[Message], index: int = 0) -> None:
    """Reject malformed conversations with a message that says which one and why."""
    if not conversation:
        raise DriftlabError(f"Conversation {index} is empty.", hint="Give at least one user message.")
    for j, msg in enumerate(conversation):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise DriftlabError(
                f"Conversation {index}, message {j} is not a {{'role', 'content'}} mapping: {msg!r}."
            )
        if msg["role"] not in ROLES:
            raise DriftlabError(
                f"Conversation {index}, message {j} has role '{msg['role']}'.",
                hint="Roles are 'system', 'user' and 'assistant'.",
            )
        if not isinstance(msg["content"], str):
            raise DriftlabError(f"Conversation {index}, message {j} has non-text content.")
