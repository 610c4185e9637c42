"""One batch of the local backend's decode loop (`HFChatBackend._decode`), as a state object.

Why a class of its own: a decode step mixes sampling, stopping, the batch's layout in the KV cache,
rows leaving and joining, and the prefix cache; each is a small method of `Decoding`, and the loop
that drives them (`HFChatBackend._decode`) stays a few lines. The prefix cache's KV goes in and out
of transformers' caches here (`kv_from_hits`, `store_prefixes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from driftlab.activation.state import ResidualRow, ResidualState
from driftlab.attention.engine import kernel_for
from driftlab.attention.state import AttentionState
from driftlab.chat.base import Distributions, Reply, Sampling, TokenLogprob
from driftlab.chat.constrain import JsonConstraint
from driftlab.chat.guidance import guide
from driftlab.chat.prefix_cache import PrefixCache
from driftlab.chat.sampling import sample, warpers
from driftlab.chat.static_decode import batch_bucket, bias_slots, cache_length
from driftlab.chat.trace import Trace, trace_of
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

# The `HFChatBackend` whose `_decode` drives a `Decoding` (importing the class would close a circle).
Backend = Any


def cache_tag(interventions: Interventions, spans: dict[str, list[tuple[int, int]]]) -> str:
    """A row's prefix-cache tag: KV computed under a steer is reused only under the same steer and spans."""
    return f"{interventions.fingerprint()}|{sorted(spans.items())}" if interventions.fingerprint() else ""


def new_cache(model):
    """An empty dynamic KV cache for `model`."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def reusable(config) -> bool:
    """Prefix reuse needs plain full-attention layers (sliding windows drop old keys)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    use_sw = getattr(config, "use_sliding_window", window is not None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not (window and use_sw)


def pad_id(tokenizer, model, eos_ids) -> int:
    """The token that pads a row: the tokenizer's or the generation config's pad token, else an EOS."""
    for cand in (tokenizer.pad_token_id, model.generation_config.pad_token_id):
        if isinstance(cand, int):
            return cand
    return min(eos_ids) if eos_ids else 0


def hit_stop(backend: Backend, tokens: list[int]) -> bool:
    """Whether a row's last tokens hold one of the renderer's stop strings (a model without a chat template)."""
    tail = backend.tokenizer.decode(tokens[-8:], skip_special_tokens=True)
    return any(s in tail for s in backend.renderer.stop_strings)


def kv_from_hits(model, hits, pads: list[int], S: int, cache=None):
    """A cache holding slots [0, S) from the prefix-cache hits: a new dynamic one, or the
    empty `cache` given (a `StaticCache`, whose `update` writes slots [0, S) in place)."""
    cache = new_cache(model) if cache is None else cache
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


def store_prefixes(prefix_cache: PrefixCache, prompts, sampled, n_fed: Sequence[int], pads, cache, tags: list[str],
                   store, at: dict[int, int]) -> None:
    """Keep each row's KV: its prompt plus the `n_fed[b]` sampled tokens that were fed back.

    `at` maps batch positions of `cache` to the rows they hold (rows leave the batch when
    they are done, and are stored then). Row b's KV starts at slot pads[b]."""
    if prefix_cache.max_bytes <= 0:
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
        prefix_cache.store(tokens, kv, tags[b])


class Decoding:
    """One call of `HFChatBackend._decode`: the batch's layout, cache and per-row progress.

    Each decode step is a method: `cancel` (rows whose client left), `sample` (the next token of
    every row, guidance mixed in), `take` (append it, end rows at EOS, a stop string or their
    limit), `compact` (drop finished rows from the batch), `feed` (one forward pass); `finish`
    stores the prefixes and builds the replies. Layout: row b = [pad * pads[b]] + prompt_b;
    with guidance the second half of the rows are the unconditional twins of the first half.
    """

    def __init__(self, backend: Backend, prompts: Sequence[Sequence[int]], sampling: Sampling, *,
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
        self.penalties = Penalties(sampling, self.prompts[: self.real]) if sampling.penalized else None
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
        self.cache = kv_from_hits(backend.model, rows(hits), rows(pads), self.S, cache)
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
        self._top = top_logprobs(mixed, nxt[: self.n_cond], self.logprobs) if self.logprobs is not None else None
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
            if tok in backend.eos_ids or (backend.renderer.stop_strings and hit_stop(backend, self.sampled[b])):
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

    def join(self, other: Decoding) -> None:
        """Take `other`'s rows (prefilled, nothing sampled yet) into this running batch: its rows
        become rows len(prompts), ... here. Finished rows leave first; the shorter side's cache is
        padded on the left so that every row's next token lands in the same slot."""
        if not (self.admissible and other.admissible):
            raise DriftlabError("These rows cannot join the running batch (see Decoding.admissible).")
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
        store_prefixes(self.backend.prefix_cache, self.prompts, self.sampled, fed, self.pads, self.cache, self.tags,
                                     self.cache_store, at=at)

    def reply(self, b: int, trace: Trace | None = None) -> Reply:
        backend, sampled = self.backend, self.sampled[b]
        if self.segmented and b < self.real:  # its pi so far (complete once the row is done)
            self._cut_traces()
            trace = trace_of(backend.tokenizer, self._trace_row(b), self.prompts[b], sampled, self.spans[b])
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
        return [self.reply(b, trace_of(self.backend.tokenizer, rows[b], self.prompts[b], self.sampled[b], self.spans[b])
                           if b < self.real else None) for b in range(B)]


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability and its k most likely alternatives."""
    lp = torch.log_softmax(logits, dim=-1)
    own = lp.gather(-1, chosen[:, None])[:, 0].tolist()
    best = lp.topk(k, dim=-1) if k else None
    out = []
    for b, tok in enumerate(chosen.tolist()):
        alts = list(zip(best.indices[b].tolist(), best.values[b].tolist())) if best is not None else []
        out.append(TokenLogprob(tok, own[b], alts))
    return out


class Penalties:
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
