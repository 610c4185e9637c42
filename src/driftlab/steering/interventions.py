"""Inference-time interventions as one typed value: `Interventions`.

Each intervention is a small pydantic model that says where it acts (its `hook`):

* `conversation` — edits what the model is shown (e.g. system-prompt repetition); works
  on every backend, local or remote;
* `attention` — changes or reads attention inside the model (split-softmax, key bias,
  InstABoost, tracing); needs a backend with the driftlab attention engine;
* `logits` — mixes next-token distributions (e.g. classifier-free guidance);
* `residual` — adds to or caps the residual stream along a persona's direction (activation
  steering, capping); needs a local backend given directions (`--directions`).

`Interventions` composes several of them (one per kind), is parsed from the `--steer`
text grammar with one-line errors, prints back a normalised spec (what manifests store),
and has a `fingerprint` of whatever changes outputs (the prefix-cache key: KV computed
under an intervention is only reused under the same one). Backends declare which kinds
they support (`Capabilities`); measures never see any of this (solver/scorer split).
"""

from __future__ import annotations

import difflib
import hashlib
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from driftlab.activation.config import Layers, ResidualConfig, layers_spec, parse_layers
from driftlab.attention.config import AttentionConfig, BiasTerm, Heads, heads_spec, parse_heads
from driftlab.errors import DriftlabError
from driftlab.messages import Conversation
from driftlab.steering.emphasis import DEFAULT_MARKER
from driftlab.steering.heads import HeadSources

Hook = Literal["conversation", "attention", "logits", "residual", "gate"]
# Which keys a bias acts on: the system prompt, or the text a user marked (`*...*`).
SpanName = Literal["system", "marked"]
_ENGINE_SPAN = {"system": "system", "marked": "emphasis"}  # the rendered prompt's names of those tokens
_FINITE = Field(allow_inf_nan=False)


class BaseIntervention(BaseModel):
    """What every intervention is: a frozen, validated model with a `kind`, the hook it acts
    through, and its normalised `--steer` text (`spec`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hook: ClassVar[Hook]
    form: ClassVar[str]  # how to write it, shown in errors and --help
    changes_outputs: ClassVar[bool] = True

    def spec(self) -> str:
        """Normalised text form: every field, in declaration order (stable across runs)."""
        parts = []
        for name in type(self).model_fields:
            if name == "kind":
                continue
            value = getattr(self, name)
            if name == "heads":
                value = heads_spec(value)
            elif name == "layers":
                value = layers_spec(value)
            elif isinstance(value, bool):
                value = str(value).lower()
            parts.append(f"{name}={value}")
        return f"{self.kind}:{','.join(parts)}" if parts else self.kind

    def attention_fields(self) -> dict:
        """The AttentionConfig fields this intervention sets (attention hook only); key biases
        come as `{"biases": (BiasTerm, ...)}` and add up with the others'."""
        return {}


class _WithHeads(BaseIntervention):
    @field_validator("heads", mode="before", check_fields=False)
    @classmethod
    def _parse_heads(cls, v):
        return parse_heads(v) if isinstance(v, str) or v is None else tuple(tuple(x) for x in v)


class SplitSoftmax(_WithHeads):
    """Split-softmax (persona-drift paper Eq. 6-7): the system prompt keeps pi^k of the attention mass."""

    kind: Literal["split-softmax"] = "split-softmax"
    k: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    heads: Heads = None
    hook: ClassVar[Hook] = "attention"
    form: ClassVar[str] = "split-softmax:k=0.9[,heads=0-5+7.2]"

    def attention_fields(self) -> dict:
        return {"split_k": self.k, "split_heads": self.heads}


class KeyBias(_WithHeads):
    """An additive logit bias on the keys of a span (or on every other key with `invert`)."""

    kind: Literal["bias"] = "bias"
    value: Annotated[float, _FINITE]
    span: SpanName = "system"
    invert: bool = False
    heads: Heads = None
    hook: ClassVar[Hook] = "attention"
    form: ClassVar[str] = "bias:value=2.0[,span=system|marked][,invert=true][,heads=3+5.1]"

    def attention_fields(self) -> dict:
        term = BiasTerm(value=self.value, span=_ENGINE_SPAN[self.span], invert=self.invert, heads=self.heads)
        return {"biases": (term,)}


class InstABoost(BaseIntervention):
    """InstABoost (Guardieiro et al., 2025): multiply the attention weights of the instruction
    (system) keys by m in every layer and head and renormalise, i.e. add log m to their logits."""

    kind: Literal["instaboost"] = "instaboost"
    m: Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
    hook: ClassVar[Hook] = "attention"
    form: ClassVar[str] = "instaboost:m=5"

    def attention_fields(self) -> dict:
        return {"biases": (BiasTerm(value=math.log(self.m), span="system"),)}


class Pasta(_WithHeads):
    """PASTA (Zhang et al., ICLR 2024, Eq. 2): on the selected heads, attention to every key outside the
    emphasised tokens is scaled by alpha and renormalised, i.e. log(alpha) is added to those
    keys' logits; other heads are untouched.

    `span=marked` emphasises what the user marked (`*...*`, or explicit character spans),
    `span=system` the system prompt. `scope=prompt` scales only the prompt's keys, as the
    authors' pastalib does (its mask edit stops at the input length), so the tokens a reply
    generates are never scaled; `scope=all` scales generated keys too, Eq. 2 read literally.
    `heads` is a head selection (`3.1+5.2`), a pastalib head config file, or a profile file
    with `topk=K` (from `driftlab pasta profile`), or the name of a head set registered in the
    parse's `HeadSources` (a server's `--heads NAME=PATH`); files are read once, and the
    manifest records the heads themselves. Specs from requests may name no file.
    """

    kind: Literal["pasta"] = "pasta"
    alpha: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 0.01
    heads: Heads
    span: SpanName = "marked"
    scope: Literal["prompt", "all"] = "prompt"
    marker: str = "*"
    hook: ClassVar[Hook] = "attention"
    form: ClassVar[str] = "pasta:heads=FILE.json|3.1+5.2[,topk=K][,alpha=0.01][,span=marked|system][,scope=prompt|all]"

    @model_validator(mode="before")
    @classmethod
    def _heads_from_source(cls, data, info: ValidationInfo):
        """heads=NAME or heads=FILE: the heads themselves, from where `HeadSources` allows."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        topk = data.pop("topk", None)
        heads = data.get("heads")
        sources = (info.context or {}).get("heads") or HeadSources()
        found = sources.resolve(heads, _positive_int(topk, "topk") if topk is not None else None) \
            if isinstance(heads, str) else None
        if found is not None:
            data["heads"] = found
        elif topk is not None:
            raise ValueError("give heads=PROFILE.json with topk (topk picks heads from a profile file)")
        return data

    @field_validator("marker")
    @classmethod
    def _marker(cls, v: str) -> str:
        from driftlab.steering.emphasis import parse_marked

        parse_marked("", v)  # validates the marker
        if any(c in v for c in ",="):
            raise ValueError("the marker cannot contain ',' or '=' (the --steer grammar uses them)")
        return v

    def attention_fields(self) -> dict:
        term = BiasTerm(value=math.log(self.alpha), span=_ENGINE_SPAN[self.span], invert=True, heads=self.heads,
                        scope=self.scope)
        return {"biases": (term,)}


def _positive_int(value, name: str) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None
    if out < 1:
        raise ValueError(f"{name} must be at least 1, got {out}")
    return out


class Trace(BaseIntervention):
    """Record pi, the attention mass on the system prompt, per layer and head (changes nothing)."""

    kind: Literal["trace"] = "trace"
    prefill: bool = False
    hook: ClassVar[Hook] = "attention"
    form: ClassVar[str] = "trace[:prefill=true]"
    changes_outputs: ClassVar[bool] = False

    def attention_fields(self) -> dict:
        return {"trace": True, "trace_prefill": self.prefill}


class SystemPromptRepetition(BaseIntervention):
    """System-prompt repetition (persona-drift paper Sec. 6.1): before each user utterance after the
    first, the system prompt is injected (as a system message) with probability p.

    Only the model sees the copies, never the user LM. A draw is a hash of (seed, the
    utterance's position, its text, the system prompt), so the same dialog prefix always gets
    the same copies: a resumed run repeats them, and earlier turns keep their KV cache.
    """

    kind: Literal["spr"] = "spr"
    p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    hook: ClassVar[Hook] = "conversation"
    form: ClassVar[str] = "spr:p=0.5[,seed=0]"

    def transform(self, conversation: Conversation) -> Conversation:
        if self.p == 0.0 or not conversation or conversation[0]["role"] != "system":
            return conversation
        system = conversation[0]
        out: Conversation = [system]
        n_user = 0
        for message in conversation[1:]:
            if message["role"] == "user":
                n_user += 1
                if n_user > 1 and self._draw(n_user, message["content"], system["content"]) < self.p:
                    out.append({"role": "system", "content": system["content"]})
            out.append(message)
        return out

    def _draw(self, index: int, text: str, system: str) -> float:
        digest = hashlib.sha256(repr((self.seed, index, text, system)).encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64


class ClassifierFreeGuidance(BaseIntervention):
    """Classifier-free guidance (persona-drift paper Eq. 5): per step, with and without the system prompt,
    log p^ = log p(w | w<t) + alpha (log p(w | w<t, s_B) - log p(w | w<t)); alpha = 1 is plain."""

    kind: Literal["cfg"] = "cfg"
    alpha: Annotated[float, Field(ge=1.0, le=100.0, allow_inf_nan=False)]
    hook: ClassVar[Hook] = "logits"
    form: ClassVar[str] = "cfg:alpha=1.5"

    @property
    def active(self) -> bool:
        return self.alpha != 1.0


class _WithLayers(BaseIntervention):
    @field_validator("layers", mode="before", check_fields=False)
    @classmethod
    def _parse_layers(cls, v):
        return parse_layers(v) if isinstance(v, str) or v is None else tuple(sorted({int(x) for x in v}))

    def residual_fields(self) -> dict:
        """The ResidualConfig fields this intervention sets (residual hook only)."""
        return {}


class ActivationVector(_WithLayers):
    """Activation steering (persona vectors, Chen et al. 2025): at every position, add alpha times
    the row's persona direction, scaled to the mean difference it was computed from (alpha = 1
    moves a reply's mean activation from "without the system prompt" to "with it"), at `layers`
    (default: the directions' band). Needs directions (`--directions`)."""

    kind: Literal["vector"] = "vector"
    alpha: Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
    layers: Layers = None
    hook: ClassVar[Hook] = "residual"
    form: ClassVar[str] = "vector:alpha=1.0[,layers=10-14]"

    def residual_fields(self) -> dict:
        return {"alpha": self.alpha, "vector_layers": self.layers}


class Cap(_WithLayers):
    """Activation capping (the Assistant Axis paper, Lu et al. 2026): at `layers` (default: the
    directions' band), clamp the projection onto the row's persona direction from below at the
    q-quantile of its with-prompt projections, or with q=file at the thresholds imported with the
    direction (the Assistant Axis's capping config); the part orthogonal to the direction is
    untouched. Needs directions (`--directions`)."""

    kind: Literal["cap"] = "cap"
    q: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | Literal["file"]
    layers: Layers = None
    hook: ClassVar[Hook] = "residual"
    form: ClassVar[str] = "cap:q=0.25|file[,layers=10-14]"

    def residual_fields(self) -> dict:
        return {"cap_q": self.q, "cap_layers": self.layers}


class PiFloor(BaseIntervention):
    """pi floor: at every layer, head and query after the first turn, the system prompt keeps at
    least f times the attention mass pi_1 it had at the first turn's last prompt token (by the
    split-softmax rescaling, exact); where it has more, nothing changes."""

    kind: Literal["pi-floor"] = "pi-floor"
    f: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
    hook: ClassVar[Hook] = "attention"
    form: ClassVar[str] = "pi-floor:f=0.8"

    def attention_fields(self) -> dict:
        return {"pi_floor": self.f}


class WhenDrifting(BaseIntervention):
    """Adaptive control: the other steers act on a conversation's next reply only once it drifts,
    that is once its signal at the reply's first token has fallen below r times its first turn's.
    `by=pi` (the default): pi, the attention mass on the system prompt (mean over layers and
    heads, plain attention). `by=projection`: the residual stream's normalised projection onto
    the persona's direction (mean over the direction's band; needs directions), the signal of
    persona vectors and the Assistant Axis. Otherwise the reply is plain (traced if trace is
    asked). Decided per conversation and turn from the conversation alone, so a server stays
    stateless; costs one prefill a turn. Why: a steer costs task accuracy where it acts, and a
    conversation that has not drifted (a first turn, an MMLU question) needs none.

    `by=score`: the reply is steered where the dialog's previous agent turn scored below r by its
    persona's measure, i.e. the turn after a failing one. The best warning on real user turns is
    the turn's own compliance (a failure persists: docs/measures.md), and it costs nothing to read.
    Only a replay scores every agent turn, so only `driftlab replay` decides it (before each batch,
    `gate.score_decision`); it can then gate every steer, SPR and CFG included."""

    kind: Literal["when-drifting"] = "when-drifting"
    r: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
    by: Literal["pi", "projection", "score"] = "pi"
    hook: ClassVar[Hook] = "gate"
    form: ClassVar[str] = "when-drifting:r=0.9[,by=pi|projection|score]"

    def spec(self) -> str:
        """Without `by=pi`, the default: a gate's spec (in manifests, records and sweeps) reads as
        it did before `by` existed, so older runs resume and compare."""
        return super().spec().removesuffix(",by=pi")
    #: Kinds it cannot gate per conversation: CFG's twin rows and SPR's edit are batch-wide.
    ungateable: ClassVar[frozenset[str]] = frozenset({"cfg", "spr"})


#: The built-in kinds as one type (for annotations); `KINDS` also holds those of plugins.
Intervention = Annotated[
    SplitSoftmax | KeyBias | InstABoost | Pasta | Trace | SystemPromptRepetition | ClassifierFreeGuidance
    | ActivationVector | Cap | PiFloor | WhenDrifting,
    Field(discriminator="kind"),
]
KINDS: dict[str, type[BaseIntervention]] = {
    c.model_fields["kind"].default: c
    for c in (SplitSoftmax, KeyBias, InstABoost, Pasta, Trace, SystemPromptRepetition, ClassifierFreeGuidance,
              ActivationVector, Cap, PiFloor, WhenDrifting)
}
_BUILTIN = frozenset(KINDS)
#: Hooks a plugin may act through: `attention` (its `attention_fields`, e.g. key biases, compiled
#: with the others'), `conversation` (its `transform`). `logits` is driftlab's own decode loop's.
PLUGIN_HOOKS = ("attention", "conversation")


def register_intervention(cls: type[BaseIntervention]) -> type[BaseIntervention]:
    """Make an intervention class known by its `kind` (what a plugin's entry point names)."""
    field = cls.model_fields.get("kind") if isinstance(cls, type) and issubclass(cls, BaseIntervention) else None
    kind = field.default if field is not None else None
    if not isinstance(kind, str) or not re.fullmatch(r"[a-z][a-z0-9-]*", kind):
        raise DriftlabError(f"{cls!r} is not an intervention: it needs to subclass BaseIntervention with "
                            "`kind: Literal['my-kind'] = 'my-kind'`.", hint="See docs/architecture.md, plugins.")
    if kind in _BUILTIN or KINDS.get(kind, cls) is not cls:
        raise DriftlabError(f"Two interventions are named {kind!r}.", hint="Rename the plugin's kind.")
    if getattr(cls, "hook", None) not in PLUGIN_HOOKS:
        raise DriftlabError(f"Intervention {kind!r} acts through hook {getattr(cls, 'hook', None)!r}; a plugin "
                            f"acts through {' or '.join(PLUGIN_HOOKS)}.", hint="Set `hook: ClassVar[Hook] = 'attention'`.")
    KINDS[kind] = cls
    return cls


def plugin_interventions() -> list[str]:
    """Register the interventions other packages declare (entry points `driftlab.interventions`)."""
    from driftlab.plugins import load

    found = load("driftlab.interventions")
    for cls in found.values():
        if cls not in KINDS.values():
            register_intervention(cls)
    return sorted(k for k in KINDS if k not in _BUILTIN)


def _typed(item: Any) -> BaseIntervention:
    """An intervention from a dict `{"kind": ..., ...}` (or one already built), by its kind's class."""
    if isinstance(item, BaseIntervention):
        return item
    kind = item.get("kind") if isinstance(item, dict) else None
    if kind not in KINDS:
        plugin_interventions()
    if kind not in KINDS:
        raise ValueError(f"unknown intervention kind {kind!r}; known: {', '.join(KINDS)}")
    return KINDS[kind].model_validate(item)


class Interventions(BaseModel):
    """A composition of interventions, at most one of each kind (order does not matter)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    items: tuple[SerializeAsAny[BaseIntervention], ...] = ()

    @field_validator("items", mode="before")
    @classmethod
    def _by_kind(cls, items: Any) -> Any:
        return tuple(_typed(i) for i in items) if isinstance(items, list | tuple) else items

    @model_validator(mode="after")
    def _compatible(self) -> Interventions:
        kinds = [i.kind for i in self.items]
        for kind in sorted(set(kinds)):
            if kinds.count(kind) > 1:
                raise ValueError(f"--steer {kind} is given {kinds.count(kind)} times; give it once")
        if "when-drifting" in kinds:
            by_score = next(i for i in self.items if i.kind == "when-drifting").by == "score"
            clash = [] if by_score else sorted(WhenDrifting.ungateable & set(kinds))
            if clash:
                raise ValueError(f"--steer when-drifting decides per conversation, and {clash[0]} acts on the whole "
                                 "batch; gate split-softmax, instaboost, pasta, bias, pi-floor, vector or cap "
                                 "(a replay's when-drifting:by=score gates any steer)")
            if not set(kinds) - {"when-drifting"}:  # with trace alone it is a monitor: it reads, steers nothing
                raise ValueError("--steer when-drifting gates the other steers, and none is given; add one, "
                                 "e.g. --steer split-softmax:k=0.5 (or --steer trace: a monitor that records "
                                 "its reading at every reply and steers none)")
        # Key biases (bias, instaboost, pasta) compose: the engine adds them up.
        # Canonical order, so equal compositions compare (and fingerprint) equal.
        object.__setattr__(self, "items", tuple(sorted(self.items, key=lambda i: i.kind)))
        return self

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def parse(cls, specs: Sequence[str] | None, heads: HeadSources | None = None) -> Interventions:
        """Read `--steer` specs (`NAME[:key=value,...]`), each validated with a one-line error.

        `heads` says where `pasta:heads=` may take head sets from (default: files, as on the
        command line); a server parses requests with files refused.
        """
        return cls.of(*(_parse_one(s, heads) for s in specs or []))

    @classmethod
    def of(cls, *items: BaseIntervention) -> Interventions:
        """Compose interventions built in code, e.g. `Interventions.of(SplitSoftmax(k=0.8), Trace())`."""
        try:
            return cls(items=tuple(items))
        except ValidationError as err:
            raise DriftlabError(_first_error(err)) from None

    # -- what backends and protocols ask ---------------------------------------------------
    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(i.kind for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def by_hook(self, hook: Hook) -> tuple[BaseIntervention, ...]:
        return tuple(i for i in self.items if i.hook == hook)

    def specs(self) -> list[str]:
        """Normalised specs (recorded in manifests; `Interventions.parse(x.specs()) == x`)."""
        return [i.spec() for i in self.items]

    def fingerprint(self) -> str:
        """Identity of everything that changes outputs ('' = plain model): the prefix-cache key."""
        return ";".join(i.spec() for i in self.items if i.changes_outputs)

    def attention(self) -> AttentionConfig | None:
        """The attention engine's per-call config, or None when no attention hook is set."""
        fields: dict = {}
        items = self.by_hook("attention")
        for item in items:
            part = dict(item.attention_fields())
            part["biases"] = fields.get("biases", ()) + part.get("biases", ())
            fields.update(part)
        return AttentionConfig(**fields) if items else None

    def tracing(self) -> tuple[bool]:
        """The tracing setting every row of a batch must share (`AttentionConfig.shared`: whether
        prompts are traced); decode-step tracing is per row."""
        config = self.attention()
        return config.shared() if config is not None else (False,)

    def residual(self) -> ResidualConfig | None:
        """What the residual-stream steers ask (vector, cap), or None when none is set."""
        items = self.by_hook("residual")
        fields: dict = {}
        for item in items:
            fields.update(item.residual_fields())
        return ResidualConfig(**fields) if items else None

    def get(self, kind: str) -> BaseIntervention | None:
        return next((i for i in self.items if i.kind == kind), None)

    def model_view(self, conversation: Conversation) -> Conversation:
        """What the model is shown: the conversation after every conversation-hook edit."""
        for item in self.by_hook("conversation"):
            conversation = item.transform(conversation)
        return conversation

    def guidance(self) -> float | None:
        """CFG's alpha when guidance changes anything, else None."""
        cfg = self.get("cfg")
        return cfg.alpha if cfg is not None and cfg.active else None

    def emphasis_marker(self) -> str | None:
        """The marker of user emphasis when a key bias acts on marked text (PASTA's own marker,
        else '*'), else None: then the backend turns the markup into emphasis spans."""
        marked = [i for i in self.items if getattr(i, "span", None) == "marked"]
        if not marked:
            return None
        return next((i.marker for i in marked if i.kind == "pasta"), DEFAULT_MARKER)

    def for_dialogs(self) -> Interventions:
        """These interventions, checked for protocols whose messages are model text (self-chat,
        MMLU histories): there a stray '*' is no user's emphasis, so a key bias must act on the
        system prompt, not on marked text."""
        for item in self.items:
            if getattr(item, "span", None) == "marked":
                raise DriftlabError(
                    f"{item.kind} with span=marked reads *markup* in messages, but a dialog's messages are model text.",
                    hint=f"Use --steer {item.kind}:...,span=system to act on the system prompt in dialogs.",
                )
        return self

    def without(self, *kinds: str) -> Interventions:
        return Interventions(items=tuple(i for i in self.items if i.kind not in kinds))

    def gated(self) -> tuple[WhenDrifting, Interventions, Interventions] | None:
        """`when-drifting` (its r and signal), the steer a drifting conversation gets and the one
        any other gets (its trace only); None without a gate."""
        gate = self.get("when-drifting")
        if gate is None:
            return None
        return gate, self.without("when-drifting"), Interventions(
            items=tuple(i for i in self.items if i.kind == "trace"))


def _parse_one(spec: str, heads: HeadSources | None = None) -> BaseIntervention:
    name, _, body = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in KINDS:
        plugin_interventions()  # another package's kind, declared through an entry point
    if name not in KINDS:
        raise DriftlabError(
            f"Unknown intervention '{name}' in --steer {spec!r}{did_you_mean(name, KINDS)}.",
            hint="Known: " + "; ".join(c.form for c in KINDS.values()),
        )
    form = KINDS[name].form
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or not key or not value.strip():
            raise DriftlabError(f"Cannot read '{part}' in --steer {spec!r}.", hint=f"Write it as {form}.")
        if key == "kind" or key in fields:
            raise DriftlabError(f"--steer {spec!r} sets '{key}' twice." if key in fields else
                                f"--steer {spec!r}: 'kind' is not a setting.", hint=f"Write it as {form}.")
        fields[key] = value.strip()
    try:
        return KINDS[name].model_validate({"kind": name, **fields}, context={"heads": heads})
    except ValidationError as err:
        raise DriftlabError(f"--steer {spec!r}: {_first_error(err, fields, KINDS[name])}",
                            hint=f"Write it as {form}.") from None


def did_you_mean(given: Any, choices: Sequence[str] | dict) -> str:
    """" (did you mean 'x'?)" for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(str(given), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def literal_choices(error: dict) -> list[str]:
    """The allowed values of a pydantic `literal_error` ("'a', 'b' or 'c'" -> [a, b, c])."""
    return re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))


def _first_error(err: ValidationError, given: dict[str, str] | None = None,
                 kind: type[BaseIntervention] | None = None) -> str:
    # A misspelt setting also leaves its real name missing: name the misspelling first.
    e = min(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    key = next((str(p) for p in reversed(e["loc"]) if isinstance(p, str) and p in (given or {})), None)
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        kind = kind or KINDS.get(str(e["loc"][0]))  # a discriminated union's errors start at the kind
        settings = [f for f in kind.model_fields if f != "kind"] if kind else []
        return f"unknown setting '{e['loc'][-1]}'{did_you_mean(e['loc'][-1], settings)}."
    if e["type"] == "missing":
        return f"'{e['loc'][-1]}' is required."
    if e["type"] == "literal_error":
        choices = literal_choices(e)
        msg = f"not one of {', '.join(choices)}{did_you_mean(e['input'], choices)}"
    if key is not None:
        return f"{key}={given[key]}: {msg[0].lower() + msg[1:]}."
    return msg[0].upper() + msg[1:] + "."


# -- as config fields -----------------------------------------------------------------------------
def _as_interventions(value: Any) -> Interventions:
    """Interventions from what a config is given: specs, intervention objects, or Interventions."""
    if isinstance(value, Interventions):
        return value
    if value is None:
        return Interventions()
    if isinstance(value, str | BaseIntervention):
        value = [value]
    return Interventions.of(*(_parse_one(v) if isinstance(v, str) else v for v in value))


def _as_intervention(value: Any) -> BaseIntervention:
    return _parse_one(value) if isinstance(value, str) else _typed(value)


_SPECS = WithJsonSchema({"type": "array", "items": {"type": "string"}})
#: A config field holding interventions: validated from `--steer` specs (or objects), stored as
#: the normalised specs, so a manifest reads `"steer": ["split-softmax:k=0.9,heads=all"]`.
Steer = Annotated[Interventions, BeforeValidator(_as_interventions),
                  PlainSerializer(lambda iv: iv.specs(), return_type=list[str]), _SPECS]
#: The same, for protocols whose messages are model text (see `Interventions.for_dialogs`).
DialogSteer = Annotated[Steer, AfterValidator(lambda iv: iv.for_dialogs())]
#: One intervention as a config field (a sweep's grid point), stored as its spec.
OneSteer = Annotated[SerializeAsAny[BaseIntervention], BeforeValidator(_as_intervention),
                     PlainSerializer(lambda i: i.spec(), return_type=str), WithJsonSchema({"type": "string"})]
