"""The OpenAI chat-completions request as `driftlab serve` accepts it, plus driftlab's extension.

Unknown OpenAI fields are ignored (as vLLM does), so ordinary clients work unchanged;
fields whose meaning driftlab cannot honour (n > 1, stop sequences, tools) are refused with
422 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from driftlab.chat.base import MAX_SEED


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def as_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class DriftlabOptions(BaseModel):
    """The `"driftlab": {...}` extension field: per-request interventions."""

    model_config = ConfigDict(extra="forbid")

    steer: list[str] | str | None = Field(
        None, description="--steer specs replacing the server's default, e.g. 'split-softmax:k=0.8'; [] = none"
    )

    def specs(self) -> list[str] | None:
        return [self.steer] if isinstance(self.steer, str) else self.steer


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    # strict: JSON's true is not the number 1, nor "0.5" a temperature
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, strict=True)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, strict=True)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, strict=True)
    n: int = Field(1, ge=1, le=1, strict=True, description="one choice per request")
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)
    ignore_eos: bool = Field(False, strict=True, description="vLLM's extension: generate max_tokens (benchmarks)")
    stop: Any = None
    tools: Any = None
    driftlab: DriftlabOptions | None = None

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, v: Any) -> Any:
        if v not in (None, [], ""):
            raise ValueError("stop sequences are not supported by driftlab serve")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v not in (None, []):
            raise ValueError("tools are not supported by driftlab serve")
        return v

    def new_tokens(self, default: int) -> int | None:
        return self.max_completion_tokens or self.max_tokens or default
