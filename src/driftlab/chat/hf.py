"""Local Hugging Face chat backend: batched, KV-cached, seeded, with prefix reuse.

Why a hand-written decode loop instead of `model.generate`: driftlab needs per-row random
streams (reproducible regardless of batch composition), reuse of the KV cache of shared
dialog prefixes across calls, per-step access to logits (classifier-free guidance) and to
attention state (pi tracing). The loop is small: left-padded prefill, then one token per
step for every unfinished row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from driftlab.activation.state import ResidualRow, ResidualState
from driftlab.attention.state import AttentionConfig, AttentionState
from driftlab.chat import gate, teacher_forced
from driftlab.chat.base import (
    Capabilities,
    ChatRequest,
    Conversation,
    LogLikelihood,
    Rendered,
    Reply,
    Sampling,
    TokenLogprob,
    model_shape,
    system_of,
    without_system,
)
from driftlab.chat.decoding import Decoding, pad_id, reusable
from driftlab.chat.describe import describe_hf, preset_of
from driftlab.chat.directions import row_directions
from driftlab.chat.loading import input_device, load_model
from driftlab.chat.prefix_cache import PrefixCache, auto_budget
from driftlab.chat.spec import BackendSpec
from driftlab.chat.static_decode import (
    DECODE_MODES,
    DecodeMode,
    auto_decode,
    decode_facts,
    static_decoder,
    static_step,
    warm,
)
from driftlab.chat.templates import Renderer
from driftlab.chat.trace import Trace
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import KINDS, Interventions

logger = logging.getLogger(__name__)


class HFChatBackend:
    """A local chat model: a `ChatBackend`, `ScoringBackend` and `TokenBackend`.
    Thread-unsafe by design: one generate call at a time."""

    @property
    def capabilities(self) -> Capabilities:
        """Every kind in `KINDS`, a plugin's included: this backend applies any attention or
        conversation hook through the same engine and message view."""
        return Capabilities(interventions=frozenset(KINDS), loglikelihood=True, tokens=True, prompt_scores=True,
                            distributions=True)

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str = "auto",
        device: str = "auto",
        span_mode: str = "content",
        prefix_cache_bytes: int | None = None,
        attn_implementation: str | None = None,
        device_map: str | None = None,
        quantize: str | None = None,
        decode: DecodeMode = "auto",
        directions: str | None = None,
    ) -> None:
        """`decode` picks the decode loop (see driftlab.chat.static_decode): `dynamic` (a dynamic
        KV cache), `static` (a static cache, eager steps), `compiled` (a static cache and
        torch.compile'd steps: CUDA graphs on a GPU) or `auto` (`compiled` on CUDA, `dynamic`
        elsewhere). Where a static cache cannot serve the model, decoding stays dynamic, said once.
        `directions` (a `driftlab directions` output) records each reply's projection onto its
        persona's direction and lets vector and cap steers act (`use_directions`)."""
        _check_decode(decode)
        if attn_implementation is None:
            from driftlab.attention import ATTENTION_NAME

            attn_implementation = ATTENTION_NAME  # registered by load_model, after its cheap checks
        loaded, tokenizer, path = load_model(
            model, dtype, device, attn_implementation, device_map=device_map, quantize=quantize)
        self._setup(loaded, tokenizer, path, model, span_mode=span_mode, prefix_cache_bytes=prefix_cache_bytes,
                    decode=decode, device_map=device_map, quantize=quantize)
        self.use_directions(directions)

    def _setup(self, model, tokenizer, path, name: str, *, span_mode: str, prefix_cache_bytes: int | None,
               decode: DecodeMode, device_map: str | None, quantize: str | None, attachment=None) -> None:
        """What both ways in share (a model by name, a model from memory): renderer, stop
        tokens, shape, prefix cache and decode loop. `attachment` (from_model) is the borrowed
        model's installed attention, given back by `close()`."""
        self.model, self.tokenizer, self.path = model, tokenizer, path
        self.name = name
        self.device_map, self.quantize = device_map, quantize
        self._attachment = attachment
        self._closed = False
        config_model = attachment.base if attachment is not None else model  # a PEFT model's config is its base's
        self.device = input_device(self.model)
        had_template = bool(getattr(tokenizer, "chat_template", None))
        self.renderer = Renderer(self.tokenizer, span_mode)
        self._set_template = not had_template  # the plain template was set on the tokenizer: close() unsets it
        if self.renderer.plain and (attachment is not None or not preset_of(name)):
            from driftlab.console import err_console

            err_console().print(
                f"note: {name} has no chat template (a base model?): dialogs are rendered as plain text "
                "(the system prompt, then 'User:' and 'Assistant:' lines), and replies stop at the next speaker.",
                highlight=False, markup=False)
        self.eos_ids = self.renderer.eos_ids(config_model.config, config_model.generation_config)
        self.stop_ids = frozenset(self.eos_ids)
        self.stop_strings = self.renderer.stop_strings
        self.shape = model_shape(config_model.config)
        self.d_model = int(config_model.config.get_text_config(decoder=True).hidden_size)
        self.directions = None
        from driftlab.activation import hooks

        hooks.install(self.model)  # inert until a call carries a ResidualState
        self.pad_id = pad_id(tokenizer, model, self.eos_ids)
        if prefix_cache_bytes is None:  # after the weights: a share of what they left free
            prefix_cache_bytes = auto_budget(self.device)
        self.prefix_cache = PrefixCache(prefix_cache_bytes if reusable(self.model.config) else 0)
        self._pi_firsts: dict[tuple, torch.Tensor] = {}  # pi-floor's reference pi per first turn and config
        self.decode_mode = decode
        # Rows that are done leave a batch that decodes on (see `_decode`); off only to measure
        # what that saves (benchmarks/generation.py).
        self.compact_rows = True
        # The static decoder asked for (None: the dynamic loop), and why a static loop asked for was not taken.
        self._static, self._static_refused = static_decoder(self.model, decode, self.device, device_map=device_map,
                                                            quantize=quantize)
        if self._static_refused and decode != "auto":  # auto takes the dynamic loop where the static one cannot run
            self._fallback(f"--decode {decode} is not available for {name}: {self._static_refused}; "
                           "it decodes with the dynamic cache instead.")
        loop = self.ran()["decode"]
        logger.info("%s decodes with the %s loop (--decode %s%s)", name, loop["loop"], decode,
                    f": {auto_decode(self.device)} on {self.device.type}, compiled on CUDA"
                    if decode == "auto" and "refused" not in loop else f": {loop['refused']}" if "refused" in loop else "")

    @classmethod
    def from_model(
        cls,
        model,
        tokenizer,
        *,
        span_mode: str = "content",
        prefix_cache_bytes: int | None = None,
        decode: DecodeMode = "auto",
        name: str | None = None,
    ) -> HFChatBackend:
        """A backend around a transformers model you already hold, instead of one driftlab loads.

        Why: models are often loaded, placed (`device_map`), quantised or fine-tuned (PEFT)
        in ways driftlab's loader does not reproduce; this steers, traces and measures that
        very object. Any decoder-only `PreTrainedModel` on the AttentionInterface works, on any
        device; a `peft.PeftModel` decodes through its adapters (its config is read from
        `get_base_model()`). driftlab's attention is installed with transformers'
        `set_attn_implementation("driftlab")`; `close()` (or leaving a `with` block) restores
        the model's own implementation, so the model serves its other users unchanged after.
        A model driftlab cannot steer (attention outside the interface, no `layer_idx`,
        softcapping, ...) is refused with a one-line error, and left as it was. While open,
        the model belongs to this backend: `steer()` or a second backend on it is refused.
        `describe()` records `"source": "memory"`, the name (`name`, else the model's
        `name_or_path`) and any PEFT adapters. Generation matches a backend that loaded the
        same weights by name, token for token.
        """
        from driftlab.chat.attach import Attachment, describe_name

        _check_decode(decode)
        label = describe_name(model, name)
        attachment = Attachment(model, f"an open HFChatBackend ({label})", label)
        try:
            if not callable(getattr(tokenizer, "apply_chat_template", None)):
                raise DriftlabError(f"HFChatBackend.from_model needs the tokenizer of {label}, not {tokenizer!r}.",
                                    hint="Pass the model's tokenizer (AutoTokenizer.from_pretrained(...)).")
            self = cls.__new__(cls)
            self._setup(model, tokenizer, name=label, span_mode=span_mode, prefix_cache_bytes=prefix_cache_bytes,
                        decode=decode, attachment=attachment, **attachment.placement())
        except BaseException:
            attachment.restore()
            raise
        return self

    def close(self) -> None:
        """Let go: drop the prefix cache and the static decode state, and give a model from
        `from_model` back as it came (its own attention implementation; a chat template the
        backend set on its tokenizer unset). A closed backend refuses to generate. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._ran = self.ran()  # what decoded stays known after the decode state is gone
        self._closed = True
        self.prefix_cache.clear()
        self._static = None
        if self._attachment is not None:
            if self._set_template:
                self.tokenizer.chat_template = None
            from driftlab.activation import hooks

            hooks.remove(self.model)
            self._attachment.restore()

    def __enter__(self) -> HFChatBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_spec(cls, spec: BackendSpec, *, prefix_cache_bytes: int | None = None) -> HFChatBackend:
        """The local model a `BackendSpec` names (its runtime is the caller's business)."""
        return cls(spec.model, dtype=spec.dtype, device=spec.device, span_mode=spec.span,
                   prefix_cache_bytes=prefix_cache_bytes, device_map=spec.device_map, quantize=spec.quantize,
                   decode=spec.decode, directions=spec.directions)

    def use_directions(self, directions) -> None:
        """Take persona directions (a `Directions`, a path to one, or None to drop them): from now on
        each reply's projection is recorded (`Reply.activation`) and vector and cap steers act. A
        file of another model's shape is a one-line error."""
        from driftlab.activation.directions import Directions

        if directions is not None and not isinstance(directions, Directions):
            directions = Directions.load(directions)
        if directions is not None:
            directions.check_model(self.name, self.shape.layers, self.d_model)
        if directions is not self.directions:
            self.prefix_cache.clear()  # KV steered along other directions is not this KV
        self.directions = directions

    # -- public API -------------------------------------------------------------------------
    def generate(self, request: ChatRequest) -> list[Reply]:
        """Generate the next assistant turn of each conversation (see ChatBackend.generate).

        Conversation-hook interventions (system-prompt repetition) edit what the model is
        shown; attention interventions and pi tracing locate the system prompt through the
        renderer (span mode `prefix` or `content`); classifier-free guidance decodes each
        conversation together with a copy without its system prompt, as extra rows of the
        same batch with their own KV cache, and samples from the mixed distribution.
        """
        iv = request.interventions
        self.capabilities.require(self.name, iv)
        convs = [c if isinstance(c, Rendered) else iv.model_view(c) for c in request.conversations]
        rendered = [c if isinstance(c, Rendered) else self.render(c, interventions=iv) for c in convs]
        ivs, gates = gate.gated(self, rendered, iv, [system_of(c) for c in convs])
        seeds, store = request.row_seeds(), request.cache_store
        alpha = iv.guidance()
        if alpha is not None:
            # An emptied system prompt is no prompt to steer towards: the unconditional rows have no system span.
            rendered += [c.without_system() if isinstance(c, Rendered) else
                         replace(self.render(without_system(c), interventions=iv), system_span=None) for c in convs]
            seeds, store = seeds * 2, (list(store) * 2 if store is not None else None)
        # CFG's unconditional twins have no system prompt, hence no persona to steer towards.
        residual = self._residual_of(convs, iv, ivs) + [None] * (len(rendered) - len(convs))
        ivs += [iv] * (len(rendered) - len(ivs))  # CFG's twins (a gate refuses CFG)
        replies = self._decode(
            [r.ids for r in rendered], request.sampling, seeds=seeds, interventions=ivs, gates=gates,
            spans=[r.spans() for r in rendered], cache_store=store, guidance=alpha, residual=residual,
            logprobs=request.logprobs, on_token=request.on_token, cancelled=request.cancelled,
            on_logprob=request.on_logprob, distributions=request.distributions,
            row_max_tokens=list(request.row_max_tokens) * (2 if alpha is not None else 1)
            if request.row_max_tokens is not None else None, on_finish=request.on_finish,
            admit=(lambda: self._joining(request)) if request.admit is not None and alpha is None else None,
        )
        return replies if request.admit is not None else replies[: len(convs)]

    def _joining(self, first: ChatRequest) -> Decoding | None:
        """The rows `first.admit()` gives, prefilled, to join `first`'s running batch (None: none wait)."""
        more = first.admit()
        if more is None or not more.conversations:
            return None
        iv = more.interventions
        self.capabilities.require(self.name, iv)
        if more.logprobs != first.logprobs or iv.guidance() is not None or iv.tracing() != first.interventions.tracing() or \
                more.sampling.model_copy(update={"max_new_tokens": 1}) != \
                first.sampling.model_copy(update={"max_new_tokens": 1}):
            raise DriftlabError("Rows joining a running batch must share its sampling (but for token limits), "
                                "log-probs and prompt tracing, and cannot bring CFG's twin rows.")
        convs = [c if isinstance(c, Rendered) else iv.model_view(c) for c in more.conversations]
        rendered = [c if isinstance(c, Rendered) else self.render(c, interventions=iv) for c in convs]
        ivs, gates = gate.gated(self, rendered, iv, [system_of(c) for c in convs])
        return Decoding(self, [r.ids for r in rendered], more.sampling, seeds=more.row_seeds(),
                        interventions=ivs, gates=gates, spans=[r.spans() for r in rendered],
                        cache_store=more.cache_store, guidance=None, logprobs=more.logprobs, on_finish=None,
                        residual=self._residual_of(convs, iv, ivs),
                        row_max_tokens=more.row_max_tokens)

    def generate_activations(self, request: ChatRequest) -> tuple[list[Reply], torch.Tensor]:
        """`generate`, and each row's mean residual activation per layer over the positions that
        generated its reply (the last prompt token, then each reply token but the last): [B, L, d]
        float32. The directions protocol's difference of means is taken over these."""
        iv = request.interventions
        self.capabilities.require(self.name, iv)
        if iv.guidance() is not None:
            raise DriftlabError("cfg mixes two rows per conversation, whose activations are not one reply's.",
                                hint="Compute activations without --steer cfg.")
        convs = [c if isinstance(c, Rendered) else iv.model_view(c) for c in request.conversations]
        rendered = [c if isinstance(c, Rendered) else self.render(c, interventions=iv) for c in convs]
        ivs, gates = gate.gated(self, rendered, iv, [system_of(c) for c in convs])
        return self._decode([r.ids for r in rendered], request.sampling, seeds=request.row_seeds(),
                            interventions=ivs, gates=gates, spans=[r.spans() for r in rendered],
                            cache_store=request.cache_store, residual=self._residual_of(convs, iv, ivs), capture=True)

    def project_prompts(self, prompts: Sequence[Rendered], systems: Sequence[str | None], *,
                        compute_from: Sequence[int] | None = None,
                        cache_store: Sequence[bool] | None = None) -> list[tuple[int, torch.Tensor]]:
        """Teacher-forced projections onto each prompt's persona direction (`teacher_forced.project_prompts`)."""
        return teacher_forced.project_prompts(self, prompts, systems, compute_from=compute_from,
                                              cache_store=cache_store)

    def prompt_logprobs(self, prompts: Sequence[Rendered], keep: Sequence[int], *,
                        interventions: Interventions = Interventions(),
                        cache_store: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """Next-token log-probabilities at each prompt's last positions (`teacher_forced.prompt_logprobs`)."""
        return teacher_forced.prompt_logprobs(self, prompts, keep, interventions=interventions, cache_store=cache_store)

    def check_steer(self, conversation: Conversation, interventions: Interventions) -> None:
        """One-line errors, before any work, for a conversation a steer cannot act on: a vector or cap
        steer without a direction for its system prompt, a pi floor or `when-drifting` without a system
        prompt or first turn. What a server asks of each request, so that one request never fails a batch."""
        self.residual_rows([system_of(conversation)], interventions)
        if interventions.kinds & {"pi-floor", "when-drifting"}:
            rendered = self.render(interventions.model_view(conversation), interventions=interventions)
            if "pi-floor" in interventions.kinds:
                teacher_forced.floors(self, [interventions.attention()], [rendered.spans()], [rendered.ids], check_only=True)
            if "when-drifting" in interventions.kinds:
                gate.engine_reads(interventions.get("when-drifting"))
                gate.first_turn_end(rendered.spans())
                if interventions.get("when-drifting").by == "projection":
                    gate.gate_direction(self.directions, system_of(conversation), self.name)

    def _residual_of(self, convs, iv: Interventions, ivs: Sequence[Interventions]) -> list[ResidualRow | None]:
        """Each conversation's residual state under its own interventions (`gate.gated`: a row the gate
        leaves plain is only monitored), after the request's one-line errors for every row."""
        systems = [system_of(c) for c in convs]
        rows = self.residual_rows(systems, iv)
        if all(v is iv for v in ivs):
            return rows
        return [self.residual_rows([system], v)[0] for system, v in zip(systems, ivs, strict=True)]

    def residual_rows(self, systems: Sequence[str | None], interventions: Interventions) -> list[ResidualRow | None]:
        """Each row's residual-stream state (`row_directions`: its persona's direction, or the file's axis)
        under the vector and cap steers asked; None where nothing is recorded or steered."""
        config = interventions.residual()
        return [None if found is None else found.row(config)
                for found in row_directions(self.directions, systems, interventions, self.name)]

    def describe(self) -> dict[str, Any]:
        """The model's facts for a run's manifest (`chat.describe`)."""
        return describe_hf(self)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def render(self, conversation: Conversation, add_generation_prompt: bool = True,
               interventions: Interventions | None = None) -> Rendered:
        """The tokens the model is given (`Renderer.render_for`)."""
        return self.renderer.render_for(conversation, add_generation_prompt, interventions)

    def loglikelihood(self, contexts: Sequence[Conversation], continuations: Sequence[str],
                      interventions: Interventions = Interventions(), *, batch_size: int = 8) -> list[LogLikelihood]:
        """log p(continuation | context) per pair, under the interventions (`teacher_forced.loglikelihood`)."""
        return teacher_forced.loglikelihood(self, contexts, continuations, interventions, batch_size=batch_size)

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
        """Continue rendered prompts (see TokenBackend.generate_tokens); one reply per prompt.

        `interventions` is one for all rows or one per row. Their attention and logit parts
        apply here; conversation edits (spr) were the renderer's business, and guidance (cfg)
        needs each conversation without its system prompt, so it goes through `generate`.
        """
        rows = [interventions] * len(prompts) if isinstance(interventions, Interventions) else list(interventions)
        if len(rows) != len(prompts):
            raise DriftlabError(f"{len(rows)} interventions given for {len(prompts)} prompts.")
        for iv in rows:
            self.capabilities.require(self.name, iv)
            if "when-drifting" in iv.kinds:
                raise DriftlabError("when-drifting compares a conversation's turns, which token prompts do not mark.",
                                    hint="Use generate() with conversations for when-drifting.")
            if iv.guidance() is not None:
                raise DriftlabError("cfg decodes each conversation beside a copy without its system prompt, "
                                    "which token prompts do not carry.", hint="Use generate() for cfg.")
        # A token prompt names no system message: a residual steer takes the directions' axis, if any.
        residual = [self.residual_rows([None], iv)[0] for iv in rows]
        return self._decode([p.ids for p in prompts], sampling, seeds=seeds, interventions=rows,
                            spans=[p.spans() for p in prompts], cache_store=cache_store, logprobs=logprobs,
                            on_token=on_token, cancelled=cancelled, residual=residual)

    @torch.inference_mode()
    def _decode(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        *,
        seeds: Sequence[int] | None,
        interventions: Sequence[Interventions],
        spans: Sequence[dict[str, list[tuple[int, int]]]],
        cache_store: Sequence[bool] | None = None,
        guidance: float | None = None,
        logprobs: int | None = None,
        on_token: Callable[[int, int], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
        row_max_tokens: Sequence[int] | None = None,
        on_finish: Callable[[int, Reply], None] | None = None,
        on_logprob: Callable[[int, TokenLogprob], None] | None = None,
        residual: Sequence[ResidualRow | None] | None = None,
        capture: bool = False,
        admit: Callable[[], Decoding | None] | None = None,
        gates: Sequence[dict | None] | None = None,
        distributions: bool = False,
    ) -> list[Reply] | tuple[list[Reply], torch.Tensor]:
        """The core decode loop over token prompts, with each row's interventions.

        `spans` names token ranges of each prompt ("system", "emphasis", ...) that an
        attention intervention refers to. `cache_store[b]` False keeps row b's KV out of
        the prefix cache (e.g. probe replies, which no later prompt extends). With
        `guidance` (CFG's alpha) the second half of the prompts are the unconditional rows
        of the first half: both halves are fed the token sampled from the mixed logits.
        `logprobs=k` records each token's log-probability under the (mixed) model
        distribution, before temperature and top-p, with its k best alternatives;
        `on_token(row, id)` sees every sampled token of a (conditional) row as it comes;
        `cancelled(row)`, asked before each step, ends a (conditional) row and its guidance
        twin there: the row stops costing sampling, and a batch whose rows are all done ends;
        `row_max_tokens[b]` ends row b earlier than `sampling.max_new_tokens` (reason "length");
        `on_finish(row, reply)` hands over a row's reply as soon as it stops or hits its limit
        (not with pi tracing, whose traces are assembled at the end); `on_logprob(row, entry)`
        each token's log-prob entry, just before `on_token` sees the token.
        `residual[b]` is row b's residual-stream state (`residual_rows`); `capture` also returns each
        row's mean hidden state per layer over the positions that generated its reply ([B, L, d]).
        `admit()`, asked between steps while the batch can take rows (`Decoding.admissible`), gives
        prefilled rows that join it (continuous batching); they are rows len(prompts), ... on.
        `gates[b]` is row b's `when-drifting` decision, handed to its reply (`Reply.gate`).
        `distributions` keeps the model's logits at every step for each reply's `Distributions`.
        """
        if not prompts:
            return ([], torch.zeros(0)) if capture else []
        run = Decoding(self, prompts, sampling, seeds=seeds, interventions=interventions, spans=spans,
                       cache_store=cache_store, guidance=guidance, logprobs=logprobs, on_finish=on_finish,
                       residual=residual, capture=capture, row_max_tokens=row_max_tokens, gates=gates)
        run.kept = [[] for _ in prompts] if distributions else None
        while True:  # every row ends by its token limit
            if cancelled is not None and run.cancel(cancelled):
                break
            nxt = run.sample()
            run.take(nxt, on_token, on_logprob)
            if run.done:
                break
            run.feed(run.compact(nxt))
            if admit is not None and run.admissible and (joining := admit()) is not None:
                run.join(joining)
        replies = run.finish()
        return (replies, run.residual.mean_activations()[: len(prompts)]) if capture else replies

    def trace(self, conversation: Conversation, *, interventions: Interventions | None = None,
              add_generation_prompt: bool | None = None) -> Trace:
        """pi over a conversation as the model reads it, without generating (`teacher_forced.trace`)."""
        return teacher_forced.trace(self, conversation, interventions=interventions,
                                    add_generation_prompt=add_generation_prompt)

    # -- internals ---------------------------------------------------------------------------
    def _check_context(self, prompt_len: int, new_tokens: int) -> None:
        limit = self.shape.max_context
        if limit and prompt_len + new_tokens > limit:
            raise DriftlabError(
                f"Prompt of {prompt_len} tokens plus {new_tokens} new tokens exceeds the model's context "
                f"window of {limit}.",
                hint="Use fewer rounds or fewer --max-new-tokens.",
            )

    def _state(self, attention: Sequence[AttentionConfig | None], spans, pads, prompt_len: int, max_len: int, *,
               ends=None, prompts: Sequence[Sequence[int]] = ()) -> AttentionState | None:
        """The engine's per-call state for each row's attention config (None: plain attention);
        with a pi floor, its values from each row's first turn (`prompts`: the rows' tokens)."""
        if not any(a is not None and a.active for a in attention):
            return None
        rows = [a or AttentionConfig() for a in attention]
        state = AttentionState(rows, spans, self.shape.layers, self.shape.heads, self.device)
        state.on_layout(pads, prompt_len, max_len, ends)
        if any(a.floors for a in rows):
            state.set_floors(*teacher_forced.floors(self, rows, spans, prompts))
        return state

    def _resumed_state(self, attention: Sequence[AttentionConfig | None], spans, pads: list[int], lengths: list[int],
                       n_slots: int, more: int) -> AttentionState | None:
        """The state of a running batch laid out again after rows joined it: row b's prompt fills
        slots [pads[b], pads[b] + lengths[b]), `n_slots` are filled, and `more` steps may follow."""
        state = self._state(attention, spans, pads, n_slots, n_slots + more,
                            ends=[p + n for p, n in zip(pads, lengths, strict=True)])
        if state is not None:
            state.resume()
        return state

    def drift_ratio(self, rendered: Rendered) -> float:
        """pi_t / pi_1 of a rendered conversation: what `when-drifting` decides by (`teacher_forced.drift_ratio`)."""
        return teacher_forced.drift_ratio(self, rendered)

    def projection_drift(self, rendered: Rendered, system: str | None) -> tuple[float, float]:
        """The projection at the first turn and now: what `by=projection` compares (`teacher_forced.projection_drift`)."""
        return teacher_forced.projection_drift(self, rendered, system)

    def _forward(self, ids, mask, positions, cache, state: AttentionState | None, keep: int = 1,
                 forward: Callable | None = None, residual: ResidualState | None = None) -> torch.Tensor:
        if self._closed:  # a model from memory has its own attention back: it would run unsteered
            raise DriftlabError(f"The backend of {self.name} is closed.", hint="Open a new one to generate again.")
        extra = state.forward_kwargs(mask.shape[1]) if state is not None else {}
        if residual is not None:
            extra.update(residual.forward_kwargs())
        out = (forward or self.model)(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
            **extra,
        )
        return out.logits[:, -1, :].float() if keep == 1 else out.logits.float()

    def _static_step(self, ids, mask, positions, cache, state: AttentionState | None,
                     residual: ResidualState | None = None) -> torch.Tensor:
        """One decode step on the static cache (`static_decode.static_step`: compiled, else eager)."""
        return static_step(self, ids, mask, positions, cache, state, residual)

    def warm(self, batches: Sequence[int] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
        """Compile the decode step ahead of a run (`static_decode.warm`): one row per batch bucket and kind."""
        return warm(self, batches)

    def ran(self) -> dict[str, Any]:
        """What decoded, known once the work is done (the run's manifest records it at completion,
        the GPU benchmark labels its results with it): the loop asked for and the one that ran,
        with the graphs a compiled step compiled and why a faster loop was not taken."""
        if getattr(self, "_closed", False):
            return self._ran
        return {"decode": decode_facts(self.decode_mode, self._static, self._static_refused)}

    def _fallback(self, message: str) -> None:
        """Say once per backend that a faster decode path was not taken, and why."""
        if getattr(self, "_said_fallback", False):
            return
        self._said_fallback = True
        from driftlab.console import err_console

        err_console().print(f"note: {message}", highlight=False, markup=False)


def _check_decode(decode: str) -> None:
    if decode not in DECODE_MODES:
        raise DriftlabError(f"Unknown decode mode {decode!r}.", hint=f"Use one of {', '.join(DECODE_MODES)}.")
