"""The contract every chat backend meets: a batch of conversations in, one reply each out.

Protocols (self-chat, MMLU, sweeps) only talk to this interface, so the same experiment
runs on a local Hugging Face model or on any OpenAI-compatible server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Message(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


Conversation = list[Message]


class Sampling(BaseModel):
    """How to decode. Defaults follow the drift papers: temperature 1.0, nucleus top-p 0.9."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(128, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    greedy: bool = False
    seed: int = 0
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)

    @model_validator(mode="after")
    def _temperature_zero_means_greedy(self) -> Sampling:
        if self.temperature == 0.0 and not self.greedy:
            object.__setattr__(self, "greedy", True)
        return self


@dataclass
class Reply:
    """One generated reply and what is known about how it ended."""

    text: str
    n_tokens: int
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] = field(default_factory=list)
    trace: Any = None  # attention trace when one was requested (local backend only)


@runtime_checkable
class ChatBackend(Protocol):
    """Anything that can continue a batch of conversations."""

    name: str

    def chat(
        self,
        conversations: Sequence[Conversation],
        sampling: Sampling,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[Reply]:
        """Generate the next assistant turn of every conversation.

        `seeds` gives each row its own random stream, so a conversation's sample does not
        depend on which other conversations share its batch (this is what makes resumed
        runs reproduce uninterrupted ones). Without it, row i uses `sampling.seed + i`.
        """
        ...


def validate_conversation(conversation: Sequence[Message], index: int = 0) -> None:
    """Reject malformed conversations with a message that says which one and why."""
    from driftlab.errors import DriftlabError

    if not conversation:
        raise DriftlabError(f"Conversation {index} is empty.", hint="Give at least one user message.")
    for j, msg in enumerate(conversation):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise DriftlabError(
                f"Conversation {index}, message {j} is not a {{'role', 'content'}} mapping: {msg!r}."
            )
        if msg["role"] not in ("system", "user", "assistant"):
            raise DriftlabError(
                f"Conversation {index}, message {j} has role '{msg['role']}'.",
                hint="Roles are 'system', 'user' and 'assistant'.",
            )
        if not isinstance(msg["content"], str):
            raise DriftlabError(f"Conversation {index}, message {j} has non-text content.")
