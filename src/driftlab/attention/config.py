"""What the attention engine is asked to do, as data: head selections and AttentionConfig.

No torch here, so parsing `--steer` and validating configs stays cheap; the per-call
tensors live in `driftlab.attention.state`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from driftlab.errors import DriftlabError

Span = tuple[int, int]
# (layer, head) pairs; head None = every head of that layer. None instead of a tuple = everywhere.
Heads = tuple[tuple[int, int | None], ...] | None


def parse_heads(spec: str | None) -> Heads:
    """Parse a head selection: 'all', '3' (layer 3), '3.1' (layer 3 head 1), '0-5', '2.0,7.3'.

    Parts may also be joined with '+' ('0-5+7.2'), the form `--steer` documents, since ','
    separates its keys there.
    """
    if spec is None or spec.strip().lower() in ("", "all", "*"):
        return None
    out: list[tuple[int, int | None]] = []
    for part in re.split(r"[,+\s;]+", spec.strip()):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?(?:\.(\d+))?", part)
        if not m:
            raise DriftlabError(
                f"Cannot read head selection '{part}'.",
                hint="Use 'all', a layer '3', a layer range '0-5', or layer.head pairs like '3.1+7.0'.",
            )
        lo, hi, head = int(m[1]), int(m[2] or m[1]), m[3]
        if hi < lo:
            raise DriftlabError(f"Layer range '{part}' is empty.", hint="Write ranges low-high, e.g. '0-5'.")
        out.extend((layer, int(head) if head is not None else None) for layer in range(lo, hi + 1))
    return tuple(out)


def heads_spec(heads: Heads) -> str:
    """The text form of a head selection that `parse_heads` reads back ('all', '3+5.1')."""
    if heads is None:
        return "all"
    return "+".join(f"{layer}" if head is None else f"{layer}.{head}" for layer, head in heads)


EngineSpan = Literal["system", "emphasis"]  # the named token ranges a rendered prompt carries


class BiasTerm(BaseModel):
    """One additive key bias: `value` on the logits of the `span` keys (every other key with
    `invert`) on `heads`. With `scope="prompt"` only the prompt's keys are biased, never the
    keys of generated tokens (pastalib's behaviour). A row without the span is left alone."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    value: float = Field(allow_inf_nan=False)
    span: EngineSpan = "system"
    invert: bool = False
    heads: Heads = None
    scope: Literal["all", "prompt"] = "all"

    @field_validator("heads", mode="before")
    @classmethod
    def _parse_heads(cls, v):
        return _heads(v)


class AttentionConfig(BaseModel):
    """What the attention engine does on one call (compiled from `Interventions`).

    * `split_k` < 1 turns on split-softmax (persona-drift paper Eq. 6-7) on `split_heads`.
    * `biases` are additive key biases (`BiasTerm`), summed: InstABoost boosts the
      instruction keys everywhere; PASTA adds log(alpha) to the non-emphasised keys on
      profiled heads; `bias` adds any value; several compose.
    * `trace` records pi, the attention mass on the system keys, per layer and head.
    * `pi_floor` F > 0 turns on pi-floor: from a row's first floor query on, the system keys get
      at least a floor of the attention (per layer and head; the backend sets it to F times pi at
      the first turn's generation prompt, `AttentionState.set_floors`), and are left alone where
      they already get more. It may differ per row.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    trace: bool = False
    trace_prefill: bool = False
    split_k: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    split_heads: Heads = None
    biases: tuple[BiasTerm, ...] = ()
    pi_floor: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)

    @field_validator("split_heads", mode="before")
    @classmethod
    def _parse_heads(cls, v):
        return _heads(v)

    @field_validator("biases")
    @classmethod
    def _nonzero(cls, v: tuple[BiasTerm, ...]) -> tuple[BiasTerm, ...]:
        return tuple(t for t in v if t.value != 0.0)  # a zero bias is the plain model

    @property
    def splits(self) -> bool:
        return self.split_k != 1.0

    @property
    def biased(self) -> bool:
        return bool(self.biases)

    @property
    def floors(self) -> bool:
        return self.pi_floor > 0

    @property
    def boosts_system(self) -> bool:
        """Every key bias acts on the system keys alone (InstABoost, `bias` on the system span): it moves
        the system prompt's share of attention and nothing else (`attention.kernels.boost_keys`)."""
        return all(t.span == "system" and not t.invert for t in self.biases)

    @property
    def spares_one_span(self) -> bool:
        """One key bias, on every key but a span's (PASTA): against the rest, it lifts the keys it spares
        (the span, and with `scope="prompt"` the reply's keys too) by minus its value, and does nothing
        else (`attention.kernels.boost_keys`)."""
        return len(self.biases) == 1 and self.biases[0].invert

    @property
    def prompt_scoped(self) -> bool:
        """Some bias spares generated keys: their KV differs from the same tokens' KV as prompt."""
        return any(t.scope == "prompt" for t in self.biases)

    @property
    def changes_outputs(self) -> bool:
        """True if hidden states differ from the plain model (tracing alone does not)."""
        return self.splits or self.biased or self.floors

    @property
    def active(self) -> bool:
        return self.trace or self.changes_outputs

    def shared(self) -> tuple:
        """What every row of one batch must agree on: prefill tracing, whose traces are laid out per
        batch position. Key biases, split-softmax, the pi floor and decode-step tracing may differ
        per row."""
        return (self.trace and self.trace_prefill,)


def _heads(v):
    return parse_heads(v) if isinstance(v, str) or v is None else tuple(tuple(x) for x in v)
