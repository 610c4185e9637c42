"""The contracts backends meet, and the data that crosses them.

* `ChatBackend`: a typed request in (`ChatRequest`: conversations, sampling, interventions),
  one `Reply` per conversation out. Protocols (self-chat, MMLU, sweeps) talk only to this,
  so the same experiment runs on a local Hugging Face model or on any OpenAI-compatible
  server. `ScoringBackend` adds log-likelihood scoring (MMLU, PASTA's scoring tasks).
* `TokenBackend`: the token level of a local model, for work that must see tokens
  (PASTA head profiling, attention-decay replay, streaming servers): render a conversation
  to tokens with named spans, decode token prompts with per-row interventions, the model's
  shape, stop tokens, token ids back to text.

A backend declares what it can do (`Capabilities`): the intervention kinds it applies,
whether it scores log-likelihoods and whether it is a `TokenBackend`; protocols check that
(`token_backend`) instead of probing attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from driftlab.errors import DriftlabError
from driftlab.messages import Conversation, Message, validate_conversation
from driftlab.steering.interventions import Interventions

if TYPE_CHECKING:
    import torch

    from driftlab.chat.trace import Trace

__all__ = [
    "MAX_SEED", "Capabilities", "ChatBackend", "ChatRequest", "Conversation", "LogLikelihood", "Message",
    "ModelShape", "Rendered", "Reply", "Sampling", "ScoringBackend", "TokenBackend", "TokenLogprob", "chat",
    "model_shape", "system_of", "token_backend", "validate_conversation", "without_system",
]

MAX_SEED = 2**63 - 1


class Sampling(BaseModel):
    """How to decode: the one definition every command and config nests.

    Defaults follow the drift papers (temperature 1.0, nucleus top-p 0.9). Seeds are not
    here: they belong to each generated row (`ChatRequest.seeds`), so a conversation's
    sample does not depend on which others share its batch.

    The OpenAI/vLLM fields after `ignore_eos` mean what they mean in vLLM, and their defaults
    change nothing: `logit_bias` is added to the logits, then `repetition_penalty` (over the
    prompt and the generated tokens: a logit > 0 is divided by it, others multiplied) and
    `frequency_penalty` / `presence_penalty` (over the generated tokens: logit -= f * count +
    p * (count > 0)) apply, in greedy decoding too; `top_k` (0 or -1: off) and `min_p` (0: off)
    only when sampling. At their defaults they are left out of a dump, so configs and
    manifests written before they existed read and compare as they did.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(128, ge=1, le=32768, description="most tokens per reply")
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 means greedy")
    top_p: float = Field(0.9, gt=0.0, le=1.0, allow_inf_nan=False, description="nucleus mass, in (0, 1]")
    greedy: bool = False
    ignore_eos: bool = Field(False, description="always generate max_new_tokens (benchmarks)")
    top_k: int = Field(0, ge=-1, description="sample among the k most likely tokens (0 or -1: all)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False,
                         description="drop tokens less likely than min_p times the most likely one (0: off)")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                                      description="over prompt and generated tokens (1: off; > 1 discourages)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
                                     description="subtracted per earlier occurrence in the reply")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False,
                                    description="subtracted once a token occurs in the reply")
    logit_bias: tuple[tuple[int, float], ...] = Field(
        (), description="token id -> bias in [-100, 100] added to its logit (given as a mapping)")
    json_schema: str | None = Field(
        None, description="constrain the reply to JSON valid under this schema (compact JSON text; "
                          "driftlab.chat.constrain), after bias and penalties")

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int) -> int:
        return 0 if v == -1 else v  # vLLM's -1 and 0 both mean off: one value, so equal samplings compare equal

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_mapping(cls, v: Any) -> Any:
        """A mapping {token id (an int or its decimal string): bias}, as OpenAI sends it, read as pairs."""
        if isinstance(v, dict):
            for key in v:
                if isinstance(key, str) and not (key.isascii() and key.isdigit()):
                    raise ValueError(f"token id {key!r} is not a non-negative integer")
            return [(int(key), bias) for key, bias in v.items()]
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_pairs(cls, v: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        """Sorted (id, bias) pairs: hashable and order-free (a Sampling is a batch's grouping key)."""
        for token, bias in v:
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias:g} of token {token} is outside [-100, 100]")
        if len({token for token, _ in v}) < len(v):
            raise ValueError("a token id is given twice")
        return tuple(sorted(v))

    @field_serializer("logit_bias")
    def _bias_as_mapping(self, v: tuple[tuple[int, float], ...]) -> dict[str, float]:
        return {str(token): bias for token, bias in v}

    @model_serializer(mode="wrap")
    def _neutral_left_out(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in _NEUTRAL_LEFT_OUT:
            if getattr(self, name) == Sampling.model_fields[name].default:
                data.pop(name, None)
        return data

    @field_validator("temperature")
    @classmethod
    def _usable_temperature(cls, v: float) -> float:
        # Below ~1e-2, logits / T overflows to inf in float32 for ordinary logit gaps.
        if 0.0 < v < 1e-2:
            raise ValueError(f"temperature {v:g} is too small to sample with; use 0 (greedy) or at least 0.01")
        return v

    @model_validator(mode="after")
    def _temperature_zero_means_greedy(self) -> Sampling:
        if self.temperature == 0.0 and not self.greedy:
            object.__setattr__(self, "greedy", True)
        return self

    @property
    def penalized(self) -> bool:
        """Whether logit_bias or a penalty changes the logits (also before a greedy argmax)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 \
            or self.presence_penalty != 0.0

    def check_vocab(self, vocab_size: int | None) -> None:
        """A DriftlabError naming logit_bias if it names a token the model does not have."""
        bad = [token for token, _ in self.logit_bias if vocab_size is not None and token >= vocab_size]
        if bad:
            raise DriftlabError(f"logit_bias: token id {bad[0]} is not in the model's vocabulary "
                                f"(ids 0 to {vocab_size - 1}).")


# Added after runs were recorded: a dump leaves them out at their defaults (see Sampling).
_NEUTRAL_LEFT_OUT = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
                     "json_schema")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at its step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Distributions:
    """The model's own next-token distributions at every generated token's step: `logprobs[j]`
    (log-softmax of the raw logits, float32) predicted `ids[len(ids) - len(logprobs) + j]`; `ids`
    is the whole context, the prompt as tokens and then every sampled token (an ending EOS too).
    What a live KL reads for the dialog as it was, instead of reading the reply again."""

    ids: list[int]
    logprobs: torch.Tensor


@dataclass
class Reply:
    """One generated reply and what is known about how it ended."""

    text: str
    n_tokens: int
    finish_reason: Literal["stop", "length", "cancelled"]  # cancelled: its caller gave up (ChatRequest.cancelled)
    token_ids: list[int] = field(default_factory=list)
    trace: Trace | None = None  # pi per token, layer and head when tracing was asked for (local backend only)
    n_prompt_tokens: int = 0  # tokens the model was shown (0 where unknown)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when ChatRequest.logprobs asked
    end: TokenLogprob | None = None  # the end-of-turn token that ended it (not part of it), when logprobs asked
    # The reply's projection onto its persona's direction, per layer, normalised (0: like without the
    # system prompt, 1: like with it): "reply" (mean over the positions that generated it), "prompt"
    # (the last prompt token), "last" (the last one); with "direction" (the persona id) and "band"
    # (its default layers). Local backends given directions only.
    activation: dict[str, Any] | None = None
    # `when-drifting`'s decision for this reply: {"r", "pi_ratio" (pi_t / pi_1), "steered"}; by projection
    # {"r", "by", "projection_first", "projection", "projection_ratio", "steered"} (local backends).
    gate: dict[str, Any] | None = None
    distributions: Distributions | None = None  # when ChatRequest.distributions asked (local backends)


@dataclass(frozen=True)
class ChatRequest:
    """One batch of work for a backend: what to continue, how, and under which interventions.

    A row is a conversation or, for local backends only, a prompt already rendered to tokens
    (`Rendered`, e.g. raw text from `driftlab.chat.text.encode`), continued as it stands.

    `seeds[i]` is row i's own random stream (default: i). `cache_store[i]` is a hint that
    row i's KV is worth keeping because a later prompt extends it (dialog turns, not probe
    replies); backends without a prefix cache ignore it. `logprobs=k` asks for each generated
    token's log-probability and its k most likely alternatives (None: none). `on_token(row, id)`
    is called with each token as it is sampled (streaming; local backends only).
    `cancelled(row)` is asked once per decode step for each unfinished row: True stops that
    row there (finish_reason "cancelled"), so a server drops a request whose client left
    without waiting for the batch to end (local backends only). `row_max_tokens[i]` lowers
    row i's token limit below `sampling.max_new_tokens`, so requests that differ only in
    their limit share a batch (local backends only; others use `sampling`'s). `on_finish(row,
    reply)` receives a row's reply as soon as that row is done, while longer rows of its
    batch still decode (local backends, without pi tracing; the returned list has it too). `on_logprob(row, entry)` receives each
    generated token's log-prob entry (with `logprobs`) just before `on_token` sees the token
    (streamed log-probs; local backends only). `admit()`, asked between decode steps, returns
    more rows to decode in the running batch (continuous batching; local backends, dynamic
    cache only, where the batch allows it: see `HFChatBackend.generate`): a request of the same
    sampling (but for its token limits), interventions and log-probs, whose rows are numbered
    after those before it in every callback above; None or an empty request when none wait.
    """

    conversations: Sequence[Conversation | Rendered]
    sampling: Sampling = Sampling()
    seeds: Sequence[int] | None = None
    interventions: Interventions = Interventions()
    cache_store: Sequence[bool] | None = None
    logprobs: int | None = None
    on_token: Callable[[int, int], None] | None = None
    cancelled: Callable[[int], bool] | None = None
    row_max_tokens: Sequence[int] | None = None
    on_finish: Callable[[int, Reply], None] | None = None
    on_logprob: Callable[[int, TokenLogprob], None] | None = None
    admit: Callable[[], ChatRequest | None] | None = None
    distributions: bool = False

    def __post_init__(self) -> None:
        n = len(self.conversations)
        for i, conv in enumerate(self.conversations):
            if not isinstance(conv, Rendered):
                validate_conversation(conv, i)
        for limit in self.row_max_tokens or ():
            if not 1 <= limit <= self.sampling.max_new_tokens:
                raise DriftlabError(f"A row's token limit {limit} is outside [1, {self.sampling.max_new_tokens}].")
        for name in ("seeds", "cache_store", "row_max_tokens"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise DriftlabError(f"{len(value)} {name} given for {n} conversations.")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise DriftlabError(f"logprobs={self.logprobs}: ask for 0 to 20 alternatives per token.")
        for s in self.seeds or ():
            if not 0 <= int(s) <= MAX_SEED:
                raise DriftlabError(f"Seed {s} is outside [0, 2^63 - 1].", hint="Use a non-negative 63-bit seed.")

    def local_only(self) -> list[str]:
        """The fields set here that only a local backend honours (streaming and serving hooks)."""
        fields = [n for n in ("on_token", "cancelled", "on_finish", "row_max_tokens", "on_logprob", "admit")
                  if getattr(self, n) is not None]
        return fields + (["rendered prompts"] if any(isinstance(c, Rendered) for c in self.conversations) else [])

    def row_seeds(self) -> list[int]:
        return [int(s) for s in self.seeds] if self.seeds is not None else list(range(len(self.conversations)))


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so protocols ask instead of sniffing attributes.

    `interventions`: the intervention kinds it applies (see driftlab.steering.KINDS);
    `loglikelihood`: it can score continuations (MMLU, PASTA evaluation);
    `tokens`: it is a `TokenBackend` (a local model whose tokens protocols may see);
    `prompt_scores`: it scores every token of a prompt (`chat.text.score`: /v1/completions with echo);
    `distributions`: it gives whole next-token distributions at a prompt's last positions
    (`prompt_logprobs`: what the KLs compare).
    """

    interventions: frozenset[str] = frozenset()
    loglikelihood: bool = False
    tokens: bool = False
    prompt_scores: bool = False
    distributions: bool = False

    def require(self, backend_name: str, interventions: Interventions) -> None:
        """Refuse, in one line, interventions this backend cannot apply."""
        missing = sorted(interventions.kinds - self.interventions)
        if missing:
            works = ", ".join(sorted(self.interventions)) or "none"
            raise DriftlabError(
                f"{backend_name} cannot apply --steer {', '.join(missing)}.",
                hint=f"Interventions this backend supports: {works}. Attention interventions need a local model.",
            )


@runtime_checkable
class ChatBackend(Protocol):
    """Anything that can continue a batch of conversations (local model, HTTP server, ...)."""

    name: str
    capabilities: Capabilities

    def generate(self, request: ChatRequest) -> list[Reply]:
        """Generate the next assistant turn of every conversation of the request."""
        ...

    def describe(self) -> dict[str, Any]:
        """What to record about the model in a manifest (name, path, dtype, device, ...)."""
        ...


@runtime_checkable
class ScoringBackend(ChatBackend, Protocol):
    """A backend that can also score continuations by log-likelihood."""

    def loglikelihood(
        self,
        contexts: Sequence[Conversation],
        continuations: Sequence[str],
        interventions: Interventions = Interventions(),
    ) -> list[LogLikelihood]:
        ...


@dataclass(frozen=True)
class LogLikelihood:
    """log p(continuation | context): summed over its tokens, and whether greedy decoding gives it."""

    logprob: float
    n_tokens: int
    is_greedy: bool


def chat(
    backend: ChatBackend,
    conversations: Sequence[Conversation],
    sampling: Sampling = Sampling(),
    *,
    seeds: Sequence[int] | None = None,
    steer: Interventions | Sequence[str] | None = None,
) -> list[Reply]:
    """Convenience for scripts: build the ChatRequest (parsing `--steer`-style specs) and run it."""
    interventions = steer if isinstance(steer, Interventions) else Interventions.parse(steer)
    backend.capabilities.require(backend.name, interventions)
    return backend.generate(ChatRequest(conversations, sampling, seeds, interventions))


# -- the token level --------------------------------------------------------------------------
@dataclass(frozen=True)
class Rendered:
    """A conversation as the model's tokens, with the named token ranges interventions refer to."""

    ids: list[int]
    text: str
    system_span: tuple[int, int] | None  # [start, end) token positions, None without system message
    emphasis: tuple[tuple[int, int], ...] = ()  # token ranges a user emphasised (PASTA)
    first_turn: int | None = None  # token index of the first turn's last prompt token (pi-floor's reference)

    def without_system(self) -> Rendered:
        """The prompt without its system span's tokens: classifier-free guidance's other row."""
        if self.system_span is None:
            raise DriftlabError("cfg needs the system span of a raw prompt, and this prompt has none.",
                                hint="Name it (a character range or a marker), or render a chat prompt with a "
                                     "system message.")
        a, b = self.system_span
        return Rendered(ids=self.ids[:a] + self.ids[b:], text=self.text, system_span=None)  # no first turn either

    def spans(self) -> dict[str, list[tuple[int, int]]]:
        """Named token ranges for the attention engine: "system" and "emphasis" where present."""
        out: dict[str, list[tuple[int, int]]] = {}
        if self.system_span:
            out["system"] = [self.system_span]
        if self.emphasis:
            out["emphasis"] = list(self.emphasis)
        if self.first_turn is not None:
            out["first_turn"] = [(0, self.first_turn + 1)]
        return out


@dataclass(frozen=True)
class ModelShape:
    """What a protocol may know of a local model's architecture."""

    layers: int
    heads: int  # query heads per layer
    kv_heads: int
    max_context: int | None = None  # positions the model was trained for (None: unknown)
    layer_types: tuple[str, ...] = ()  # e.g. "full_attention" / "sliding_attention" per layer, where declared
    sliding_window: int | None = None
    vocab_size: int | None = None  # rows of the output logits (None: unknown)

    @property
    def sliding_layers(self) -> int:
        return sum(t == "sliding_attention" for t in self.layer_types)


def model_shape(config) -> ModelShape:
    """The shape of a model from its transformers config (every local engine reads the same one)."""
    text = config.get_text_config()
    return ModelShape(
        layers=text.num_hidden_layers, heads=text.num_attention_heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        max_context=getattr(config, "max_position_embeddings", None),
        layer_types=tuple(getattr(text, "layer_types", None) or ()),
        sliding_window=getattr(text, "sliding_window", None),
        vocab_size=getattr(text, "vocab_size", None),
    )


def scored_pairs(backend: Any, contexts: Sequence[Conversation], continuations: Sequence[str],
                 interventions: Interventions) -> list[tuple[Conversation, Rendered, list[int]]]:
    """Each (context, continuation) pair a `loglikelihood` scores, as every engine reads it: the context
    as the model sees it (`model_view`), rendered with the generation prompt, and the continuation's
    token ids. One-line errors, before any pass, for an invalid conversation or an empty continuation."""
    out = []
    for i, (conv, cont) in enumerate(zip(contexts, continuations, strict=True)):
        validate_conversation(conv, i)
        view = interventions.model_view(conv)
        cont_ids = backend.renderer.encode(cont)
        if not cont_ids:
            raise DriftlabError(f"Continuation {i} ({cont!r}) encodes to no tokens.")
        out.append((view, backend.render(view, interventions=interventions), cont_ids))
    return out


def without_system(conversation: Conversation) -> Conversation:
    """The unconditional conversation of CFG: the system prompt emptied, its repeated copies (SPR) removed.

    Emptied, not dropped: without a system message some chat templates insert their own
    default (Qwen2.5's "You are Qwen, created by Alibaba Cloud...", SmolLM2's "You are a
    helpful AI assistant named SmolLM..."), and guidance would then contrast the persona
    with the template's default persona instead of with no instruction at all. The
    empty-user ablation keeps an empty system message for the same reason. A conversation
    without a system message is its own unconditional version.
    """
    rest = [m for m in conversation if m["role"] != "system"]
    if len(rest) == len(conversation):
        return rest
    return [{"role": "system", "content": ""}, *rest]


def system_of(conversation: Conversation | Rendered) -> str | None:
    """The system prompt a conversation starts with (what picks its persona direction), else None."""
    if isinstance(conversation, Rendered) or not conversation or conversation[0]["role"] != "system":
        return None
    return conversation[0]["content"]


@runtime_checkable
class TokenBackend(ChatBackend, Protocol):
    """A local model at the level of tokens (declared by `Capabilities.tokens`)."""

    shape: ModelShape
    stop_ids: frozenset[int]  # tokens that end a reply
    stop_strings: tuple[str, ...]  # texts that end a reply (a base model's plain template)

    def render(self, conversation: Conversation, add_generation_prompt: bool = True,
               interventions: Interventions | None = None) -> Rendered:
        """The tokens the model is shown, with the system span and (for interventions acting on
        marked text) the emphasised spans, the markup removed."""
        ...

    def generate_tokens(
        self,
        prompts: Sequence[Rendered],
        sampling: Sampling,
        *,
        seeds: Sequence[int] | None = None,
        interventions: Interventions | Sequence[Interventions] = Interventions(),
        cache_store: Sequence[bool] | None = None,
        logprobs: int | None = None,
        on_token: Callable[[int, int], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
    ) -> list[Reply]:
        """Continue rendered prompts; `interventions` is one for every row or one per row (rows
        may differ in their key biases, e.g. a different head steered in each row).
        `on_token` and `cancelled` work as in `ChatRequest`."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Token ids back to text."""
        ...


def token_backend(backend: ChatBackend, purpose: str) -> TokenBackend:
    """`backend` as a TokenBackend, or a one-line error saying that `purpose` needs a local model."""
    if not backend.capabilities.tokens:
        raise DriftlabError(f"{backend.name} is not a local model; {purpose} needs its tokens.",
                            hint="Use a preset name or a local Hugging Face model directory.")
    return backend  # type: ignore[return-value]
