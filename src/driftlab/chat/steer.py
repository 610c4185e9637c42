"""`steer()`: driftlab's attention interventions on your own `model.generate(...)` and `model(...)`.

Why: many users already have a generation pipeline (transformers' `generate`, a sampler of
their own, an evaluation harness calling the model's forward) and want split-softmax,
InstABoost, a key bias, PASTA on the system prompt, or pi tracing inside it, without moving
to driftlab's decode loop. Those act through attention only, so they need no loop of their
own: the model's attention is switched to driftlab's (transformers'
`set_attn_implementation`), and each forward pass in the block is handed the per-row state
the attention function reads (`driftlab=AttentionState`), its layout read off the call
itself, as driftlab's own loop (`HFChatBackend._decode`) lays it out:

* a pass on an empty cache starts a sequence (a prefill): each row's left padding from the
  2-D `attention_mask`, each row's system prompt located in its tokens;
* a pass on a cache of exactly the keys the sequence has so far continues it (a decode step,
  or more tokens fed at once); its keys are the cache's length plus the query's.

With `directions`, the residual-stream steers act too (`vector:`, `cap:`): the decoder layers
get driftlab's hooks for the block, and each pass the row's state (`driftlab_residual`), the
direction that of the system prompt's text (or the file's axis).

Interventions that need driftlab's own decode loop are refused by name: system-prompt
repetition edits the conversation, classifier-free guidance mixes the logits of a second
batch, a pi floor and `when-drifting` read the first turn of a conversation, which token ids do not mark (use
`HFChatBackend.from_model(model, tokenizer)` and its generate for those).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from driftlab.activation import hooks
from driftlab.activation.state import ResidualRow, ResidualState
from driftlab.attention.config import AttentionConfig
from driftlab.attention.state import AttentionState
from driftlab.chat.attach import Attachment, describe_name
from driftlab.chat.base import ModelShape
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import BaseIntervention, Interventions

__all__ = ["Steering", "steer"]

_HEADROOM = 512  # key slots laid out past the prompt at first; more are added as a sequence grows
_MISSING = object()
_OWN_LOOP = {"conversation": "it edits the conversation the model is shown",
             "logits": "it mixes the next-token distributions of a second batch without the system prompt",
             "pi-floor": "it reads the attention of the conversation's first turn, which token ids do not mark",
             "gate": "it decides per conversation turn from the first turn's attention, which token ids do not mark"}
_OWN_LOOP_HINT = ("Use driftlab's own decoding for it: HFChatBackend.from_model(model, tokenizer) (or dl.load(...)), "
                  "then its generate/chat.")


def steer(model: Any, steer: Any, *, system: str | tuple[int, int], tokenizer: Any = None,
          directions: Any = None) -> Steering:
    """A context manager under which `model.generate(...)` and `model(...)` run with driftlab's
    attention interventions; on leaving it (also by an exception) the model is as before.

        with steer(model, "split-softmax:k=0.8", system=system_prompt, tokenizer=tok) as s:
            out = model.generate(**inputs, do_sample=False, max_new_tokens=64)

    Why: to steer or trace a pipeline you already run, token for token as driftlab's own chat
    would (same model, prompt, intervention, greedy decoding), without moving to it.

    `steer` is a spec string (`"split-softmax:k=0.8"`), an intervention object, a list of
    either, or an `Interventions`: any kind acting through attention (split-softmax,
    instaboost, bias, pasta, trace); spr and cfg need driftlab's decode loop and are refused
    by name. Key biases act on the system prompt (`span=system`): marked text has no markup
    left in token ids. `system` says which tokens are the system prompt: its text (located in
    each row of the first forward's tokens, the content's tokens as driftlab's renderer finds
    them with span mode `content`; needs `tokenizer`), or a `(start, end)` token range of the
    unpadded prompt, the same for every row. Left padding comes from the 2-D attention mask.
    With `trace`, `.traces()` gives pi per row after (or during) the block. `directions` (a
    `Directions` or its directory) lets `vector:` and `cap:` act, along the direction of the system
    prompt's text (or the file's axis).

    The model is borrowed: a second `steer()` or an `HFChatBackend.from_model` on it while
    the block runs is refused, and so is a model driftlab's attention cannot steer.
    """
    return Steering(model, steer, system=system, tokenizer=tokenizer, directions=directions)


class Steering:
    """The `steer()` block: installs driftlab's attention and the per-call state on enter,
    gives the model back on exit, and keeps each sequence's pi traces (`traces()`)."""

    def __init__(self, model: Any, steer: Any, *, system: str | tuple[int, int], tokenizer: Any = None,
                 directions: Any = None) -> None:
        self.model = model
        self.interventions = _interventions(steer)
        self.attention: AttentionConfig | None = self.interventions.attention()
        self.system = _system(system, tokenizer)
        self.residual = _residual_row(self.interventions, directions, self.system)
        self.tokenizer = tokenizer
        self.name = describe_name(model, None)
        self._attachment: Attachment | None = None
        self._own_forward: Any = _MISSING
        self._runs: list[_Run] = []
        self._used = False
        self._hooked = False

    # -- the block ------------------------------------------------------------------------------
    def __enter__(self) -> Steering:
        if self._used:
            raise DriftlabError("This steer() block was already entered once.", hint="Call steer(...) again for a new block.")
        self._used = True
        self._attachment = Attachment(self.model, "a steer() block", self.name)
        try:
            base = self._attachment.base
            text = base.config.get_text_config()
            self._shape = ModelShape(layers=text.num_hidden_layers, heads=text.num_attention_heads,
                                     kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
            if self.residual is not None:
                if self.residual.unit.shape != (text.num_hidden_layers, text.hidden_size):
                    raise DriftlabError(f"The directions are for a model of {self.residual.unit.shape[0]} layers x "
                                        f"{self.residual.unit.shape[1]}, not {self.name} ({text.num_hidden_layers} x "
                                        f"{text.hidden_size}).", hint="Compute them for this model: driftlab directions.")
                self._hooked = hooks.install(base)  # False: its owner's hooks, left in place on exit
            self._wrap(base)
        except BaseException:
            self._attachment.restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        attachment, self._attachment = self._attachment, None
        if attachment is None:
            return
        try:
            self._unwrap(attachment.base)
            if self._hooked:
                hooks.remove(attachment.base)
        finally:
            attachment.restore()

    def traces(self, run: int = -1) -> list[dict[str, torch.Tensor]]:
        """pi per row of one traced sequence (default: the last, e.g. the last generate call):
        what `AttentionState.row_traces` gives, `decode` [passes, L, H] (pi at the last query of
        each forward pass: the prefill's last prompt token, then each fed token, i.e. when
        predicting each generated token) and, with `trace:prefill=true`, `prefill` [prompt
        tokens, L, H]. Rows that stopped early in `generate` still have a pass per step.
        Empty when `trace` was not asked for. (A typed Trace is driftlab.chat.trace's business.)"""
        if not self._runs:
            return []
        return self._runs[run].traces()

    @property
    def n_runs(self) -> int:
        """How many sequences (forward passes on an empty cache) the block has seen."""
        return len(self._runs)

    # -- the model's forward, wrapped for the block ---------------------------------------------
    def _wrap(self, base: Any) -> None:
        """An instance-level forward that adds the state: `model(...)`, `generate` (which calls the
        model) and PEFT wrappers (which call their base model) all pass through it."""
        self._own_forward = base.__dict__.get("forward", _MISSING)
        original = base.forward
        names = [p.name for p in inspect.signature(original).parameters.values()
                 if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]

        @functools.wraps(original)  # keeps the signature, which generate inspects
        def forward(*args, **kwargs):
            return original(*args, **self._with_state(names, args, kwargs))

        base.forward = forward

    def _unwrap(self, base: Any) -> None:
        if self._own_forward is _MISSING:
            base.__dict__.pop("forward", None)
        else:
            base.forward = self._own_forward
        self._own_forward = _MISSING

    def _with_state(self, names: list[str], args: tuple, kwargs: dict) -> dict:
        if (self.attention is None and self.residual is None) or "driftlab" in kwargs:  # nothing to do, or a caller's
            return kwargs
        call = _Call.read(names, args, kwargs)
        run = self._runs[-1] if self._runs else None
        if call.past == 0:
            run = self._start(call)
        elif run is None or not run.extends(call):
            raise DriftlabError(
                f"A forward pass inside steer() continues a cache of {call.past} keys that this block did not build "
                f"(its last sequence has {run.kv_len if run else 0} keys, batch {len(run.pads) if run else 0}).",
                hint="Start each sequence inside the block (a generate call, or a first forward without a cache).")
        return {**kwargs, **run.step(call.past + call.q)}

    def _start(self, call: _Call) -> _Run:
        pads = call.pads()
        spans = [{"system": [self._system_span(call, b, pads[b])]} for b in range(call.batch)] \
            if self.attention is not None else []
        dtype = self._attachment.base.dtype
        residual = ResidualState([self.residual] * call.batch, self._shape.layers, self.residual.unit.shape[1],
                                 call.device, dtype) if self.residual is not None else None
        run = _Run(self.attention, spans, pads, call.q, self._shape, call.device, residual)
        self._runs.append(run)
        return run

    def _system_span(self, call: _Call, row: int, pad: int) -> tuple[int, int]:
        n = call.q - pad
        if isinstance(self.system, tuple):
            start, end = self.system
            if end > n:
                raise DriftlabError(f"system=({start}, {end}) reaches past row {row}'s prompt of {n} tokens.",
                                    hint="Give a token range inside the unpadded prompt.")
            return start, end
        if call.ids is None:
            raise DriftlabError("steer() cannot find the system prompt's text in a forward pass given inputs_embeds.",
                                hint="Give system=(start, end), its token range in the prompt.")
        found = locate(self.tokenizer, call.ids[row, pad:].tolist(), self.system)
        if found is None:
            raise DriftlabError(f"The system prompt's text was not found in the tokens of row {row} "
                                f"({self.system[:40]!r}{'...' if len(self.system) > 40 else ''}).",
                                hint="Give system=(start, end), its token range in the unpadded prompt, or the text "
                                     "exactly as the chat template writes it.")
        return found


class _Call:
    """What one forward call says about its layout: rows, query length, cache length, mask."""

    def __init__(self, ids, embeds, mask, cache) -> None:
        source = ids if ids is not None else embeds
        if source is None:
            raise DriftlabError("A forward pass inside steer() has neither input_ids nor inputs_embeds.")
        self.ids = ids
        self.batch, self.q = int(source.shape[0]), int(source.shape[1])
        self.device = source.device
        self.mask = mask
        self.past = _cache_length(cache)
        if mask is not None and mask.dim() != 2:
            raise DriftlabError(f"steer() reads each row's padding from a 2-D attention_mask; this one is "
                                f"{mask.dim()}-D.", hint="Pass the tokenizer's [batch, keys] mask of 0s and 1s.")
        if mask is not None and mask.shape[1] != self.past + self.q:
            raise DriftlabError(f"The attention_mask covers {mask.shape[1]} keys but the pass has {self.past} cached "
                                f"and {self.q} new ones.", hint="Give the mask of all keys, cached and new.")

    @classmethod
    def read(cls, names: list[str], args: tuple, kwargs: dict) -> _Call:
        def get(name: str):
            if name in kwargs:
                return kwargs[name]
            i = names.index(name) if name in names else len(args)
            return args[i] if i < len(args) else None

        return cls(get("input_ids"), get("inputs_embeds"), get("attention_mask"), get("past_key_values"))

    def pads(self) -> list[int]:
        """Each row's left padding, from a prefill's mask (none without one)."""
        if self.mask is None:
            return [0] * self.batch
        mask = self.mask.bool()
        lengths = mask.sum(-1)
        pads = (self.q - lengths).tolist()
        left = torch.arange(self.q, device=mask.device)[None, :] >= (self.q - lengths)[:, None]
        if not torch.equal(mask, left):
            raise DriftlabError("steer() needs each row's padding on the left (0s, then 1s) in the attention_mask.",
                                hint="Set tokenizer.padding_side = 'left' before tokenizing a batch for generation.")
        if any(p >= self.q for p in pads):
            raise DriftlabError("A row of the batch is all padding.", hint="Give every row at least one token.")
        return [int(p) for p in pads]


def _cache_length(cache) -> int:
    if cache is None:
        return 0
    from transformers import StaticCache

    if isinstance(cache, StaticCache) or any("Static" in type(layer).__name__ for layer in getattr(cache, "layers", ())):
        raise DriftlabError("steer() follows dynamic KV caches; this pass has a static one, whose keys are all "
                            "its slots.", hint="Generate with the default cache, or use HFChatBackend.from_model "
                                               "with decode='static'.")
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        raise DriftlabError(f"steer() cannot read the length of a {type(cache).__name__} cache.",
                            hint="Use transformers' Cache classes (DynamicCache).")
    return int(length())


class _Run:
    """One sequence of forward passes over the same rows: a prefill and the passes that extend
    its cache. Holds the AttentionState driftlab's decode loop would build for it."""

    def __init__(self, attention: AttentionConfig | None, spans: list[dict], pads: list[int], prompt_len: int,
                 shape: ModelShape, device: torch.device, residual: ResidualState | None = None) -> None:
        self.pads, self.prompt_len = pads, prompt_len
        self.slots = prompt_len + _HEADROOM
        self.state = AttentionState(attention, spans, shape.layers, shape.heads, device) if attention else None
        if self.state is not None:
            self.state.on_layout(pads, prompt_len, self.slots)
        self.residual = residual
        self.kv_len = 0
        self.calls = 0

    def extends(self, call: _Call) -> bool:
        return call.past == self.kv_len and call.batch == len(self.pads)

    def step(self, kv_len: int) -> dict[str, Any]:
        """The forward keywords of the next pass, whose keys are slots [0, kv_len): the attention
        state and the residual stream's, where the block steers them."""
        if self.state is not None and kv_len > self.slots:
            self._grow(kv_len)
        self.kv_len = kv_len
        self.calls += 1
        out = self.state.forward_kwargs(kv_len) if self.state is not None else {}
        return {**out, **(self.residual.forward_kwargs() if self.residual is not None else {})}

    def _grow(self, kv_len: int) -> None:
        """Lay the same rows out over more key slots, keeping the pi collected so far (the slots
        already laid out keep their values: the layout depends only on pads and spans)."""
        records = self.state.records
        self.slots = max(2 * self.slots, kv_len + _HEADROOM)
        self.state.on_layout(self.pads, self.prompt_len, self.slots)
        self.state.records = records

    def traces(self) -> list[dict[str, torch.Tensor]]:
        if self.state is None:
            return []
        return self.state.row_traces([self.calls] * len(self.pads), self.pads)


# -- reading the arguments ------------------------------------------------------------------------
def _interventions(value: Any) -> Interventions:
    """Interventions from a spec, an intervention, a list of either, or Interventions; only
    attention-hook kinds, and key biases on the system prompt."""
    if isinstance(value, Interventions):
        iv = value
    else:
        items = [value] if isinstance(value, str | BaseIntervention) else list(value or [])
        parsed = [Interventions.parse([i]).items[0] if isinstance(i, str) else i for i in items]
        iv = Interventions.of(*parsed)
    for item in iv.items:
        why = _OWN_LOOP.get(item.kind) or (_OWN_LOOP.get(item.hook) if item.hook not in ("attention", "residual") else None)
        if why:
            raise DriftlabError(f"steer() cannot apply {item.kind}: {why}, which needs driftlab's "
                                "own decode loop.", hint=_OWN_LOOP_HINT)
        if getattr(item, "span", None) == "marked":
            raise DriftlabError(f"steer() cannot apply {item.kind} with span=marked: marked text (*...*) has no "
                                "markup left in the token ids of your own generate.",
                                hint=f"Use {item.kind}:...,span=system, or driftlab's backend (which reads *markup*).")
    return iv


def _residual_row(iv: Interventions, directions: Any, system: str | tuple[int, int]) -> ResidualRow | None:
    """The residual stream's row for a block's steers (None: it steers none), its direction the system
    prompt's (or the file's axis); one-line errors where there is none to steer along."""
    config = iv.residual()
    if config is None:
        return None
    if directions is None:
        raise DriftlabError(f"steer() applies {', '.join(i.kind for i in iv.by_hook('residual'))} along a persona's "
                            "direction, and was given no directions.", hint="Pass directions=DIR (driftlab directions).")
    from driftlab.activation.directions import Directions

    found = directions if isinstance(directions, Directions) else Directions.load(directions)
    found.check_layers(config)
    direction = found.for_system(system if isinstance(system, str) else None)
    if direction is None:
        raise DriftlabError("The directions hold none for this system prompt" +
                            (" (given as a token range, not its text)." if not isinstance(system, str) else "."),
                            hint="Give system= as the text the directions were computed for, or directions with an axis.")
    return direction.row(config)


def _system(system: Any, tokenizer: Any) -> str | tuple[int, int]:
    if isinstance(system, str):
        if not system:
            raise DriftlabError("system= is an empty text.", hint="Give the system prompt's text or (start, end).")
        if tokenizer is None:
            raise DriftlabError("steer(system=TEXT) needs tokenizer= to find the text among the tokens.",
                                hint="Pass tokenizer=..., or give system=(start, end), its token range.")
        return system
    if isinstance(system, Sequence) and len(system) == 2 and all(isinstance(x, int) for x in system):
        start, end = int(system[0]), int(system[1])
        if not 0 <= start < end:
            raise DriftlabError(f"system=({start}, {end}) is not a token range.", hint="Give 0 <= start < end.")
        return start, end
    raise DriftlabError(f"system= must be the system prompt's text or a (start, end) token range, not {system!r}.")


def locate(tokenizer: Any, ids: list[int], content: str) -> tuple[int, int] | None:
    """[start, end) of the tokens that hold `content` in `ids` (the first occurrence), or None.

    As the renderer finds a system prompt (span mode `content`): the tokens overlapping its
    characters in the decoded text, when decoding and re-encoding gives back the same ids
    (offsets are then positions in the prompt); else the content's own tokens, as a run of ids."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    at = text.find(content)
    if at >= 0:
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
            enc = None
        if enc is not None and list(enc["input_ids"]) == list(ids):
            inside = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > at and a < at + len(content)]
            if inside:
                return inside[0], inside[-1] + 1
    for variant in (content, " " + content):
        sub = tokenizer(variant, add_special_tokens=False)["input_ids"]
        for i in range(len(ids) - len(sub) + 1):
            if sub and ids[i : i + len(sub)] == sub:
                return i, i + len(sub)
    return None
