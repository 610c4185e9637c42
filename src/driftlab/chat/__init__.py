"""Chat backends: the protocol, and the local Hugging Face implementation."""

from driftlab.chat.base import ChatBackend, Conversation, Message, Reply, Sampling

__all__ = ["ChatBackend", "Conversation", "Message", "Reply", "Sampling", "HFChatBackend"]


def __getattr__(name: str):
    if name == "HFChatBackend":  # imports torch/transformers: only on demand
        from driftlab.chat.hf import HFChatBackend

        return HFChatBackend
    raise AttributeError(name)
