"""`make_backend(spec)`: the one place that turns a model name into a backend.

Protocols and commands never construct a backend class themselves, so a new kind of
backend (an OpenAI-compatible server, a Ray actor pool) plugs in here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.chat.base import ChatBackend

SpanMode = Literal["prefix", "content"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]


class BackendSpec(BaseModel):
    """Which model to run and how (recorded in manifests)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(DEFAULT_MODEL, min_length=1, description="preset name or local HF model directory")
    dtype: Dtype = "auto"
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    span: SpanMode = Field("prefix", description="which tokens are the system prompt: rendered turn or content")


    @field_validator("device")
    @classmethod
    def _usable_device(cls, v: str) -> str:
        # Checked when the spec is made, before any model is looked up, pulled or loaded.
        from driftlab.chat.loading import pick_device

        pick_device(v)
        return v


def make_backend(spec: BackendSpec, *, prefix_cache_bytes: int = 2 << 30) -> ChatBackend:
    """Load the backend a spec names (today: a local Hugging Face model)."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(spec.model, dtype=spec.dtype, device=spec.device, span_mode=spec.span,
                         prefix_cache_bytes=prefix_cache_bytes)
