"""vLLM's batch, mapped onto driftlab's per-row state: one `StepPlan` per forward pass.

vLLM runs a flat batch: the scheduled tokens of every request back to back (`query_start_loc`),
each request's keys in the paged KV cache (`block_table`, `seq_lens`), requests in the order of
the model runner's input batch (`input_batch.req_ids`). A plan, built at the first driftlab call
of a pass (an attention layer), finds the requests that carry a `SteerPayload` and lays them out
the way driftlab's state objects expect a batch:

* attention: steered rows form a group per kind (decode rows that only trace, decode rows that steer,
  prompts), each with an `AttentionState` and a key mask over its keys, gathered from the paged
  cache into the transformers engine's [B, Hkv, K, d] layout; `attention.engine.driftlab_attention`
  computes them as it does for the transformers engine (key biases, split-softmax, pi floor, pi),
  and rows that only trace get pi from each layer's logits after the pass (`AttentionGroup.stash`);
* the residual stream: each steered row's tokens and its direction (`steer_stream`, the one
  definition of vector and cap), and the last token of each row, whose projection is recorded.

What a pass recorded (pi per layer and head, projections, activations) is folded into the
requests' `Record`s when the pass is over (the next plan, or `Engine.take`), for the steps that
produced a token: a prompt's last chunk and every decode step.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from driftlab.activation.state import ResidualRow, steer_stream
from driftlab.attention.config import AttentionConfig
from driftlab.attention.kernels import (
    boost_keys,
    decode_lses,
    decode_system_parts,
    split_softmax,
    system_pi,
    system_share,
)
from driftlab.attention.state import AttentionState
from driftlab.chat.vllm_engine.payload import KEY, SteerPayload
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions


@dataclass
class Record:
    """What the worker recorded of one request, per step that produced a token, until the driftlab
    process takes it (`Engine.take`). Per step, not summed: the backend keeps the first n, the
    steps of the n tokens the request returned (an engine that schedules ahead may run one more)."""

    pi: list[torch.Tensor] = field(default_factory=list)  # [L, H] at the query predicting each token
    prefill_pi: list[torch.Tensor] = field(default_factory=list)  # prompt chunks: [q, L, H] (trace:prefill)
    proj: list[torch.Tensor] = field(default_factory=list)  # [L] at the position predicting each token
    prefill_proj: list[torch.Tensor] = field(default_factory=list)  # prompt chunks: [q, L] (keep_prefill)
    acts: list[torch.Tensor] = field(default_factory=list)  # [L, d] hidden state there (capture)
    # keep_logits: the next-token log-distribution [V] at each kept prompt position, by position (a prompt
    # split into chunks arrives in pieces; one computed again after a preemption replaces its own)
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The non-empty fields, stacked (steps first) or, for prompt chunks, concatenated."""
        out = {name: torch.stack(getattr(self, name)) for name in ("pi", "proj", "acts") if getattr(self, name)}
        out.update({name: torch.cat(getattr(self, name)) for name in ("prefill_pi", "prefill_proj")
                    if getattr(self, name)})
        if self.logprobs:
            out["logprobs"] = torch.stack([self.logprobs[at] for at in sorted(self.logprobs)])
        return out


@dataclass(frozen=True)
class Parsed:
    """A payload read once: its attention config (None: plain attention) and residual row (None: no
    direction), kept per payload (a request's payload is the same at every step)."""

    payload: SteerPayload
    attention: AttentionConfig | None
    residual: ResidualRow | None


@dataclass
class Row:
    """One steered request in this pass: where its tokens are and what they are."""

    index: int  # its position in vLLM's batch
    parsed: Parsed
    start: int  # its tokens in the flat batch: [start, start + q)
    q: int
    seq_len: int  # its keys after this step
    produces: bool  # this step's last query predicts a token (the prompt is complete)
    prompt_queries: int  # how many of this step's queries are prompt tokens (a prefill's: all)

    @property
    def first_step(self) -> bool:
        return self.seq_len == self.q


class AttentionGroup:
    """Steered rows of one pass, laid out as the transformers engine lays out a batch: row b's keys at
    slots [pads[b], pads[b] + seq_len), its queries the last of them.

    Decode rows (one query each) form right-padded groups (pads 0): their keys come from the paged
    cache whole blocks at a time (one contiguous copy per block, `gather`), which a per-token gather
    would take several times as long over; the key mask hides each row's tail. The other rows (a
    prompt's first pass, or the new part of a prompt whose prefix was cached) form one left-padded
    group, as the engine's causal prefill path expects: q is the most queries of any row, every row's
    queries end at the last slot, and a row with fewer fills the front with queries whose results are
    dropped (`real`)."""

    def __init__(self, rows: list[Row], block_table: torch.Tensor, block_size: int, n_layers: int, n_heads: int,
                 device: torch.device, scratch: Callable[[str, tuple, torch.dtype], torch.Tensor],
                 shard: tuple[int, int] | None = None) -> None:
        """`scratch(name, shape, dtype)` lends a buffer kept from pass to pass (`Engine.scratch`); `n_heads`
        the model's query heads, of which this worker holds `shard` (tensor parallelism; None: all)."""
        self.rows, self.scratch = rows, scratch
        # Rows that only read pi at their last query (trace, no steer, no prompt tracing): the kernel's output
        # stands; only that query's log-sum-exps are computed (`attention.kernels.decode_lses`), from the keys
        # alone, on a prompt's pass as on a decode step.
        self.reads_only = all(_reads_last(r) for r in rows)
        self.decode = self.reads_only or all(r.q == 1 for r in rows)  # one query per row
        # Decode rows whose steer only reweights one set of keys' share (split-softmax, the pi floor, InstABoost: the
        # system keys; untraced PASTA: the keys it spares): the kernel's output stands and is reweighted
        # (`reweight`), with no second attention over every key.
        self.reweights = not self.reads_only and all(_reweights(r) for r in rows)
        q = 1 if self.decode else max(r.q for r in rows)
        K = max(r.seq_len for r in rows)
        lengths = torch.tensor([r.seq_len for r in rows])
        pads = [0] * len(rows) if self.decode else [K - r.seq_len for r in rows]
        configs = [r.parsed.attention or AttentionConfig() for r in rows]
        spans = [r.parsed.payload.spans for r in rows]
        state = AttentionState(configs, spans, n_layers, n_heads, device, shard=shard)
        state.on_layout(pads, K, K, ends=[p + r.parsed.payload.prompt_len for p, r in zip(pads, rows, strict=True)])
        if any(r.parsed.payload.floors is not None for r in rows):
            values = torch.zeros(len(rows), n_layers, n_heads)  # the model's heads (set_floors takes its shard)
            for b, r in enumerate(rows):
                if r.parsed.payload.floors is not None:
                    values[b] = torch.tensor(r.parsed.payload.floors)
            state.set_floors(values, [r.parsed.payload.first_query for r in rows])
        if not all(r.first_step for r in rows):
            state.resume()  # a decode step (or a later chunk): not the call's prefill
        state.forward_kwargs(K)
        self.state, self.q, self.K, self.block_size = state, q, K, block_size
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None  # a reads-only group's queries and keys (`stash`)
        table = block_table[[r.index for r in rows]].to(torch.long)  # [B, max blocks]
        slot = torch.arange(K)[None, :]
        # Query j of the group is row b's query j - (q - q_b): a real one from there on (`real`); with one query
        # per row, each row's last.
        lead = torch.tensor([q - min(q, r.q) for r in rows])[:, None]
        starts = torch.tensor([r.start + r.q - min(q, r.q) for r in rows])[:, None]
        self.real = torch.arange(q)[None, :] >= lead  # [B, q]
        self.queries = (starts + (torch.arange(q)[None, :] - lead).clamp_min(0)).to(device)  # [B, q] the flat batch's
        # token of each (a dropped one: the row's first)
        self.real = self.real.to(device)
        if self.decode:
            n_blocks = -(-K // block_size)
            used = torch.arange(n_blocks)[None, :] < (-(-lengths // block_size))[:, None]
            self.blocks = torch.where(used, table[:, :n_blocks], 0).flatten().to(device)  # [B * n_blocks]
            self.visible = (slot < lengths[:, None]).to(device)  # [B, K]
            self.mask = self.visible[:, None, None, :]  # [B, 1, 1, K]
            if self.reweights:
                self.lift_keys, self.lift = state.lifted()  # [B, K] the keys reweighted, [B, L, H] a bias on them
                # The values of the blocks up to every row's last reweighted key suffice (the system keys: a prefix;
                # PASTA's at scope=prompt: the reply too, so every block).
                held = self.lift_keys & self.visible
                self.value_slots = max(1, int(held.any(0).nonzero().max()) + 1) if bool(held.any()) else 1
                n_values = -(-self.value_slots // block_size)
                self.value_block_ids = self.blocks.view(len(rows), n_blocks)[:, :n_values].flatten()
            return
        token = slot - torch.tensor(pads)[:, None]  # [B, K] token index per slot
        present = token >= 0
        token = token.clamp_min(0)
        self.block = torch.where(present, table.gather(1, token // block_size), 0).to(device)
        self.offset = torch.where(present, token % block_size, 0).to(device)
        query_slots = torch.arange(K - q, K)[:, None]  # [q, 1]
        self.mask = (present[:, None, :] & (slot[None] <= query_slots[None])).to(device)[:, None]

    def first_real(self, b: int) -> int:
        """Index of row b's first real query among the group's q."""
        return self.q - min(self.q, self.rows[b].q)

    def stash(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> None:
        """A reads-only group's layer: its rows' queries and key blocks copied aside (two small copies), and
        after the last layer pi of every layer at once (`_layers_pi`): one batched computation a pass instead
        of a dozen small ops in each layer, which is what a trace costs on a small model."""
        keys, _ = cache_regions(kv_cache)
        if self.kept is None:
            L = self.state.n_layers
            self.kept = (self.scratch("queries", (L, len(self.rows), *query.shape[1:]), query.dtype),
                         self.scratch("keys", (L, len(self.blocks), *keys.shape[1:]), keys.dtype))
        torch.index_select(query, 0, self.queries[:, 0], out=self.kept[0][layer])
        torch.index_select(keys, 0, self.blocks, out=self.kept[1][layer])
        if layer == self.state.n_layers - 1:
            self._layers_pi(scale)

    def _layers_pi(self, scale: float) -> None:
        """pi [B, H] of every layer from the kept queries and key blocks (`attention.kernels.decode_lses`)."""
        query, blocks = self.kept
        L, B, (n_kv, d, bs) = query.shape[0], len(self.rows), blocks.shape[2:]
        lse_all, lse_sys = decode_lses(query.view(L, B, n_kv, -1, d), blocks.view(L, B, -1, n_kv, d, bs), self.visible,
                                       self.state.system_keys, scale)
        pi = system_pi(lse_all, lse_sys).reshape(L, B, -1, 1)
        for layer in range(L):
            self.state.record(layer, pi[layer])

    def reweight(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                 scale: float) -> None:
        """A reweighting group's layer: the kernel's all-keys output O of each row's query, the LSEs over all
        keys and over the keys reweighted (the system keys; PASTA's: the keys it spares) from the keys alone,
        and those keys' output from their values alone (`attention.kernels.decode_system_parts`); then a key
        bias on them (`boost_keys`), and `split_softmax`, the transformers engine's own epilogue, with its
        strengths and floors, and pi recorded where traced."""
        keys, values = cache_regions(kv_cache)
        B, n_kv, d, bs = len(self.rows), keys.shape[1], keys.shape[2], self.block_size
        k = torch.index_select(keys, 0, self.blocks, out=self.scratch("k.blocks", (len(self.blocks), *keys.shape[1:]),
                                                                       keys.dtype)).view(B, -1, n_kv, d, bs)
        S = self.value_slots
        v = torch.index_select(values, 0, self.value_block_ids,
                               out=self.scratch("v.lifted", (len(self.value_block_ids), *values.shape[1:]), values.dtype))
        v = v.view(B, -1, n_kv, bs, d).transpose(1, 2).reshape(B, n_kv, -1, d)[:, :, :S]
        at = self.queries[:, 0]
        lse_all, lse_set, o_set = decode_system_parts(query[at].view(B, n_kv, -1, d), k, self.visible,
                                                      self.lift_keys, v, scale)
        H = query.shape[1]
        pi, rest = system_share(lse_all.reshape(B, H, 1), lse_set.reshape(B, H, 1))
        o_set = o_set.reshape(B, H, 1, -1)
        new = output[at].view(B, H, 1, -1)
        if self.state.biases_on(layer):  # the bias first, as the engine adds it to the logits: pi becomes its pi
            new, pi, rest = boost_keys(new, o_set, pi, rest, self.lift[:, layer, :, None, None])
        device = query.device
        split = self.state.split_strength(layer, device)
        floor = self.state.layer_floor(layer, 1, device)
        if split is not None or floor is not None:
            if split is None:  # a floor alone: strength 1 on every head
                split = self.state.on("split_table", device)[:, layer]
            new = split_softmax(new, o_set, pi, rest, split, floor)
        output[at] = new.view(B, H, -1).to(output.dtype)
        if self.state.trace:
            self.state.record(layer, pi[..., 0])

    def gather(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values [B, Hkv, K, d] from vLLM's CPU cache (`cache_regions`)."""
        keys, values = cache_regions(kv_cache)
        if not self.decode:
            return keys[self.block, :, :, self.offset].transpose(1, 2), values[self.block, :, self.offset].transpose(1, 2)
        B, n_kv, d, bs = len(self.rows), keys.shape[1], keys.shape[2], self.block_size
        n = len(self.blocks)
        k = torch.index_select(keys, 0, self.blocks, out=self.scratch("k.blocks", (n, *keys.shape[1:]), keys.dtype))
        v = torch.index_select(values, 0, self.blocks, out=self.scratch("v.blocks", (n, *values.shape[1:]), values.dtype))
        # Keys laid out d-contiguous (one copy): torch's fused CPU attention computes wrong outputs from keys
        # whose last dimension is strided, as a view of the transposed cache would be (seen here, torch 2.13).
        k = k.view(B, -1, n_kv, d, bs).permute(0, 2, 1, 4, 3)  # [B, Hkv, n, bs, d]
        k = self.scratch("k", k.shape, k.dtype).copy_(k).view(B, n_kv, -1, d)[:, :, : self.K]
        v = v.view(B, -1, n_kv, bs, d).transpose(1, 2)
        return k, v.reshape(B, n_kv, -1, d)[:, :, : self.K]


def _reweights(row: Row) -> bool:
    """Whether a decode row's steer only reweights the share of attention of one set of keys:
    `AttentionGroup.reweight` serves it. That is split-softmax, the pi floor and key biases on the system
    keys alone (InstABoost), with or without a trace; or PASTA alone, untraced (its set is the keys it
    spares, not the system keys whose pi a trace records)."""
    config = row.parsed.attention
    if row.q != 1 or not config.changes_outputs or any(config.shared()):
        return False
    return config.boosts_system or (config.spares_one_span and not (config.splits or config.floors or config.trace))


def _reads_last(row: Row) -> bool:
    """Whether a row's attention only reads pi at its last query (`AttentionGroup.reads_only`)."""
    config = row.parsed.attention
    return not config.changes_outputs and not any(config.shared())


def cache_regions(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU KV cache [blocks, Hkv, block_size, 2 d] as its kernel lays it out ('vec' ISA): per block
    and head, the keys transposed [d, block_size], then the values [block_size, d]. Returns views
    ([blocks, Hkv, d, block_size], [blocks, Hkv, block_size, d]); `Engine.check_layout` verifies them."""
    n_blocks, n_kv, block_size, two_d = kv_cache.shape
    d = two_d // 2
    regions = kv_cache.view(n_blocks, n_kv, 2, block_size * d)
    return regions[:, :, 0].view(n_blocks, n_kv, d, block_size), regions[:, :, 1].view(n_blocks, n_kv, block_size, d)


class ResidualPlan:
    """The residual stream's part of a pass: the tokens of rows with a direction, their rows' knobs per
    token, and each row's last token (whose projection is recorded)."""

    def __init__(self, rows: list[Row], n_layers: int, device: torch.device, dtype: torch.dtype) -> None:
        self.rows = rows
        tokens, owner = [], []
        for i, r in enumerate(rows):
            tokens.append(torch.arange(r.start, r.start + r.q))
            owner.append(torch.full((r.q,), i))
        self.tokens = torch.cat(tokens).to(device)  # [n] flat-batch index of every token of these rows
        owner_t = torch.cat(owner)
        self.last = torch.tensor([r.start + r.q - 1 for r in rows], device=device)  # [R]
        self.last_local = torch.tensor([sum(x.q for x in rows[: i + 1]) - 1 for i in range(len(rows))], device=device)
        unit = torch.stack([r.parsed.residual.unit for r in rows]).float()  # [R, L, d]
        add = torch.stack([r.parsed.residual.add for r in rows])  # [R, L]
        tau = torch.stack([r.parsed.residual.tau for r in rows])
        self.unit = unit.to(device)
        self.unit_h = self.unit.to(dtype)
        self.unit_tok = unit[owner_t].to(device)  # [n, L, d]
        self.unit_tok_h = self.unit_tok.to(dtype)
        self.add_tok = add[owner_t].to(device=device, dtype=dtype)  # [n, L]
        self.tau_tok = tau[owner_t].to(device)
        self.adds = (add != 0).any(0).tolist()  # per layer: some row adds or caps there
        self.caps = torch.isfinite(tau).any(0).tolist()
        self.every = any(r.parsed.payload.keep_prefill for r in rows)
        self.capture = any(r.parsed.payload.capture for r in rows)
        self.proj = torch.zeros(len(rows), n_layers, device=device)  # [R, L] at each row's last token
        self.all_proj: list[torch.Tensor | None] = [None] * n_layers  # [n] every token's (keep_prefill)
        self.acts: torch.Tensor | None = None  # [R, L, d] hidden state at each row's last token (capture)

    def apply(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Layer `layer`'s output, the stream hidden + residual ([N, d] each, vLLM's fused-add form):
        steered in place where a row steers (hidden zeroed, residual the steered stream, so the next
        layer's fused add reads it exactly), and its projections recorded."""
        adds, caps = self.adds[layer], self.caps[layer]
        steers = adds or caps
        every = steers or self.every
        at = self.tokens if every else self.last
        h = (hidden[at] + residual[at])[:, None, :]  # [n, 1, d]
        if every:
            knobs = (self.unit_tok[:, layer], self.unit_tok_h[:, layer], self.add_tok[:, layer], self.tau_tok[:, layer])
        else:  # read only: each row's last token, as the transformers engine reads a pass
            knobs = (self.unit[:, layer], self.unit_h[:, layer], None, None)
        h, p = steer_stream(h, *knobs, adds=adds, caps=caps, every=every)
        if steers:
            hidden[at] = 0
            residual[at] = h[:, 0]
        p = p[:, 0]
        if every:
            if self.every:
                self.all_proj[layer] = p
            last_p, last_h = p[self.last_local], h[self.last_local, 0]
        else:
            last_p, last_h = p, h[:, 0]
        self.proj[:, layer] = last_p
        if self.capture:
            if self.acts is None:
                self.acts = torch.zeros(len(self.rows), len(self.adds), h.shape[-1], device=h.device)
            self.acts[:, layer] = last_h.float()


class StepPlan:
    """The driftlab rows of one forward pass, laid out for attention and the residual stream."""

    def __init__(self, context: Any, rows: list[Row], groups: list[AttentionGroup],
                 residual: ResidualPlan | None) -> None:
        self.context = context  # vLLM's ForwardContext of the pass (identity: a new pass, a new plan)
        self.rows, self.groups, self.residual = rows, groups, residual

    def fold(self, records: dict[str, Record]) -> None:
        """The pass's recordings into each request's Record (the steps that produced a token)."""
        for group in self.groups:
            state = group.state
            if not state.trace or not state.records[0]:
                continue
            pis = torch.stack([recs[-1] for recs in state.records], dim=0)  # [L, B, H, q|1]
            for b, row in enumerate(group.rows):
                if not (row.parsed.attention and row.parsed.attention.trace):
                    continue
                rec = records.setdefault(row.parsed.payload.id, Record())
                if state.config.trace_prefill and row.prompt_queries and state.prefilling:
                    first = group.first_real(b)
                    rec.prefill_pi.append(pis[:, b, :, first : first + row.prompt_queries].permute(2, 0, 1).cpu())
                if row.produces:
                    rec.pi.append(pis[:, b, :, -1].cpu())
        plan = self.residual
        if plan is None:
            return
        offset = 0
        for i, row in enumerate(plan.rows):
            rec = records.setdefault(row.parsed.payload.id, Record())
            if row.parsed.payload.keep_prefill and row.prompt_queries and plan.all_proj[0] is not None:
                per_layer = torch.stack([p[offset : offset + row.prompt_queries] for p in plan.all_proj], dim=-1)
                rec.prefill_proj.append(per_layer.cpu())
            offset += row.q
            if row.produces:
                rec.proj.append(plan.proj[i].cpu())
                if plan.acts is not None and row.parsed.payload.capture:
                    rec.acts.append(plan.acts[i].cpu())


class Engine:
    """driftlab's state in one vLLM worker: the model's shape, the directions, each pass's plan and the
    requests' records. The attention backend and the residual op ask it for the current plan."""

    def __init__(self, runner: Any, n_layers: int, n_heads: int, d_model: int,
                 shard: tuple[int, int] | None = None) -> None:
        """`n_heads`: the model's query heads, of which this worker's attention layers hold `shard`
        = [first, end) under tensor parallelism (None: all); its pi records are those heads'."""
        self.runner = runner
        self.n_layers, self.n_heads, self.d_model, self.shard = n_layers, n_heads, d_model, shard
        self.directions = None
        self.records: dict[str, Record] = {}
        self._parsed: OrderedDict[str, Parsed] = OrderedDict()
        self._plan: StepPlan | None = None
        self._layout_checked = False
        self._scratch: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    # -- from the driftlab process (collective_rpc) -------------------------------------------------------
    def use_directions(self, path: str | None) -> None:
        from driftlab.activation.directions import Directions

        self.directions = Directions.load(path) if path else None
        self._parsed.clear()

    def take(self, ids: list[str]) -> list[dict[str, Any] | None]:
        """Each request's record (None: nothing recorded), handed over and forgotten."""
        self._close()
        return [rec.as_dict() if (rec := self.records.pop(i, None)) is not None else None for i in ids]

    def keep_logits(self, hidden: torch.Tensor, scheduled: dict[str, int]) -> None:
        """After a pass: the next-token log-distribution at each `keep_logits` request's last prompt positions
        this pass computed, from the model's final hidden states (what vLLM's own prompt log-probs read, the
        steer's residual edits included) through its own `compute_logits`. A position vLLM's prefix cache
        held is not computed, so not kept: the backend reads such a prompt again under a salt of its own."""
        runner = self.runner
        for req_id, n in scheduled.items():
            state = runner.requests.get(req_id)
            args = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            if not args.get(KEY, {}).get("keep_logits"):  # most requests: no payload parsed
                continue
            payload = SteerPayload.of(args)
            done, prompt = state.num_computed_tokens, state.num_prompt_tokens  # done: before this pass
            low, high = max(prompt - payload.keep_logits, done), min(prompt, done + n)
            if low >= high:
                continue
            offset = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]])
            logits = runner.model.compute_logits(hidden[offset + low - done : offset + high - done])
            if logits is None:  # a tensor-parallel rank other than the first
                continue
            kept = torch.log_softmax(logits.float(), dim=-1).cpu()
            record = self.records.setdefault(payload.id, Record())
            record.logprobs.update({low + j: kept[j] for j in range(high - low)})

    # -- per pass ------------------------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """The current pass's plan (None: no request of the batch carries a steer), built once per pass."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        context = get_forward_context()
        if self._plan is not None and self._plan.context is context:
            return self._plan
        self._close()
        self._plan = self._build(context)
        return self._plan

    def check_layout(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: Any) -> None:
        """Once per process, before the first steered attention: the keys and values this pass wrote
        must read back from the cache as `cache_regions` reads them, or the engine stops with one line
        (another kernel ISA, another vLLM) instead of steering from the wrong numbers."""
        if self._layout_checked:
            return
        slots = metadata.slot_mapping[: metadata.num_actual_tokens].to(torch.long)
        keys, values = cache_regions(kv_cache)
        block_size = kv_cache.shape[2]
        block, offset = slots // block_size, slots % block_size
        n = len(slots)
        same = torch.equal(keys[block, :, :, offset], key[:n].to(keys.dtype)) and \
            torch.equal(values[block, :, offset], value[:n].to(values.dtype))
        if not same:
            raise DriftlabError(f"vLLM's paged KV cache on this machine (attention ISA {getattr(layer, 'isa', '?')}) is "
                                "not laid out as driftlab reads it, so attention steers and pi cannot run here.",
                                hint="Run without attention steers and trace, or on the transformers engine.")
        self._layout_checked = True

    def _close(self) -> None:
        if self._plan is not None:
            self._plan.fold(self.records)
            self._plan = None

    def _build(self, context: Any) -> StepPlan | None:
        metadata = context.attn_metadata
        if isinstance(metadata, dict):
            metadata = next(iter(metadata.values()), None)
        if metadata is None or not hasattr(metadata, "query_start_loc"):
            return None
        runner = self.runner
        batch = runner.input_batch
        n = len(metadata.seq_lens)
        req_ids = batch.req_ids[:n]
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        rows = []
        for i, req_id in enumerate(req_ids):
            state = runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            payload = SteerPayload.of(getattr(params, "extra_args", None))
            if payload is None:
                continue
            q = starts[i + 1] - starts[i]
            before = seq_lens[i] - q
            prompt = state.num_prompt_tokens
            rows.append(Row(index=i, parsed=self._parse(payload), start=starts[i], q=q, seq_len=seq_lens[i],
                            produces=seq_lens[i] >= prompt, prompt_queries=max(0, min(q, prompt - before))))
        if not rows:
            return None
        groups = self._groups(rows, metadata)
        steered = [r for r in rows if r.parsed.residual is not None]
        residual = ResidualPlan(steered, self.n_layers, self.device, self.dtype) if steered else None
        return StepPlan(context, rows, groups, residual)

    def _groups(self, rows: list[Row], metadata: Any) -> list[AttentionGroup]:
        """Decode rows that only read pi, decode rows that reweight, decode rows that steer otherwise, and the
        rest (prompts), each one group
        (rows tracing their prompts apart from the others: one setting per group, `AttentionConfig.shared`)."""
        active = [r for r in rows if r.parsed.attention is not None and r.parsed.attention.active]
        by_kind: dict[tuple, list[Row]] = {}
        for r in active:
            prefill_trace = r.parsed.attention.shared()
            by_kind.setdefault((_reads_last(r), _reweights(r), r.q == 1, prefill_trace,
                                r.first_step if any(prefill_trace) else None), []).append(r)
        return [AttentionGroup(group, metadata.block_table, self.block_size, self.n_layers, self.n_heads, self.device,
                               self.scratch, self.shard) for group in by_kind.values()]

    def scratch(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` for `name`, the same memory from pass to pass while it fits: a fresh tens-of-MB
        allocation each pass cost more in page faults than the copies into it."""
        size = math.prod(shape)
        held = self._scratch.get(name)
        if held is None or held.dtype != dtype or held.numel() < size:
            held = self._scratch[name] = torch.empty(max(size, 2 * (held.numel() if held is not None else 0)),
                                                     dtype=dtype, device=self.device)
        return held[:size].view(shape)

    @property
    def block_size(self) -> int:
        return int(self.runner.cache_config.block_size)

    def _parse(self, payload: SteerPayload) -> Parsed:
        key = payload.model_dump_json()
        held = self._parsed.get(key)
        if held is None:
            iv = Interventions.parse(list(payload.steer))
            config = iv.attention()
            residual = None
            if payload.direction is not None:
                if self.directions is None or payload.direction not in self.directions.personas:
                    raise DriftlabError(f"The vLLM worker holds no direction {payload.direction!r}.",
                                        hint="Start the engine with the directions the request names.")
                residual = self.directions.personas[payload.direction].row(iv.residual())
            held = self._parsed[key] = Parsed(payload, config, residual)
            while len(self._parsed) > 4096:
                self._parsed.popitem(last=False)
        return held


#: The engine of this process's worker (set when the worker loads its model; None elsewhere).
ENGINE: Engine | None = None
