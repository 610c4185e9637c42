"""The OpenAI chat- and text-completions requests as `driftlab serve` accepts them, plus
driftlab's extension field.

Purely informational fields (`user`, `metadata`, `store`, ...) and fields this schema does not
know are ignored, so ordinary clients work unchanged. The sampling fields `top_k`, `min_p`,
`repetition_penalty`, `frequency_penalty`, `presence_penalty` and `logit_bias` are applied
with vLLM's meaning (see `driftlab.chat.base.Sampling`); a chat `response_format` of
`json_object` or `json_schema` constrains decoding to such JSON (`driftlab.chat.constrain`).
Fields driftlab does not apply (tools, beam search) are refused with 422 naming the field,
rather than silently dropped; their neutral values (`[]`, `"none"`, ...) are accepted, since they change nothing. An explicit `null` reads as the field's default, as
OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, field_validator, model_validator

from driftlab.chat.base import MAX_SEED, Sampling
from driftlab.chat.constrain import JSON_OBJECT, canonical_schema
from driftlab.chat.text import SystemSpan


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


class TelemetryOptions(BaseModel):
    """`"telemetry": {...}`: what a reply's drift telemetry holds beyond the means (serve.telemetry)."""

    model_config = ConfigDict(extra="forbid")

    layers: bool = Field(False, strict=True, description="also pi and the projection per layer")
    kl: bool = Field(False, strict=True, description=(
        "also the reply's reminded KL and prompt influence (docs/measures.md): the reply read again under three "
        "contexts once it is done, on a local model"))


class ChatOptions(DriftlabOptions):
    """The `driftlab` field of a chat request: the steer, and drift telemetry in the reply."""

    telemetry: StrictBool | TelemetryOptions = Field(False, description=(
        "true (or {\"layers\": true}, {\"kl\": true}): the reply carries driftlab.telemetry: rounds, pi and, with "
        "--directions, "
        "the persona projection at its first and last token"))

    def wants_telemetry(self) -> TelemetryOptions | None:
        if isinstance(self.telemetry, TelemetryOptions):
            return self.telemetry
        return TelemetryOptions() if self.telemetry else None


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the reply must satisfy (`strict` or not: it is
    always enforced; `name` and `description` are informational)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _finite(cls, v: dict[str, Any] | bool) -> dict[str, Any] | bool:
        canonical_schema(v)  # ValueError for NaN or infinity, which JSON cannot hold
        return v


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object with a "schema"')
        return self

    def constraint(self) -> str | None:
        """`Sampling.json_schema`: None for text, compact JSON of the schema otherwise."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return JSON_OBJECT
        assert self.json_schema is not None
        return canonical_schema(self.json_schema.schema_)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and text completions share: the model, how to sample, how many choices, stops,
    streaming. Strict types: JSON's true is not the number 1, nor "0.5" a temperature."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, strict=True)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, strict=True)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, strict=True)
    n: int = Field(1, ge=1, le=16, strict=True, description="choices, each with its own seed (not streamed)")
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, strict=True, description="vLLM's extension: generate max_tokens (benchmarks)")
    # applied as vLLM applies them (driftlab.chat.base.Sampling); top_k, min_p and repetition_penalty are vLLM's
    top_k: int = Field(-1, ge=-1, strict=True, description="the k most likely tokens only (-1 or 0: all)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False, strict=True)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, strict=True)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False, strict=True)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False, strict=True)
    logit_bias: dict[str, StrictFloat] = Field(default_factory=dict, strict=True,
                                               description="token id -> bias in [-100, 100] added to its logit")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the reply ends before the first")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`"temperature": null` means the default (OpenAI's reading)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (k in NULL_IS_DEFAULT and v is None)}

    @model_validator(mode="after")
    def _one_streamed_choice(self) -> SamplingFields:
        if self.stream and self.n > 1:
            raise ValueError("stream: one choice per streamed request (n = 1); ask for n > 1 without stream")
        return self

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

    def sampling(self, max_new_tokens: int) -> Sampling:
        """The decoding these fields ask for (pydantic's ValidationError where unusable, e.g. a
        temperature too small to sample with)."""
        return Sampling(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                        ignore_eos=self.ignore_eos, top_k=self.top_k, min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                        presence_penalty=self.presence_penalty, logit_bias=self.logit_bias)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)
    response_format: ResponseFormat | None = None
    driftlab: ChatOptions | None = None

    def sampling(self, max_new_tokens: int) -> Sampling:
        sampling = super().sampling(max_new_tokens)
        schema = self.response_format.constraint() if self.response_format is not None else None
        return sampling if schema is None else sampling.model_copy(update={"json_schema": schema})

    def new_tokens(self, default: int) -> int | None:
        return self.max_completion_tokens or self.max_tokens or default


class SpanChars(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chars: tuple[int, int]


class SpanUntil(BaseModel):
    model_config = ConfigDict(extra="forbid")

    until: str = Field(min_length=1)


class CompletionOptions(DriftlabOptions):
    """The `driftlab` field of a text-completions request: the steer, and where its system span
    is in raw text (a character range, everything before a marker, the chat template's system
    message, or none)."""

    system: SpanChars | SpanUntil | Literal["chat", "none"] = "chat"

    def span(self) -> SystemSpan:
        if isinstance(self.system, SpanChars):
            return SystemSpan(chars=self.system.chars)
        if isinstance(self.system, SpanUntil):
            return SystemSpan(until=self.system.until)
        return SystemSpan(chat=self.system == "chat")


MAX_PROMPTS = 256  # prompts in one text-completions request (lm-eval batches a few dozen)
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default --max-logprobs


class CompletionRequest(SamplingFields):
    """OpenAI's (legacy) text completions as vLLM accepts them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0, strict=True)  # OpenAI's default; 0 with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool = Field(False, strict=True)
    driftlab: CompletionOptions | None = None

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if not self.prompts():
            raise ValueError("prompt: give at least one prompt")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 asks for nothing unless echo is true (score the prompt)")
        if self.stream and len(self.prompts()) > 1:
            raise ValueError("stream: one prompt per streamed request")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings, or lists of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "logprobs", "top_logprobs", "stream", "max_tokens",
                             "max_completion_tokens", "stop", "seed", "stream_options", "ignore_eos", "echo",
                             "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                             "logit_bias", "response_format"})

# Fields that would change sampling or the reply's form, with the values that change nothing
# (accepted: a client sending its defaults is honoured).
UNSUPPORTED: dict[str, Any] = {
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
