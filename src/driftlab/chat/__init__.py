"""Chat backends: the protocol, the typed request, the factory, and the local implementation."""

from driftlab.chat.base import (
    Capabilities,
    ChatBackend,
    ChatRequest,
    Conversation,
    LogLikelihood,
    Message,
    Reply,
    Sampling,
    ScoringBackend,
    TokenLogprob,
    chat,
)
from driftlab.chat.factory import BackendSpec, make_backend

__all__ = [
    "BackendSpec", "Capabilities", "ChatBackend", "ChatRequest", "Conversation", "HFChatBackend", "LogLikelihood",
    "Message", "Reply", "Sampling", "ScoringBackend", "TokenLogprob", "chat",
    "make_backend",
]


def __getattr__(name: str):
    if name == "HFChatBackend":  # imports torch/transformers: only on demand
        from driftlab.chat.hf import HFChatBackend

        return HFChatBackend
    raise AttributeError(name)
