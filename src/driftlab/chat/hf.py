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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from driftlab.activation.state import ResidualRow, ResidualState
from driftlab.attention.engine import kernel_for
from driftlab.attention.state import AttentionConfig, AttentionState
from driftlab.chat import gate
from driftlab.chat.base import (
    Capabilities,
    ChatRequest,
    Conversation,
    Distributions,
    LogLikelihood,
    Rendered,
    Reply,
    Sampling,
    TokenLogprob,
    model_shape,
    system_of,
    validate_conversation,
    without_system,
)
from driftlab.chat.constrain import JsonConstraint
from driftlab.chat.describe import describe_hf, preset_of
from driftlab.chat.directions import row_directions
from driftlab.chat.guidance import guide
from driftlab.chat.loading import input_device, load_model
from driftlab.chat.prefix_cache import PrefixCache, auto_budget
from driftlab.chat.sampling import sample, warpers
from driftlab.chat.spec import BackendSpec
from driftlab.chat.static_decode import (
    DECODE_MODES,
    RECOMPILE_LIMIT,
    DecodeMode,
    StaticDecoder,
    auto_decode,
    batch_bucket,
    bias_slots,
    cache_length,
    static_refusal,
    warm_buckets,
)
from driftlab.chat.templates import Renderer
from driftlab.chat.trace import Trace
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import KINDS, Interventions
from driftlab.steering.interventions import Trace as TraceIntervention

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
        self.pad_id = self._pad_id()
        if prefix_cache_bytes is None:  # after the weights: a share of what they left free
            prefix_cache_bytes = auto_budget(self.device)
        self.prefix_cache = PrefixCache(prefix_cache_bytes if self._cacheable() else 0)
        self._pi_firsts: dict[tuple, torch.Tensor] = {}  # pi-floor's reference pi per first turn and config
        self.decode_mode = decode
        self._static: StaticDecoder | None = None
        # Rows that are done leave a batch that decodes on (see `_decode`); off only to measure
        # what that saves (benchmarks/generation.py).
        self.compact_rows = True
        self._static_refused: str | None = None  # why a static loop asked for was not taken
        wanted = auto_decode(self.device) if decode == "auto" else decode
        if wanted in ("static", "compiled"):
            why = static_refusal(self.model, device_map=device_map, quantize=quantize)
            self._static_refused = why
            if why is None:
                self._static = StaticDecoder(self.model, compiled=wanted == "compiled")
            elif decode != "auto":  # auto takes the dynamic loop where the static one cannot run, quietly
                self._fallback(f"--decode {decode} is not available for {name}: {why}; "
                               "it decodes with the dynamic cache instead.")
        loop = self.ran()["decode"]
        logger.info("%s decodes with the %s loop (--decode %s%s)", name, loop["loop"], decode,
                    f": {wanted} on {self.device.type}, compiled on CUDA" if decode == "auto" and "refused" not in loop
                    else f": {loop['refused']}" if "refused" in loop else "")

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
            base = attachment.base
            quant = getattr(base.config, "quantization_config", None)
            quant = getattr(quant, "quant_method", None) or (quant.get("quant_method") if isinstance(quant, dict)
                                                              else None) if quant is not None else None
            where = getattr(base, "name_or_path", "") or ""
            self._setup(model, tokenizer, Path(where) if where and Path(where).is_dir() else None, label,
                        span_mode=span_mode, prefix_cache_bytes=prefix_cache_bytes, decode=decode,
                        device_map="hf_device_map" if getattr(base, "hf_device_map", None) else None,
                        quantize=str(quant) if quant else None, attachment=attachment)
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

    def _joining(self, first: ChatRequest) -> _Decoding | None:
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
        return _Decoding(self, [r.ids for r in rendered], more.sampling, seeds=more.row_seeds(),
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

    @torch.inference_mode()
    def project_prompts(self, prompts: Sequence[Rendered], systems: Sequence[str | None], *,
                        compute_from: Sequence[int] | None = None,
                        cache_store: Sequence[bool] | None = None) -> list[tuple[int, torch.Tensor]]:
        """Teacher-forced projections of rendered prompts onto their personas' directions: per row,
        (j0, [T - j0, L] float32) with row j of the tensor the normalised projection (0: like without
        the system prompt, 1: like with it) of the residual stream at token j0 + j, per layer. Tokens
        before j0 came from the prefix cache (a prompt extending one seen before computes only its
        new tokens), never past `compute_from[b]` (default 0: every token); the last token is always
        computed. `systems[b]` picks row b's direction."""
        if self.directions is None:
            raise DriftlabError(f"Projections need persona directions, and {self.name} was given none.",
                                hint="Pass --directions DIR (from driftlab directions).")
        rows = self.residual_rows(systems, Interventions())
        missing = [i for i, r in enumerate(rows) if r is None]
        if missing:
            raise DriftlabError(f"Prompt {missing[0]} has a system prompt the directions at {self.directions.path} "
                                "hold no direction for.", hint="Compute directions for it (driftlab directions).")
        run = _Decoding(self, [p.ids for p in prompts], Sampling(greedy=True, max_new_tokens=1), seeds=None,
                        interventions=[Interventions()] * len(prompts), spans=[p.spans() for p in prompts],
                        cache_store=cache_store, guidance=None, logprobs=None, on_finish=None, residual=rows,
                        keep_prefill=True, compute_from=compute_from or [0] * len(prompts))
        run._store(at=dict(enumerate(run.live)))
        state = run.residual
        per_slot = torch.stack([p[: len(prompts)] for p in state.prefill_proj], dim=-1).cpu()  # [B, T - S, L]
        out = []
        for b in range(len(prompts)):
            first = max(0, run.S - run.pads[b])  # the row's first computed token
            values = per_slot[b, run.pads[b] + first - run.S :]
            out.append((first, (values - state.low[b]) / (state.high[b] - state.low[b])))
        return out

    @torch.inference_mode()
    def prompt_logprobs(self, prompts: Sequence[Rendered], keep: Sequence[int], *,
                        interventions: Interventions = Interventions(),
                        cache_store: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """Teacher-forced next-token log-probabilities [keep[b], V] (float32) at the last keep[b] positions of
        each rendered prompt: row j is the distribution of the token after position T - keep[b] + j.
        Those positions are computed; what precedes them may come from the prefix cache (a prompt that
        extends one seen before computes only its new tokens), and `cache_store[b]` keeps row b's KV
        there for the next. What the distribution measures (`protocol.kl`) read."""
        if any(not 1 <= k <= len(p.ids) for k, p in zip(keep, prompts, strict=True)):
            raise DriftlabError("Each prompt's positions must lie within it.")
        store = list(cache_store) if cache_store is not None else [True] * len(prompts)
        out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
        ids = [np.asarray(p.ids, dtype=np.int64) for p in prompts]
        tags = [cache_tag(interventions, p.spans()) for p in prompts]
        for group in self.prefix_cache.plan(ids, tags, [len(p.ids) - k for p, k in zip(prompts, keep, strict=True)]):
            rows, keeps = [prompts[b] for b in group], [keep[b] for b in group]
            run = _Decoding(self, [p.ids for p in rows], Sampling(greedy=True, max_new_tokens=1), seeds=None,
                            interventions=[interventions] * len(rows), spans=[p.spans() for p in rows],
                            cache_store=[store[b] for b in group], guidance=None, logprobs=None, on_finish=None,
                            residual=self.residual_rows([None] * len(rows), interventions)
                            if interventions.residual() else None,
                            compute_from=[len(p.ids) - k for p, k in zip(rows, keeps, strict=True)],
                            keep_logits=max(keeps))
            run._store(at=dict(enumerate(run.live)))
            logits = run.logits if run.logits.dim() == 3 else run.logits[:, None]
            for j, (b, k) in enumerate(zip(group, keeps, strict=True)):
                out[b] = torch.log_softmax(logits[j, logits.shape[1] - k :].float(), dim=-1).cpu()
        return out

    def check_steer(self, conversation: Conversation, interventions: Interventions) -> None:
        """One-line errors, before any work, for a conversation a steer cannot act on: a vector or cap
        steer without a direction for its system prompt, a pi floor or `when-drifting` without a system
        prompt or first turn. What a server asks of each request, so that one request never fails a batch."""
        self.residual_rows([system_of(conversation)], interventions)
        if interventions.kinds & {"pi-floor", "when-drifting"}:
            rendered = self.render(interventions.model_view(conversation), interventions=interventions)
            if "pi-floor" in interventions.kinds:
                self._floors([interventions.attention()], [rendered.spans()], [rendered.ids], check_only=True)
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

    @torch.inference_mode()
    def loglikelihood(
        self,
        contexts: Sequence[Conversation],
        continuations: Sequence[str],
        interventions: Interventions = Interventions(),
        *,
        batch_size: int = 8,
    ) -> list[LogLikelihood]:
        """log p(continuation | context) for each pair, under the interventions (teacher-forced).

        The context is rendered with the assistant generation prompt; the continuation is
        the start of the assistant's reply (e.g. "B" for a multiple-choice letter). Pairs
        that differ only in their last token (the four letters of one question) share one
        forward pass; `batch_size` such passes run together. No prefix cache.
        """
        if len(contexts) != len(continuations):
            raise DriftlabError(f"{len(contexts)} contexts but {len(continuations)} continuations.")
        self.capabilities.require(self.name, interventions)
        if "when-drifting" in interventions.kinds:  # each context scored under its own decision
            return gate.gated_loglikelihood(self, contexts, continuations, interventions, batch_size)
        if "trace" in interventions.kinds:
            interventions = interventions.without("trace")  # nothing to return a trace in
        alpha = interventions.guidance()
        steers = interventions.residual() is not None and interventions.residual().steers
        # Nothing to record in a score: the residual stream matters here only where it is steered.
        residual = self.residual_rows([system_of(c) for c in contexts], interventions) if steers else None
        rows, plain_rows, spans, n_cont = [], [], [], []
        for i, (conv, cont) in enumerate(zip(contexts, continuations, strict=True)):
            validate_conversation(conv, i)
            conv = interventions.model_view(conv)
            cont_ids = self.renderer.encode(cont)
            if not cont_ids:
                raise DriftlabError(f"Continuation {i} ({cont!r}) encodes to no tokens.")
            rendered = self.render(conv, interventions=interventions)
            rows.append(np.asarray(rendered.ids + cont_ids, dtype=np.int64))
            spans.append(rendered.spans())
            n_cont.append(len(cont_ids))
            if alpha is not None:
                plain_rows.append(np.asarray(self.render(without_system(conv), interventions=interventions).ids + cont_ids))
        # One pass per distinct row-without-its-last-token: the positions read never see that token.
        members: dict[tuple[bytes, int], list[int]] = {}
        for i, (row, n) in enumerate(zip(rows, n_cont, strict=True)):
            members.setdefault((row[:-1].tobytes(), n), []).append(i)
        groups = list(members.values())  # each: the pairs sharing one forward pass, first one representing them
        out: dict[int, LogLikelihood] = {}
        for start in range(0, len(groups), batch_size):
            chunk = [g[0] for g in groups[start : start + batch_size]]
            keep = max(n_cont[i] for i in chunk) + 1
            conts = [n_cont[i] for i in chunk]
            logprobs = self._teacher_forced(
                [rows[i] for i in chunk], [spans[i] for i in chunk], interventions, keep, conts,
                residual=[residual[i] for i in chunk] if residual is not None else None)
            if alpha is not None:  # rows end with the same continuation, so positions align from the end
                plain = self._teacher_forced(
                    [plain_rows[i] for i in chunk], [{} for _ in chunk], interventions, keep, conts)
                logprobs = torch.log_softmax(guide(torch.cat([logprobs, plain]), alpha), dim=-1)
            for b, group in enumerate(groups[start : start + batch_size]):
                for i in group:
                    n = n_cont[i]
                    lp = logprobs[b, -n - 1 : -1]  # positions predicting the continuation tokens
                    target = torch.from_numpy(rows[i][-n:]).to(lp.device)
                    picked = lp.gather(-1, target[:, None])[:, 0]
                    out[i] = LogLikelihood(float(picked.sum()), n, bool((lp.argmax(-1) == target).all()))
        return [out[i] for i in range(len(rows))]

    def _teacher_forced(self, rows, spans, interventions: Interventions, keep: int, n_cont,
                        residual: Sequence[ResidualRow | None] | None = None) -> torch.Tensor:
        """Log-softmax of the last `keep` positions of each left-padded row: [B, keep, V].

        The last `n_cont[b]` tokens of row b are its continuation: the attention engine
        treats them as generated tokens (they are what a reply would have generated)."""
        T = max(len(r) for r in rows)
        pads = [T - len(r) for r in rows]
        self._check_context(T, 0)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, pads[b] :] = torch.from_numpy(r)
            mask[b, pads[b] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        state = self._state([interventions.attention()] * len(rows), spans, pads, T, T, ends=[T - n for n in n_cont],
                            prompts=rows)
        rstate = ResidualState(residual, self.shape.layers, self.d_model, self.device, self.model.dtype) \
            if residual is not None else None
        logits = self._forward(ids, mask, positions, self._new_cache(), state, keep=keep, residual=rstate)
        return torch.log_softmax(logits, dim=-1)

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
        admit: Callable[[], _Decoding | None] | None = None,
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
        `admit()`, asked between steps while the batch can take rows (`_Decoding.admissible`), gives
        prefilled rows that join it (continuous batching); they are rows len(prompts), ... on.
        `gates[b]` is row b's `when-drifting` decision, handed to its reply (`Reply.gate`).
        `distributions` keeps the model's logits at every step for each reply's `Distributions`.
        """
        if not prompts:
            return ([], torch.zeros(0)) if capture else []
        run = _Decoding(self, prompts, sampling, seeds=seeds, interventions=interventions, spans=spans,
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

    @torch.inference_mode()
    def trace(self, conversation: Conversation, *, interventions: Interventions | None = None,
              add_generation_prompt: bool | None = None) -> Trace:
        """pi over a conversation as the model reads it, without generating: one prefill pass.

        Why a method of its own: a drift study often asks where attention sits over a given
        dialog (a saved one, a hand-written one), not over a reply; a 1-token generate would
        do it but sample a token nobody wants and touch the prefix cache. The conversation is
        rendered as `generate` renders it (conversation-hook interventions such as SPR
        applied; with the generation prompt unless it ends with the assistant's turn, which is
        then traced as it stands, or as `add_generation_prompt` says) and run through the
        model once with tracing on, under the attention interventions given (pi under
        split-softmax, PASTA, ...); logits rules (cfg) do nothing here, since no token is drawn.
        The Trace has `prefill` [prompt tokens, L, H] and an empty `decode`.
        """
        iv = interventions if interventions is not None else Interventions()
        self.capabilities.require(self.name, iv)
        validate_conversation(conversation, 0)
        iv = Interventions.of(*iv.without("trace", "cfg").items, TraceIntervention(prefill=True))
        conv = iv.model_view(conversation)
        if add_generation_prompt is None:
            add_generation_prompt = conv[-1]["role"] != "assistant"
        rendered = self.render(conv, add_generation_prompt, interventions=iv)
        if not rendered.ids:
            raise DriftlabError("The conversation rendered to zero tokens.", hint="Give a non-empty conversation.")
        T = len(rendered.ids)
        self._check_context(T, 0)
        ids = torch.tensor([rendered.ids], dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        positions = torch.arange(T, device=self.device)[None]
        spans = rendered.spans()
        state = self._state([iv.attention()], [spans], [0], T, T, prompts=[rendered.ids])
        self._forward(ids, mask, positions, self._new_cache(), state)
        return self._trace_of(state.row_traces([0], [0])[0], rendered.ids, [], spans)

    def _trace_of(self, row: dict[str, torch.Tensor], prompt: Sequence[int], generated: Sequence[int],
                  spans: dict[str, list[tuple[int, int]]]) -> Trace | None:
        """The typed Trace of one row of `AttentionState.row_traces` (None where nothing was traced),
        with the token texts (one decode per token: what each row of pi belongs to)."""
        if not row:
            return None
        def texts(ids: Sequence[int]) -> tuple[str, ...]:  # (batch_decode([]) is [""], not [])
            return tuple(self.tokenizer.batch_decode([[int(t)] for t in ids])) if len(ids) else ()

        return Trace(decode=row["decode"], prefill=row.get("prefill"), prompt_length=len(prompt),
                     system_spans=tuple(spans.get("system", ())), prompt_tokens=texts(prompt),
                     generated_tokens=texts(generated))

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
            state.set_floors(*self._floors(rows, spans, prompts))
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

    def _floors(self, rows: Sequence[AttentionConfig], spans, prompts,
                check_only: bool = False) -> tuple[torch.Tensor, list[int]]:
        """pi-floor's values [B, L, H] (F times each row's pi_1, the attention mass on its system
        prompt at its first turn's last prompt token) and first queries (the token after it);
        `check_only`: only the one-line errors, no pass."""
        values = torch.zeros(len(rows), self.shape.layers, self.shape.heads)
        first = [0] * len(rows)
        for b, (config, row_spans) in enumerate(zip(rows, spans, strict=True)):
            if not config.floors:
                continue
            turn = row_spans.get("first_turn")
            if not turn or not row_spans.get("system"):
                raise DriftlabError("pi-floor raises the system prompt's attention to a share of its first turn's, "
                                    f"and row {b} has {'no system prompt' if turn else 'no first turn to read it at'}.",
                                    hint="Give conversations with a system prompt and a user turn, rendered "
                                         "by a chat template that renders the first turn as a prefix.")
            end = turn[0][1]
            if not check_only:
                values[b] = config.pi_floor * self._pi_first(tuple(prompts[b][:end]), row_spans, config)
            first[b] = end
        return values, first

    def drift_ratio(self, rendered: Rendered) -> float:
        """pi_t / pi_1 of a rendered conversation: the attention mass on its system prompt at its
        last token (where the next reply starts) over that at its first turn's last token, each
        the mean over layers and heads of plain attention (1 at the first turn; lower: drifted).
        What `when-drifting` decides by; the first turn's pi is kept, so a dialog pays one traced
        prefill a turn."""
        spans = rendered.spans()
        end = gate.first_turn_end(spans)
        plain = AttentionConfig()
        first = self._pi_first(tuple(rendered.ids[:end]), spans, plain).mean()
        now = self._pi_first(tuple(rendered.ids), spans, plain).mean()
        return float(now / first)

    def projection_drift(self, rendered: Rendered, system: str | None) -> tuple[float, float]:
        """The residual stream's normalised projection onto the persona's direction (0: like without
        the system prompt, 1: like with it), mean over the direction's band, at the first turn's
        last token and at the conversation's last token (where the next reply starts): what
        `when-drifting:by=projection` compares. One prefill from the first turn's last token on
        (what precedes it comes from the prefix cache when a dialog asked before)."""
        end = gate.first_turn_end(rendered.spans())
        direction = gate.gate_direction(self.directions, system, self.name)
        ((start, values),) = self.project_prompts([rendered], [system], compute_from=[end - 1])
        band = list(direction.band)

        def at(j: int) -> float:
            return float(values[j - start, band].mean())

        return at(end - 1), at(len(rendered.ids) - 1)

    def _pi_first(self, tokens: tuple[int, ...], spans, config: AttentionConfig) -> torch.Tensor:
        """[L, H] pi at the last of `tokens` (a first turn), under `config` without its floor; kept
        per tokens and config (a dialog's later turns ask again)."""
        key = (tokens, config.model_copy(update={"pi_floor": 0.0}).model_dump_json())
        held = self._pi_firsts.get(key)
        if held is None:
            traced = AttentionConfig(**{**config.model_dump(), "pi_floor": 0.0, "trace": True, "trace_prefill": False})
            T = len(tokens)
            state = self._state([traced], [{k: v for k, v in spans.items() if k != "first_turn"}], [0], T, T)
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            self._forward(ids, torch.ones_like(ids), torch.arange(T, device=self.device)[None], self._new_cache(), state)
            held = self._pi_firsts[key] = torch.stack([r[-1][0, :, -1] for r in state.records]).float().cpu()
            while len(self._pi_firsts) > 4096:
                self._pi_firsts.pop(next(iter(self._pi_firsts)))
        return held

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
        """One decode step on the static cache, compiled in `compiled` mode.

        A step that cannot be compiled (dynamo or inductor refuses it, before anything runs)
        runs eagerly, with the same numbers, and so do the later ones, said once. The logits
        are copied: a CUDA graph's next replay overwrites its outputs."""
        static = self._static
        if not static.compiled:
            return self._forward(ids, mask, positions, cache, state, forward=static.step(), residual=residual)
        from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

        calls = state._calls if state is not None else 0
        residual_calls = residual._calls if residual is not None else 0
        steered = state is not None and not state.lean
        slots = state.bias_heads.shape[0] if steered else 0
        # One graph per key; the attention implementation too (a benchmark runs stock SDPA beside driftlab's).
        key = (ids.shape[0], steered, slots, self.model.config._attn_implementation, residual is not None)
        try:
            return static.run(lambda: self._forward(ids, mask, positions, cache, state, forward=static.step(),
                                                    residual=residual).clone(),
                              key, lambda message: self._fallback(f"--decode compiled: {self.name}: {message}"))
        except (TorchDynamoException, FailOnRecompileLimitHit) as err:
            if state is not None:
                state._calls = calls  # the failed pass did not run
            if residual is not None:
                residual._calls = residual_calls
            static.compiled = False
            if isinstance(err, FailOnRecompileLimitHit):
                why = (f"its decode step reached dynamo's recompile limit ({RECOMPILE_LIMIT} compiled variants: "
                       "batch sizes x cache lengths x intervention layouts)")
            else:
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                why = f"a decode step cannot be compiled ({type(err).__name__}: {first})"
            static.eager_reason = why
            self._fallback(f"--decode compiled: {self.name}: {why}; it and the later steps run eagerly on the "
                           "static cache (the run's manifest records it under ran.agent.decode).")
            return self._forward(ids, mask, positions, cache, state, forward=static.step(), residual=residual)

    def warm(self, batches: Sequence[int] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
        """Compile the decode step ahead of a run: a plain and a steered call per batch bucket of
        `batches`, each a few tokens (the cache length is dynamic, so one short prompt serves every
        length). Compiled code lands in the compile cache (`static_decode.compile_cache_dir`), which
        later processes read, and so do the precompiled steps (`chat.precompiled`), which they load
        instead of tracing again. Returns one row per (bucket, kind): graphs compiled, seconds
        (compiling or loading), inductor cache hits and misses, precompiled steps saved and loaded."""
        static = self._static
        if static is None or not static.compiled:
            raise DriftlabError(f"{self.name} does not decode with the compiled loop (--decode {self.decode_mode}"
                                f"{': ' + self._static_refused if self._static_refused else ''}): nothing to warm.",
                                hint="Load it with decode='compiled' (--decode compiled).")
        # With directions, a persona's rows carry the residual state (its projection is recorded): the
        # run's graphs are those, so warm on a persona the directions hold (an axis serves any prompt).
        held = [p.system_prompt for p in self.directions.personas.values()] if self.directions else []
        system = next((s for s in held if s is not None), "You are brief.")
        conversation = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
        steered = Interventions.parse(["split-softmax:k=0.9", "trace", "instaboost:m=2"])
        rows = []
        for bucket in warm_buckets(batches):
            for interventions in (Interventions(), steered):
                before = static.tally()
                self.generate(ChatRequest([conversation] * bucket, Sampling(greedy=True, max_new_tokens=3,
                                                                             ignore_eos=True),
                                          interventions=interventions))
                row = {k: v - before[k] for k, v in static.tally().items()}
                rows.append({"batch": bucket, "steered": interventions is steered, "graphs": row["graphs"],
                             "compile_s": round(row["compile_s"], 2), "cache_hits": row["cache_hits"],
                             "cache_misses": row["cache_misses"], "saved": row["saved"], "loaded": row["loaded"]})
        return rows

    def ran(self) -> dict[str, Any]:
        """What decoded, known once the work is done (the run's manifest records it at completion,
        the GPU benchmark labels its results with it): the loop asked for and the one that ran,
        with the graphs a compiled step compiled and why a faster loop was not taken."""
        if getattr(self, "_closed", False):
            return self._ran
        facts: dict[str, Any] = {"asked": self.decode_mode}
        if self._static is not None:
            facts.update(self._static.ran())
        else:
            facts["loop"] = "dynamic"
            if self._static_refused:
                facts["refused"] = self._static_refused
        return {"decode": facts}

    def _fallback(self, message: str) -> None:
        """Say once per backend that a faster decode path was not taken, and why."""
        if getattr(self, "_said_fallback", False):
            return
        self._said_fallback = True
        from driftlab.console import err_console

        err_console().print(f"note: {message}", highlight=False, markup=False)

    def _hit_stop(self, tokens: list[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-8:], skip_special_tokens=True)
        return any(s in tail for s in self.renderer.stop_strings)

    def _pad_id(self) -> int:
        for cand in (self.tokenizer.pad_token_id, self.model.generation_config.pad_token_id):
            if isinstance(cand, int):
                return cand
        return min(self.eos_ids) if self.eos_ids else 0

    def _cacheable(self) -> bool:
        """Prefix reuse needs plain full-attention layers (sliding windows drop old keys)."""
        types = getattr(self.model.config, "layer_types", None)
        window = getattr(self.model.config, "sliding_window", None)
        use_sw = getattr(self.model.config, "use_sliding_window", window is not None)
        if types is not None:
            return all(t == "full_attention" for t in types)
        return not (window and use_sw)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _cache_from_hits(self, hits, pads: list[int], S: int, cache=None):
        """A cache holding slots [0, S) from the prefix-cache hits: a new dynamic one, or the
        empty `cache` given (a `StaticCache`, whose `update` writes slots [0, S) in place)."""
        cache = self._new_cache() if cache is None else cache
        if S <= 0:
            return cache
        ref = next(e for _, e in hits if e is not None)
        for layer, (k0, v0) in enumerate(ref.kv):
            keys = k0.new_zeros((len(hits), k0.shape[0], S, k0.shape[2]))
            values = v0.new_zeros((len(hits), v0.shape[0], S, v0.shape[2]))
            for b, (_, entry) in enumerate(hits):
                n = S - pads[b]
                if n > 0:
                    keys[b, :, pads[b] : S] = entry.kv[layer][0][:, :n]
                    values[b, :, pads[b] : S] = entry.kv[layer][1][:, :n]
            # On the device the layer stored them from: with a device map, each layer's own.
            cache.update(keys, values, layer)
        return cache

    def _store_prefixes(self, prompts, sampled, n_fed: Sequence[int], pads, cache, tags: list[str], store,
                        at: dict[int, int]) -> None:
        """Keep each row's KV: its prompt plus the `n_fed[b]` sampled tokens that were fed back.

        `at` maps batch positions of `cache` to the rows they hold (rows leave the batch when
        they are done, and are stored then). Row b's KV starts at slot pads[b]."""
        if self.prefix_cache.max_bytes <= 0:
            return
        for i, b in at.items():
            if store is not None and not store[b]:
                continue
            fed = sampled[b][: n_fed[b]]
            tokens = np.concatenate([prompts[b], np.asarray(fed, dtype=np.int64)])
            end = pads[b] + len(tokens)
            kv = [
                (layer.keys[i, :, pads[b] : end].clone(), layer.values[i, :, pads[b] : end].clone())
                for layer in cache.layers
            ]
            self.prefix_cache.store(tokens, kv, tags[b])


def cache_tag(interventions: Interventions, spans: dict[str, list[tuple[int, int]]]) -> str:
    """A row's prefix-cache tag: KV computed under a steer is reused only under the same steer and spans."""
    return f"{interventions.fingerprint()}|{sorted(spans.items())}" if interventions.fingerprint() else ""


def _check_decode(decode: str) -> None:
    if decode not in DECODE_MODES:
        raise DriftlabError(f"Unknown decode mode {decode!r}.", hint=f"Use one of {', '.join(DECODE_MODES)}.")


class _Decoding:
    """One call of `HFChatBackend._decode`: the batch's layout, cache and per-row progress.

    Each decode step is a method: `cancel` (rows whose client left), `sample` (the next token of
    every row, guidance mixed in), `take` (append it, end rows at EOS, a stop string or their
    limit), `compact` (drop finished rows from the batch), `feed` (one forward pass); `finish`
    stores the prefixes and builds the replies. Layout: row b = [pad * pads[b]] + prompt_b;
    with guidance the second half of the rows are the unconditional twins of the first half.
    """

    def __init__(self, backend: HFChatBackend, prompts: Sequence[Sequence[int]], sampling: Sampling, *,
                 seeds: Sequence[int] | None, interventions: Sequence[Interventions],
                 spans: Sequence[dict[str, list[tuple[int, int]]]], cache_store: Sequence[bool] | None,
                 guidance: float | None, logprobs: int | None, on_finish: Callable[[int, Reply], None] | None,
                 residual: Sequence[ResidualRow | None] | None = None, capture: bool = False,
                 keep_prefill: bool = False, compute_from: Sequence[int] | None = None,
                 row_max_tokens: Sequence[int] | None = None, gates: Sequence[dict | None] | None = None,
                 keep_logits: int = 1) -> None:
        if any(len(p) == 0 for p in prompts):
            raise DriftlabError("A prompt rendered to zero tokens.", hint="Give a non-empty conversation.")
        seeds = list(seeds) if seeds is not None else list(range(len(prompts)))
        if len(seeds) != len(prompts):
            raise DriftlabError(f"{len(seeds)} seeds given for {len(prompts)} conversations.")
        if guidance is not None and len(prompts) % 2:
            raise DriftlabError("Guided decoding needs an unconditional row for every conditional one.")
        self.backend, self.sampling, self.spans = backend, sampling, list(spans)
        self.cache_store = list(cache_store) if cache_store is not None else [True] * len(prompts)
        self.guidance, self.logprobs = guidance, logprobs
        self.prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
        B = len(self.prompts)
        self.real = B // 2 if guidance is not None else B  # rows whose replies are returned
        self.seeds = [int(s) for s in seeds]  # with a row's step, they fix its draws (chat/sampling.py)
        self.warpers = warpers(sampling)
        sampling.check_vocab(backend.shape.vocab_size)
        self.penalties = _Penalties(sampling, self.prompts[: self.real]) if sampling.penalized else None
        self.constraint = JsonConstraint(backend.tokenizer, backend.eos_ids, sampling.json_schema, self.real) \
            if sampling.json_schema is not None else None
        self.sampled: list[list[int]] = [[] for _ in range(B)]  # includes the EOS that ended a row
        self.scored: list[list[TokenLogprob]] = [[] for _ in range(B)]
        self.kept: list[list[torch.Tensor]] | None = None  # each step's logits per row (Reply.distributions)
        # Which batch positions are done, on the host: the loop decides from it without reading the
        # device (the step's one device-to-host copy is the sampled tokens, in `take`); a device
        # copy for `sample` is made again only when a row ends.
        self.finished = [False] * B
        self._finished_on_device: torch.Tensor | None = None
        self.reasons = ["length"] * B
        # Each row's token limit, and the decode step at which it joined the batch (continuous
        # batching: sampled[b][: n_fed - joined[b]] have their KV in the cache).
        self.limits = list(row_max_tokens) if row_max_tokens is not None else [sampling.max_new_tokens] * B
        self.joined = [0] * B
        self.gates = list(gates or []) + [None] * (B - len(gates or []))  # CFG's twins: none
        self.attention = [iv.attention() for iv in interventions]
        self.compute_from = compute_from
        self._layout(interventions, residual, capture, keep_prefill)
        # pi traces of a dynamic layout (decode steps only) are cut into each traced row's segments
        # whenever the batch's rows change (`_cut_traces`), so traced rows leave, join and finish
        # early like others, and join untraced batches (and untraced rows traced ones); a static
        # layout (trace buffer) and prefill traces stay per batch position.
        traced = self.state is not None and self.state.trace
        self.segmented = self.static is None and not (traced and self.state.config.trace_prefill)
        self.segments: list[list[torch.Tensor]] = [[] for _ in range(B)]
        # A row's reply is known when it finishes, unless pi traces built at the end are asked for.
        self.early = on_finish if not traced or self.segmented else None
        # Rows that are done leave the batch (dynamic cache only; a static cache keeps its shapes
        # for compiled steps): in a self-chat a few long replies would otherwise make every
        # finished row cost a forward pass per step until the longest ends. `live[i]` is the row
        # at batch position i; with guidance the first `n_cond` positions are conditional rows,
        # the rest their twins.
        self.compacting = backend.compact_rows and self.static is None and (not traced or self.segmented)
        self.live, self.n_cond = list(range(B)), self.real
        self.n_fed = 0  # decode steps run: sampled[b][:n_fed] have their KV in the cache
        self.logits = backend._forward(self.ids[:, self.S :], self.mask, self.positions[:, self.S :], self.cache,
                                       self.state, keep=keep_logits, residual=self.residual)[:B]  # [B, (keep,) V]

    def _layout(self, interventions: Sequence[Interventions], residual: Sequence[ResidualRow | None] | None,
                capture: bool, keep_prefill: bool = False) -> None:
        """Pads, the attention state, the cache (from the prefix cache where a prompt starts as a
        stored one), and the padded ids, mask and positions of the prompts.

        A static cache decodes a batch bucket (`batch_bucket`): the rows past the real ones repeat
        the last real row, their tokens and logits unused, so a batch of 3 or 4 runs one graph."""
        backend, sampling, prompts = self.backend, self.sampling, self.prompts
        B, T = len(prompts), max(len(p) for p in prompts)
        backend._check_context(T, sampling.max_new_tokens)
        self.static = static = backend._static
        self.inert = batch_bucket(B) - B if static is not None else 0

        def rows(values: Sequence) -> list:  # the model's rows: the real ones, then the inert ones
            return [*values, *[values[-1]] * self.inert]

        self.pads = pads = [T - len(p) for p in prompts]
        attention = self.attention
        length = T + sampling.max_new_tokens
        cache = None
        if static is not None:  # a static cache has `length` slots from the start: the state's layout spans them all
            cache = static.new_cache(B + self.inert, cache_length(length, backend.shape.max_context))
            length = static.length
        self.state = state = backend._state(rows(attention), rows(self.spans), rows(pads), T, length,
                                            prompts=rows(prompts))
        if static is not None and state is None and kernel_for(backend.device) == "flex":
            self.state = state = AttentionState.lean_layout(rows(pads), T, length, backend.shape.layers,
                                                            backend.shape.heads, backend.device)
        if static is not None and state is not None:
            state.decode_kernel = static.decode_kernel
            state.static_layout(static.arena, bias_slots(state.bias_heads.shape[0] if state.bias_heads is not None else 0))
        self.residual = None
        if capture or (residual is not None and any(r is not None for r in residual)):
            rows_in = list(residual) if residual is not None else [None] * B
            self.residual = ResidualState(rows(rows_in), backend.shape.layers, backend.d_model, backend.device,
                                          backend.model.dtype, capture=capture, keep_prefill=keep_prefill)
            self.residual.stop(range(B, B + self.inert))  # inert rows generate nothing
            if static is not None:
                self.residual.static_layout(static.arena)
        self.tags = [cache_tag(iv, sp) for iv, sp in zip(interventions, self.spans, strict=True)]
        # Under a prompt-scoped bias a generated token's KV differs from the same token's KV
        # as part of a later prompt (its keys were not biased): keep only prompt KV then.
        self.prompt_only = any(a is not None and a.prompt_scoped for a in attention)
        if state is not None and state.config.trace_prefill:
            hits = [(0, None)] * B  # every prompt query must be computed to be traced
        else:
            hits = [backend.prefix_cache.lookup(p, tag) for p, tag in zip(prompts, self.tags, strict=True)]
        if self.compute_from is not None:  # tokens whose residual stream is wanted are computed, not reused
            hits = [(min(n, self.compute_from[b]), e) for b, (n, e) in enumerate(hits)]
        self.S = min(pads[b] + min(hits[b][0], len(prompts[b]) - 1) for b in range(B))  # slots [0, S) are cached
        self.cache = backend._cache_from_hits(rows(hits), rows(pads), self.S, cache)
        ids = torch.full((B + self.inert, T), backend.pad_id, dtype=torch.long)
        mask = torch.zeros((B + self.inert, T), dtype=torch.long)
        for b, p in enumerate(rows(prompts)):
            ids[b, T - len(p) :] = torch.from_numpy(p)
            mask[b, T - len(p) :] = 1
        self.ids, mask = ids.to(backend.device), mask.to(backend.device)
        self.positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if static is not None:
            # One mask for every step: the slots after the prompt are visible once filled (and
            # hidden by causality until then), as the dynamic loop's growing mask of ones says.
            mask = torch.cat([mask, torch.ones((B + self.inert, length - T), dtype=mask.dtype, device=backend.device)],
                             dim=1)
        self.mask = mask

    @property
    def done(self) -> bool:
        return all(self.finished)

    def _end(self, i: int) -> None:
        self.finished[i] = True
        self._finished_on_device = None
        if self.residual is not None:
            self.residual.stop([i])

    def _finished_mask(self) -> torch.Tensor:
        if self._finished_on_device is None:
            self._finished_on_device = torch.tensor(self.finished, device=self.backend.device)
        return self._finished_on_device

    def _twin(self, i: int) -> int:
        return i + self.n_cond if self.guidance is not None else i

    def cancel(self, cancelled: Callable[[int], bool]) -> bool:
        """End the (conditional) rows whose request was cancelled, and their guidance twins; True
        when no row is left."""
        for i in [i for i in range(self.n_cond) if not self.finished[i]]:
            b = self.live[i]
            if cancelled(b):
                self._end(i)
                self._end(self._twin(i))
                self.reasons[b] = "cancelled"
                if self.early is not None:
                    self.early(b, self.reply(b))
        return self.done

    def sample(self) -> torch.Tensor:
        """The next token of every batch position (pad for finished ones); guidance twins get their
        row's token. Logit bias and penalties apply to the (mixed) logits, then a JSON constraint,
        then the warpers; the log-probabilities asked for are the model's, before all of them."""
        mixed = self.logits if self.guidance is None else guide(self.logits, self.guidance)
        rows = self.live[: self.n_cond]
        shaped = mixed if self.penalties is None else self.penalties(mixed, rows, self.sampled)
        if self.constraint is not None:  # JSON: the tokens its grammar does not allow next get -inf
            shaped = self.constraint(shaped, rows, self.sampled)
        drawn = sample(shaped, self.warpers, [self.seeds[b] for b in rows], [len(self.sampled[b]) for b in rows])
        nxt = drawn if self.guidance is None else torch.cat([drawn, drawn])
        if any(self.finished):
            nxt = torch.where(self._finished_mask(), torch.full_like(nxt, self.backend.pad_id), nxt)
        self._top = _top_logprobs(mixed, nxt[: self.n_cond], self.logprobs) if self.logprobs is not None else None
        if self.kept is not None:  # the model's own logits (a KL refuses guidance), views of this step's
            for i in range(self.n_cond):
                if not self.finished[i]:
                    self.kept[self.live[i]].append(self.logits[i])
        return nxt

    def take(self, nxt: torch.Tensor, on_token: Callable[[int, int], None] | None,
             on_logprob: Callable[[int, TokenLogprob], None] | None = None) -> None:
        """Append each running row's token; end rows at EOS, a stop string or their own limit."""
        backend, ignore_eos = self.backend, self.sampling.ignore_eos
        tokens = nxt.tolist()  # one device-to-host copy per step, not one per row
        running = [i for i, done in enumerate(self.finished) if not done]
        for i in running:
            b, tok = self.live[i], tokens[i]
            self.sampled[b].append(tok)
            if i < self.n_cond:
                if self._top is not None:
                    self.scored[b].append(self._top[i])
                    if on_logprob is not None:
                        on_logprob(b, self._top[i])
                if on_token is not None:
                    on_token(b, tok)
            if len(self.sampled[b]) >= self.limits[b]:
                self._end(i)
            if ignore_eos:
                continue
            if tok in backend.eos_ids or (backend.renderer.stop_strings and backend._hit_stop(self.sampled[b])):
                self._end(i)
                self.reasons[b] = "stop"
        if self.early is not None:
            for i in running:
                if i < self.n_cond and self.finished[i]:
                    self.early(self.live[i], self.reply(self.live[i]))

    def compact(self, nxt: torch.Tensor) -> torch.Tensor:
        """Drop finished rows from the batch once a quarter of it is done (one copy of the cache);
        their prefixes are stored first. Returns the next tokens of the rows kept."""
        self.positions = self.positions[:, -1:] + 1
        done = sum(self.finished[: self.n_cond])
        if not self.compacting or not done or 4 * done < self.n_cond:
            return nxt
        return nxt[self._drop_finished()]

    def _drop_finished(self) -> torch.Tensor:
        """Drop the finished rows (and their guidance twins) from the batch, their prefixes stored
        first; returns the batch positions kept, as an index."""
        keep = [i for i in range(self.n_cond) if not self.finished[i]]
        if self.guidance is not None:
            keep += [i + self.n_cond for i in keep]
        gone = sorted(set(range(len(self.live))) - set(keep))
        self._store(at={i: self.live[i] for i in gone})
        index = torch.tensor(keep, device=self.backend.device)
        self.cache.batch_select_indices(index)
        if self.state is not None:
            self._cut_traces()
            self.state.select_rows(keep)
        if self.residual is not None:
            self.residual.select_rows(keep)
        self.live = [self.live[i] for i in keep]
        self.n_cond = len(self.live) // 2 if self.guidance is not None else len(self.live)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.finished, self._finished_on_device = [self.finished[i] for i in keep], None
        if self.admissible and self._trim_left() and self.state is not None:  # only such a batch outlives its rows
            self._lay_out_state()
        return index

    @property
    def admissible(self) -> bool:
        """Rows can join this batch between steps (continuous batching): a dynamic cache of plain
        layers, and nothing laid out per batch position or across the whole batch: no guidance
        twins, pi trace, pi floor, JSON grammar, penalties or captured activations. (Floors are set
        after a layout, `AttentionState.has_floors`: laying the rows out again would lose them.)"""
        from transformers.cache_utils import DynamicLayer

        state, residual = self.state, self.residual
        return (self.static is None and self.guidance is None and self.constraint is None
                and self.penalties is None and self.compute_from is None
                and (state is None or not ((state.trace and not self.segmented) or state.has_floors
                                           or any(a.floors for a in state.rows)))
                and (residual is None or not (residual.capture or residual.keep_prefill))
                and all(type(layer) is DynamicLayer for layer in self.cache.layers))  # no sliding window

    def join(self, other: _Decoding) -> None:
        """Take `other`'s rows (prefilled, nothing sampled yet) into this running batch: its rows
        become rows len(prompts), ... here. Finished rows leave first; the shorter side's cache is
        padded on the left so that every row's next token lands in the same slot."""
        if not (self.admissible and other.admissible):
            raise DriftlabError("These rows cannot join the running batch (see _Decoding.admissible).")
        if any(self.finished):
            self.logits = self.logits[self._drop_finished()]
        gap = self.mask.shape[1] - other.mask.shape[1]
        (other if gap > 0 else self)._pad_left(abs(gap))
        if self.residual is not None or other.residual is not None:  # rows without a direction: inert
            self._residual().extend(other._residual())
        R = len(self.prompts)
        self.prompts += other.prompts
        self.sampled += other.sampled
        self.scored += other.scored
        if self.kept is not None:
            self.kept += [[] for _ in other.prompts]
        self.reasons += other.reasons
        self.seeds += other.seeds
        self.spans += other.spans
        self.tags += other.tags
        self.cache_store += other.cache_store
        self.limits += other.limits
        self.pads += other.pads
        self.attention += other.attention
        self.gates += other.gates
        self._cut_traces()
        other._cut_traces()
        self.segments += other.segments
        self.joined += [self.n_fed] * len(other.prompts)
        self.live += [R + b for b in other.live]
        self.finished += other.finished
        self._finished_on_device = None
        self.n_cond, self.real = len(self.live), len(self.prompts)
        self.prompt_only |= other.prompt_only
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys, mine.values = torch.cat([mine.keys, theirs.keys]), torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([self.mask, other.mask])
        self.positions = torch.cat([self.positions, other.positions[:, -1:]])
        self.logits = torch.cat([self.logits, other.logits])
        self._trim_left()
        if self.state is not None or other.state is not None:  # the rows' key slots moved
            self._lay_out_state()

    def _lay_out_state(self) -> None:
        """The attention state laid out again for the live rows' key slots (after a join or a trim)."""
        self.state = self.backend._resumed_state([self.attention[b] for b in self.live],
                                                 [self.spans[b] for b in self.live],
                                                 [self.pads[b] for b in self.live],
                                                 [len(self.prompts[b]) for b in self.live], self.mask.shape[1],
                                                 max(self.limits[b] - len(self.sampled[b]) for b in self.live))

    def _trim_left(self) -> bool:
        """Drop the key slots that no live row attends to: those left of every row's first token.
        A running batch that rows keep joining would otherwise keep the slots of rows long gone:
        its cache would grow with the batch's age, not with its rows' lengths, and every step
        would attend over it and copy it (a dynamic cache appends by concatenation). Returns
        whether anything was dropped."""
        first = min((self.pads[b] for b in self.live), default=0)
        if first <= 0:
            return False
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        self.mask = self.mask[:, first:]
        for b in self.live:
            self.pads[b] -= first
        return True

    def _residual(self) -> ResidualState:
        """The batch's residual state, made for rows that have no direction if it had none."""
        if self.residual is None:
            backend = self.backend
            self.residual = ResidualState([None] * len(self.prompts), backend.shape.layers, backend.d_model,
                                          backend.device, backend.model.dtype)
            self.residual.select_rows(self.live)
            self.residual.resume()
        return self.residual

    def _pad_left(self, n: int) -> None:
        """n empty slots before every row's keys (masked out): its tokens keep their positions."""
        if not n:
            return
        for layer in self.cache.layers:
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, n, 0))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, n, 0))
        self.mask = torch.nn.functional.pad(self.mask, (n, 0))
        for b in self.live:
            self.pads[b] += n  # the attention state is laid out again by `join`

    def feed(self, nxt: torch.Tensor) -> None:
        """One forward pass of the sampled tokens (the static cache's compiled step, or the dynamic one)."""
        backend = self.backend
        if self.static is not None:
            fed = torch.cat([nxt, nxt[-1:].expand(self.inert)]) if self.inert else nxt  # inert rows: any token
            self.logits = backend._static_step(fed[:, None], self.mask, self.positions, self.cache,
                                               self.state, self.residual)[: len(nxt)]
        else:
            ones = torch.ones((len(self.live), 1), dtype=self.mask.dtype, device=backend.device)
            self.mask = torch.cat([self.mask, ones], dim=1)
            self.logits = backend._forward(nxt[:, None], self.mask, self.positions, self.cache, self.state,
                                           residual=self.residual)
        self.n_fed += 1

    def _store(self, at: dict[int, int]) -> None:
        fed = [0 if self.prompt_only else self.n_fed - j for j in self.joined]
        self.backend._store_prefixes(self.prompts, self.sampled, fed, self.pads, self.cache, self.tags,
                                     self.cache_store, at=at)

    def reply(self, b: int, trace: Trace | None = None) -> Reply:
        backend, sampled = self.backend, self.sampled[b]
        if self.segmented and b < self.real:  # its pi so far (complete once the row is done)
            self._cut_traces()
            trace = backend._trace_of(self._trace_row(b), self.prompts[b], sampled, self.spans[b])
        # A final EOS ends the reply and is not part of it; with ignore_eos it is just a token.
        ended = not self.sampling.ignore_eos and sampled and sampled[-1] in backend.eos_ids
        toks = sampled[:-1] if ended else sampled
        text = backend.tokenizer.decode(toks, skip_special_tokens=True)
        if backend.renderer.stop_strings:
            text = backend.renderer.cut_stop(text)
        return Reply(text=text.strip(), n_tokens=len(toks), finish_reason=self.reasons[b], token_ids=toks,
                     trace=trace, n_prompt_tokens=len(self.prompts[b]), activation=self._activation(b),
                     gate=self.gates[b],
                     logprobs=self.scored[b][: len(toks)] if self.logprobs is not None else None,
                     end=self.scored[b][len(toks)] if ended and self.logprobs is not None else None,
                     distributions=self._distributions(b))

    def _distributions(self, b: int) -> Distributions | None:
        """Row b's kept logits as `Distributions` (None unless asked): one per sampled token."""
        if self.kept is None or b >= self.real or not self.kept[b]:
            return None
        ids = [*self.prompts[b].tolist(), *self.sampled[b]]
        return Distributions(ids, torch.log_softmax(torch.stack(self.kept[b]).float(), dim=-1).cpu())

    def _activation(self, b: int) -> dict[str, Any] | None:
        """Row b's projection summary (`Reply.activation`): complete once the row is done."""
        if self.residual is None or not self.residual.has[b]:
            return None
        return self.residual.summaries([b])[0]

    def _cut_traces(self) -> None:
        """Move the pi recorded since the last cut ([L, batch position, H, steps]) into each live row's
        segments: before rows leave or join, and before a reply is built, so that a row's trace
        never depends on where in the batch it sat."""
        state = self.state
        if not self.segmented or state is None or not state.records[0]:
            return
        stacked = torch.stack([torch.cat([r[..., -1:] for r in recs], dim=-1).to(state.device) for recs in state.records])
        for i, b in enumerate(self.live):
            if self.attention[b] is not None and self.attention[b].trace:  # the others' pi: computed, not asked
                self.segments[b].append(stacked[:, i])
        state.records = [[] for _ in range(state.n_layers)]

    def _trace_row(self, b: int) -> dict[str, torch.Tensor]:
        """Row b's `decode` pi [n_tokens, L, H] from its segments (as `AttentionState.row_traces`)."""
        if not self.segments[b]:
            return {}
        return {"decode": torch.cat(self.segments[b], dim=-1)[..., : len(self.sampled[b])].permute(2, 0, 1).cpu()}

    def finish(self) -> list[Reply]:
        """Store the prefixes still in the batch and return every row's reply (with its pi trace)."""
        self._store(at=dict(enumerate(self.live)))
        B = len(self.prompts)
        if self.segmented:
            return [self.reply(b) for b in range(B)]
        rows = self.state.row_traces([len(x) for x in self.sampled], self.pads) if self.state is not None else [{}] * B
        # Guidance twins (b >= real) are dropped by `generate`: no trace to build for them.
        return [self.reply(b, self.backend._trace_of(rows[b], self.prompts[b], self.sampled[b], self.spans[b])
                           if b < self.real else None) for b in range(B)]


def _top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability and its k most likely alternatives."""
    lp = torch.log_softmax(logits, dim=-1)
    own = lp.gather(-1, chosen[:, None])[:, 0].tolist()
    best = lp.topk(k, dim=-1) if k else None
    out = []
    for b, tok in enumerate(chosen.tolist()):
        alts = list(zip(best.indices[b].tolist(), best.values[b].tolist())) if best is not None else []
        out.append(TokenLogprob(tok, own[b], alts))
    return out


class _Penalties:
    """`logit_bias`, then the repetition, frequency and presence penalties (vLLM's definitions,
    see `Sampling`), over each row's own tokens. Applied before the greedy argmax or the warpers.

    Rows have ragged histories, so instead of transformers' processors (which read a
    rectangular `input_ids`) each row keeps a mask of its prompt's tokens and counts of its
    generated ones, updated with the tokens sampled since the last step; the repetition
    penalty is the same arithmetic as transformers' `RepetitionPenaltyLogitsProcessor`.
    """

    def __init__(self, sampling: Sampling, prompts: Sequence[np.ndarray]) -> None:
        self.sampling, self.prompts = sampling, prompts
        self.started = False  # the tensors below are built at the first step, on the logits' device
        self.counted = [0] * len(prompts)  # generated tokens of each row already in `counts`
        self.counts: torch.Tensor | None = None  # [rows, vocab]: each generated token's count (penalties only)
        self.in_prompt: torch.Tensor | None = None  # [rows, vocab]: the prompt's tokens (repetition penalty)
        self.bias: torch.Tensor | None = None  # [vocab]

    def _start(self, logits: torch.Tensor) -> None:
        sampling, (V, device) = self.sampling, (logits.shape[-1], logits.device)
        sampling.check_vocab(V)
        self.started = True
        if sampling.repetition_penalty != 1.0 or sampling.frequency_penalty or sampling.presence_penalty:
            self.counts = torch.zeros((len(self.prompts), V), dtype=logits.dtype, device=device)
        if sampling.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros((len(self.prompts), V), dtype=torch.bool, device=device)
            for b, p in enumerate(self.prompts):  # a tokenizer's added tokens may lie past the logits
                self.in_prompt[b, torch.from_numpy(p[p < V]).to(device)] = True
        if sampling.logit_bias:
            self.bias = torch.zeros(V, dtype=logits.dtype, device=device)
            ids, values = zip(*sampling.logit_bias, strict=True)
            self.bias[list(ids)] = torch.tensor(values, dtype=logits.dtype, device=device)

    def __call__(self, logits: torch.Tensor, rows: list[int], sampled: list[list[int]]) -> torch.Tensor:
        """`logits[i]` is row `rows[i]`'s; `sampled[b]` the tokens row b generated so far."""
        if not self.started:
            self._start(logits)
        if self.bias is not None:
            logits = logits + self.bias
        if self.counts is None:
            return logits
        new = [(b, t) for b in rows for t in sampled[b][self.counted[b] :]]
        for b in rows:
            self.counted[b] = len(sampled[b])
        if new:
            at, tokens = (torch.tensor(x, device=logits.device) for x in zip(*new, strict=True))
            self.counts.index_put_((at, tokens), torch.ones(len(new), dtype=self.counts.dtype,
                                                             device=logits.device), accumulate=True)
        sampling, index = self.sampling, torch.tensor(rows, device=logits.device)
        counts = self.counts[index]
        if self.in_prompt is not None:
            seen = self.in_prompt[index] | (counts > 0)
            p = sampling.repetition_penalty
            logits = torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)
        if sampling.frequency_penalty:
            logits = logits - sampling.frequency_penalty * counts
        if sampling.presence_penalty:
            logits = logits - sampling.presence_penalty * (counts > 0).to(logits.dtype)
        return logits
