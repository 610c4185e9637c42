"""Chat backends: the contracts (`base`), what to run (`spec`), the factory, and the implementations."""

from driftlab.chat.base import (
    Capabilities,
    ChatBackend,
    ChatRequest,
    Conversation,
    LogLikelihood,
    Message,
    ModelShape,
    Rendered,
    Reply,
    Sampling,
    ScoringBackend,
    TokenBackend,
    TokenLogprob,
    chat,
    token_backend,
)
from driftlab.chat.factory import make_backend
from driftlab.chat.spec import BackendSpec, Runtime
from driftlab.chat.trace import Trace  # (not the `trace` function: it would hide the module `chat.trace`)

__all__ = [
    "BackendSpec", "Capabilities", "ChatBackend", "ChatRequest", "Conversation", "HFChatBackend", "LogLikelihood",
    "Message", "ModelShape", "Rendered", "Reply", "Runtime", "Sampling", "ScoringBackend", "TokenBackend",
    "TokenLogprob", "Trace", "chat", "make_backend", "token_backend",
]


def __getattr__(name: str):
    if name == "HFChatBackend":  # imports torch/transformers: only on demand
        from driftlab.chat.hf import HFChatBackend

        return HFChatBackend
    raise AttributeError(name)
