"""The OpenAI chat-completions request as `driftlab serve` accepts it, plus driftlab's extension.

Purely informational fields (`user`, `metadata`, `store`, ...) and fields this schema does not
know are ignored, so ordinary clients work unchanged. Sampling fields driftlab does not apply
(`logit_bias`, penalties, `top_k`, `min_p`, `repetition_penalty`, a `response_format` other
than text, tools, `n > 1`) are refused with 422 naming the field, rather than silently dropped;
their neutral values (0 penalties, `{"type": "text"}`, ...) are accepted, since they change
nothing. An explicit `null` reads as the field's default, as OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from driftlab.chat.base import MAX_SEED


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: str = "function"
    function: ToolFunction


class ChatMessage(BaseModel):
    """One message of the history. Tool calls and tool results (from a client that ran tools
    elsewhere) are rendered as plain text the model can read: an assistant's calls as
    `[tool call NAME(ARGS)]` lines after its content, a `tool` message as a user message
    `[tool result ID]\nCONTENT` (the serving path renders every model's own template with
    system/user/assistant roles only)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: only an assistant message with tool_calls may have no content")
        return self

    def as_message(self) -> dict[str, str]:
        text = "" if self.content is None else (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content))
        if self.role == "tool":
            head = f"[tool result {self.tool_call_id}]" if self.tool_call_id else "[tool result]"
            return {"role": "user", "content": f"{head}\n{text}"}
        if self.tool_calls:
            calls = "\n".join(f"[tool call {c.function.name}({c.function.arguments})]" for c in self.tool_calls)
            text = f"{text}\n{calls}" if text else calls
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
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the reply ends before the first")
    driftlab: DriftlabOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`"temperature": null` means the default (OpenAI's reading)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (k in NULL_IS_DEFAULT and v is None)}

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is None:
            return None
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("a stop string must not be empty")
        return stops or None

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def new_tokens(self, default: int) -> int | None:
        return self.max_completion_tokens or self.max_tokens or default


NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "logprobs", "top_logprobs", "stream", "max_tokens",
                             "max_completion_tokens", "stop", "seed", "stream_options", "ignore_eos"})

# Fields that would change sampling or the reply's form, with the values that change nothing
# (accepted: a client sending its defaults is honoured).
UNSUPPORTED: dict[str, Any] = {
    "logit_bias": lambda v: v == {},
    "frequency_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "presence_penalty": lambda v: v == 0 and not isinstance(v, bool),
    "top_k": lambda v: v in (-1, 0) and not isinstance(v, bool),
    "min_p": lambda v: v == 0 and not isinstance(v, bool),
    "repetition_penalty": lambda v: v == 1 and not isinstance(v, bool),
    "response_format": lambda v: v == {"type": "text"},
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "best_of": lambda v: v == 1 and not isinstance(v, bool),
    "use_beam_search": lambda v: v is False,
}


def unsupported_field(data: Any) -> str | None:
    """The first field of a request body that driftlab would have to ignore although it
    changes the output (None: none)."""
    if not isinstance(data, dict):
        return None
    for name, neutral in UNSUPPORTED.items():
        if name in data and data[name] is not None and not neutral(data[name]):
            return name
    return None
