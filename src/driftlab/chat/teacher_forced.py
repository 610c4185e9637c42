"""Reads of a local model over given tokens, sampling nothing: log-likelihoods, next-token
distributions, projections onto a persona's direction, and pi.

Why apart from the decode loop: these are one teacher-forced pass each (or a one-token `Decoding`
that only prefills), what lm-eval's scoring, the KLs, `driftlab project` and the `when-drifting`
gate read; `HFChatBackend` exposes each as a method of the same name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from driftlab.activation.state import ResidualRow, ResidualState
from driftlab.attention.state import AttentionConfig
from driftlab.chat import gate
from driftlab.chat.base import (
    Conversation,
    LogLikelihood,
    Rendered,
    Sampling,
    scored_pairs,
    system_of,
    validate_conversation,
    without_system,
)
from driftlab.chat.decoding import Decoding, cache_tag, new_cache
from driftlab.chat.guidance import guide
from driftlab.chat.trace import Trace, trace_of
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions
from driftlab.steering.interventions import Trace as TraceIntervention

# An `HFChatBackend`: the functions here are the bodies of its methods (importing the class would close a circle).
Backend = Any


@torch.inference_mode()
def loglikelihood(
    backend: Backend,
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
    backend.capabilities.require(backend.name, interventions)
    if "when-drifting" in interventions.kinds:  # each context scored under its own decision
        return gate.gated_loglikelihood(backend, contexts, continuations, interventions, batch_size)
    if "trace" in interventions.kinds:
        interventions = interventions.without("trace")  # nothing to return a trace in
    alpha = interventions.guidance()
    steers = interventions.residual() is not None and interventions.residual().steers
    # Nothing to record in a score: the residual stream matters here only where it is steered.
    residual = backend.residual_rows([system_of(c) for c in contexts], interventions) if steers else None
    rows, plain_rows, spans, n_cont = [], [], [], []
    for conv, rendered, cont_ids in scored_pairs(backend, contexts, continuations, interventions):
        rows.append(np.asarray(rendered.ids + cont_ids, dtype=np.int64))
        spans.append(rendered.spans())
        n_cont.append(len(cont_ids))
        if alpha is not None:
            plain_rows.append(np.asarray(backend.render(without_system(conv), interventions=interventions).ids + cont_ids))
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
        logprobs = row_logprobs(backend, [rows[i] for i in chunk], [spans[i] for i in chunk], interventions, keep,
                                conts, residual=[residual[i] for i in chunk] if residual is not None else None)
        if alpha is not None:  # rows end with the same continuation, so positions align from the end
            plain = row_logprobs(backend, [plain_rows[i] for i in chunk], [{} for _ in chunk], interventions, keep,
                                 conts)
            logprobs = torch.log_softmax(guide(torch.cat([logprobs, plain]), alpha), dim=-1)
        for b, group in enumerate(groups[start : start + batch_size]):
            for i in group:
                n = n_cont[i]
                lp = logprobs[b, -n - 1 : -1]  # positions predicting the continuation tokens
                target = torch.from_numpy(rows[i][-n:]).to(lp.device)
                picked = lp.gather(-1, target[:, None])[:, 0]
                out[i] = LogLikelihood(float(picked.sum()), n, bool((lp.argmax(-1) == target).all()))
    return [out[i] for i in range(len(rows))]


def row_logprobs(backend: Backend, rows, spans, interventions: Interventions, keep: int, n_cont,
                 residual: Sequence[ResidualRow | None] | None = None) -> torch.Tensor:
    """Log-softmax of the last `keep` positions of each left-padded row: [B, keep, V].

    The last `n_cont[b]` tokens of row b are its continuation: the attention engine
    treats them as generated tokens (they are what a reply would have generated)."""
    T = max(len(r) for r in rows)
    pads = [T - len(r) for r in rows]
    backend._check_context(T, 0)
    ids = torch.full((len(rows), T), backend.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, pads[b] :] = torch.from_numpy(r)
        mask[b, pads[b] :] = 1
    ids, mask = ids.to(backend.device), mask.to(backend.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    state = backend._state([interventions.attention()] * len(rows), spans, pads, T, T, ends=[T - n for n in n_cont],
                           prompts=rows)
    rstate = ResidualState(residual, backend.shape.layers, backend.d_model, backend.device, backend.model.dtype) \
        if residual is not None else None
    logits = backend._forward(ids, mask, positions, new_cache(backend.model), state, keep=keep, residual=rstate)
    return torch.log_softmax(logits, dim=-1)


@torch.inference_mode()
def prompt_logprobs(backend: Backend, prompts: Sequence[Rendered], keep: Sequence[int], *,
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
    for group in backend.prefix_cache.plan(ids, tags, [len(p.ids) - k for p, k in zip(prompts, keep, strict=True)]):
        rows, keeps = [prompts[b] for b in group], [keep[b] for b in group]
        run = Decoding(backend, [p.ids for p in rows], Sampling(greedy=True, max_new_tokens=1), seeds=None,
                       interventions=[interventions] * len(rows), spans=[p.spans() for p in rows],
                       cache_store=[store[b] for b in group], guidance=None, logprobs=None, on_finish=None,
                       residual=backend.residual_rows([None] * len(rows), interventions)
                       if interventions.residual() else None,
                       compute_from=[len(p.ids) - k for p, k in zip(rows, keeps, strict=True)],
                       keep_logits=max(keeps))
        run._store(at=dict(enumerate(run.live)))
        logits = run.logits if run.logits.dim() == 3 else run.logits[:, None]
        for j, (b, k) in enumerate(zip(group, keeps, strict=True)):
            out[b] = torch.log_softmax(logits[j, logits.shape[1] - k :].float(), dim=-1).cpu()
    return out


@torch.inference_mode()
def project_prompts(backend: Backend, prompts: Sequence[Rendered], systems: Sequence[str | None], *,
                    compute_from: Sequence[int] | None = None,
                    cache_store: Sequence[bool] | None = None) -> list[tuple[int, torch.Tensor]]:
    """Teacher-forced projections of rendered prompts onto their personas' directions: per row,
    (j0, [T - j0, L] float32) with row j of the tensor the normalised projection (0: like without
    the system prompt, 1: like with it) of the residual stream at token j0 + j, per layer. Tokens
    before j0 came from the prefix cache (a prompt extending one seen before computes only its
    new tokens), never past `compute_from[b]` (default 0: every token); the last token is always
    computed. `systems[b]` picks row b's direction."""
    if backend.directions is None:
        raise DriftlabError(f"Projections need persona directions, and {backend.name} was given none.",
                            hint="Pass --directions DIR (from driftlab directions).")
    rows = backend.residual_rows(systems, Interventions())
    missing = [i for i, r in enumerate(rows) if r is None]
    if missing:
        raise DriftlabError(f"Prompt {missing[0]} has a system prompt the directions at {backend.directions.path} "
                            "hold no direction for.", hint="Compute directions for it (driftlab directions).")
    run = Decoding(backend, [p.ids for p in prompts], Sampling(greedy=True, max_new_tokens=1), seeds=None,
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
def trace(backend: Backend, conversation: Conversation, *, interventions: Interventions | None = None,
          add_generation_prompt: bool | None = None) -> Trace:
    """pi over a conversation as the model reads it, without generating: one prefill pass.

    Why a read of its own: a drift study often asks where attention sits over a given
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
    backend.capabilities.require(backend.name, iv)
    validate_conversation(conversation, 0)
    iv = Interventions.of(*iv.without("trace", "cfg").items, TraceIntervention(prefill=True))
    conv = iv.model_view(conversation)
    if add_generation_prompt is None:
        add_generation_prompt = conv[-1]["role"] != "assistant"
    rendered = backend.render(conv, add_generation_prompt, interventions=iv)
    if not rendered.ids:
        raise DriftlabError("The conversation rendered to zero tokens.", hint="Give a non-empty conversation.")
    T = len(rendered.ids)
    backend._check_context(T, 0)
    ids = torch.tensor([rendered.ids], dtype=torch.long, device=backend.device)
    mask = torch.ones_like(ids)
    positions = torch.arange(T, device=backend.device)[None]
    spans = rendered.spans()
    state = backend._state([iv.attention()], [spans], [0], T, T, prompts=[rendered.ids])
    backend._forward(ids, mask, positions, new_cache(backend.model), state)
    return trace_of(backend.tokenizer, state.row_traces([0], [0])[0], rendered.ids, [], spans)


def drift_ratio(backend: Backend, rendered: Rendered) -> float:
    """pi_t / pi_1 of a rendered conversation: the attention mass on its system prompt at its
    last token (where the next reply starts) over that at its first turn's last token, each
    the mean over layers and heads of plain attention (1 at the first turn; lower: drifted).
    What `when-drifting` decides by; the first turn's pi is kept, so a dialog pays one traced
    prefill a turn."""
    spans = rendered.spans()
    end = gate.first_turn_end(spans)
    plain = AttentionConfig()
    first = pi_first(backend, tuple(rendered.ids[:end]), spans, plain).mean()
    now = pi_first(backend, tuple(rendered.ids), spans, plain).mean()
    return float(now / first)


def projection_drift(backend: Backend, rendered: Rendered, system: str | None) -> tuple[float, float]:
    """The residual stream's normalised projection onto the persona's direction (0: like without
    the system prompt, 1: like with it), mean over the direction's band, at the first turn's
    last token and at the conversation's last token (where the next reply starts): what
    `when-drifting:by=projection` compares. One prefill from the first turn's last token on
    (what precedes it comes from the prefix cache when a dialog asked before)."""
    end = gate.first_turn_end(rendered.spans())
    direction = gate.gate_direction(backend.directions, system, backend.name)
    ((start, values),) = project_prompts(backend, [rendered], [system], compute_from=[end - 1])
    band = list(direction.band)

    def at(j: int) -> float:
        return float(values[j - start, band].mean())

    return at(end - 1), at(len(rendered.ids) - 1)


def pi_first(backend: Backend, tokens: tuple[int, ...], spans, config: AttentionConfig) -> torch.Tensor:
    """[L, H] pi at the last of `tokens` (a first turn), under `config` without its floor; kept
    per tokens and config (a dialog's later turns ask again)."""
    key = (tokens, config.model_copy(update={"pi_floor": 0.0}).model_dump_json())
    held = backend._pi_firsts.get(key)
    if held is None:
        traced = AttentionConfig(**{**config.model_dump(), "pi_floor": 0.0, "trace": True, "trace_prefill": False})
        T = len(tokens)
        state = backend._state([traced], [{k: v for k, v in spans.items() if k != "first_turn"}], [0], T, T)
        ids = torch.tensor([tokens], dtype=torch.long, device=backend.device)
        positions = torch.arange(T, device=backend.device)[None]
        backend._forward(ids, torch.ones_like(ids), positions, new_cache(backend.model), state)
        held = backend._pi_firsts[key] = torch.stack([r[-1][0, :, -1] for r in state.records]).float().cpu()
        while len(backend._pi_firsts) > 4096:
            backend._pi_firsts.pop(next(iter(backend._pi_firsts)))
    return held


def floors(backend: Backend, rows: Sequence[AttentionConfig], spans, prompts,
           check_only: bool = False) -> tuple[torch.Tensor, list[int]]:
    """pi-floor's values [B, L, H] (F times each row's pi_1, the attention mass on its system
    prompt at its first turn's last prompt token) and first queries (the token after it);
    `check_only`: only the one-line errors, no pass."""
    values = torch.zeros(len(rows), backend.shape.layers, backend.shape.heads)
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
            values[b] = config.pi_floor * pi_first(backend, tuple(prompts[b][:end]), row_spans, config)
        first[b] = end
    return values, first
