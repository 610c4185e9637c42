"""What the attention function should do on one generate call, per batch row.

`AttentionConfig` (driftlab.attention.config) is the serialisable description compiled
from `Interventions`; `AttentionState` is its per-call instantiation: key masks laid out
in the batch's padded key slots, head masks, and the pi traces it collects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from driftlab.attention.config import AttentionConfig, Heads, Span, heads_spec, parse_heads
from driftlab.errors import DriftlabError

__all__ = ["AttentionConfig", "AttentionState", "Heads", "Span", "head_mask", "heads_spec", "parse_heads"]


def head_mask(heads: Heads, n_layers: int, n_heads: int) -> torch.Tensor:
    """Boolean [n_layers, n_heads] mask of a head selection, with a range check."""
    if heads is None:
        return torch.ones(n_layers, n_heads, dtype=torch.bool)
    mask = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    for layer, head in heads:
        if not 0 <= layer < n_layers or (head is not None and not 0 <= head < n_heads):
            raise DriftlabError(
                f"Head selection ({layer}, {head}) is outside this model ({n_layers} layers x {n_heads} heads).",
                hint=f"Layers are 0..{n_layers - 1}, heads 0..{n_heads - 1}.",
            )
        if head is None:
            mask[layer] = True
        else:
            mask[layer, head] = True
    return mask


class AttentionState:
    """Per-call, per-row state handed to the attention function through forward kwargs."""

    def __init__(
        self,
        configs: AttentionConfig | Sequence[AttentionConfig],
        spans: Sequence[dict[str, list[Span]]],
        n_layers: int,
        n_heads: int,
        device: torch.device,
    ) -> None:
        """`configs` is one config for every row, or one per row (head profiling batches many
        single-head steerings at once). Rows may differ only in their key biases: split-softmax
        and tracing are one setting per call."""
        rows = [configs] * len(spans) if isinstance(configs, AttentionConfig) else list(configs)
        if len(rows) != len(spans):
            raise DriftlabError(f"{len(rows)} attention configs given for {len(spans)} rows.")
        if any(c.shared() != rows[0].shared() for c in rows):
            raise DriftlabError("The rows of one batch ask for different split-softmax or tracing settings.",
                                hint="Only key biases (bias, instaboost, pasta) may differ per row; "
                                     "run the others as separate requests.")
        self.config = rows[0]  # the shared settings
        self.rows = rows
        self.spans = spans
        self.n_layers, self.n_heads, self.device = n_layers, n_heads, device
        self.split_k = self.config.split_k
        self.trace = self.config.trace
        split = head_mask(self.config.split_heads, n_layers, n_heads) if self.config.splits else None
        # Key biases: term j of row b (zero where a row has fewer terms), heads [J, B, L, H].
        n_terms = max((len(c.biases) for c in rows), default=0)
        bias = None
        if n_terms:
            bias = torch.zeros(n_terms, len(rows), n_layers, n_heads, dtype=torch.bool)
            for b, c in enumerate(rows):
                for j, term in enumerate(c.biases):
                    bias[j, b] = head_mask(term.heads, n_layers, n_heads)
        self.split_mask = split.to(device) if split is not None else None
        self.bias_mask = bias.to(device) if bias is not None else None
        # Per-layer flags on the host: asking the device tensors would sync a GPU every layer.
        self._split_layers = split.any(dim=1).tolist() if split is not None else [False] * n_layers
        self._bias_layers = bias.any(dim=(0, 1, 3)).tolist() if bias is not None else [False] * n_layers
        self._acts = [self.trace or sp or bi for sp, bi in zip(self._split_layers, self._bias_layers)]
        self.system_keys: torch.Tensor | None = None
        self.system_slots: tuple[int, int] | None = None  # [first, last + 1) slot of any row's system key
        self.bias_keys: torch.Tensor | None = None  # [J, B, slots] additive logits per term
        self.kv_len = 0
        self.records: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        # Static layout (a static KV cache, see `static_layout`): every call covers all key slots,
        # and pi goes to `trace_buf` [L, B, H, calls] at the index held in `step`.
        self.static = False
        self.trace_buf: torch.Tensor | None = None
        self.step: torch.Tensor | None = None
        self.first: torch.Tensor | None = None  # [B] each row's first real slot (its padding)
        self.last_slot: torch.Tensor | None = None  # [] the slot of the current call's last query
        self.system_end: int | None = None  # system-only calls cover slots [0, system_end)
        self.prompt_len = 0
        self.prefilling = True  # the current forward pass is the call's first (the prefill)
        self._calls = 0
        self.mask_memo: dict = {}  # the engine's per-mask facts, for the layers sharing a mask
        # Copies of the state on other devices: a model spread by a device map runs each layer
        # where its weights are, and the state must meet it there (one copy per device and call).
        self._copies: dict[tuple[str, torch.device], torch.Tensor] = {}

    def on(self, name: str, device: torch.device) -> torch.Tensor | None:
        """The state tensor `name` (system_keys, bias_keys, split_mask, bias_mask) on `device`."""
        tensor = getattr(self, name)
        if tensor is None or tensor.device == device:
            return tensor
        copy = self._copies.get((name, device))
        if copy is None:
            copy = self._copies[(name, device)] = tensor.to(device)
        return copy

    def first_keys(self, device: torch.device) -> torch.Tensor:
        """[B] each row's first key slot (its left padding) on `device`: the static layout's
        tensor, or one built once per layout (rows leaving the batch rebuild it), so a decode step
        masked from it copies nothing from the host."""
        if self.static:
            return self.on("first", device)
        held = self._copies.get(("first", device))
        if held is None:
            held = self._copies[("first", device)] = torch.tensor(self.pads, dtype=torch.long, device=device)
        return held

    # -- layout, set by the decode loop ------------------------------------------------------
    def on_layout(self, pads: list[int], prompt_len: int, max_len: int, ends: Sequence[int] | None = None) -> None:
        """Lay the row spans out in padded key slots: row b's token j sits at pads[b] + j.

        `ends[b]` is the slot after row b's prompt (default `prompt_len`): a teacher-forced
        continuation after it counts as generated for a bias with `scope="prompt"`.
        """
        B = len(pads)
        ends = list(ends) if ends is not None else [prompt_len] * B
        self.ends = ends
        self.pads = list(pads)
        if len(self.spans) != B:
            raise DriftlabError(f"{len(self.spans)} span sets given for a batch of {B}.")
        system = torch.zeros(B, max_len, dtype=torch.bool)
        for b, spans in enumerate(self.spans):
            for s, e in spans.get("system", []):
                system[b, pads[b] + s : pads[b] + e] = True
        self.system_keys = system.to(self.device)
        slots = torch.nonzero(system.any(dim=0)).flatten().tolist()
        self.system_slots = (slots[0], slots[-1] + 1) if slots else None
        if self.bias_mask is not None:
            keys = torch.zeros(self.bias_mask.shape[0], B, max_len)
            for b, (config, spans) in enumerate(zip(self.rows, self.spans, strict=True)):
                for j, term in enumerate(config.biases):
                    if not spans.get(term.span):
                        continue  # nothing to emphasise or boost in this row
                    target = torch.zeros(max_len, dtype=torch.bool)
                    for s, e in spans[term.span]:
                        target[pads[b] + s : pads[b] + e] = True
                    end = ends[b] if term.scope == "prompt" else max_len
                    if term.invert:
                        target[pads[b] : end] = ~target[pads[b] : end]
                    target[end:] = False
                    keys[j, b] = target.float() * term.value
            self.bias_keys = keys.to(self.device)
        self.kv_len = self.prompt_len = prompt_len
        self.records = [[] for _ in range(self.n_layers)]
        self._copies = {}

    def select_rows(self, keep: Sequence[int]) -> None:
        """Keep only the batch positions `keep`, in that order (the decode loop drops rows that
        are done). The dynamic layout only: a static one keeps its shapes, and pi traces are
        kept per batch position, so the loop does not drop rows while tracing."""
        if self.static or self.trace:
            raise DriftlabError("Rows cannot leave a batch that is traced or laid out statically.")
        index = torch.tensor(list(keep), dtype=torch.long, device=self.system_keys.device)
        self.rows = [self.rows[i] for i in keep]
        self.spans = [self.spans[i] for i in keep]
        self.pads = [self.pads[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        self.system_keys = self.system_keys[index]
        if self.bias_keys is not None:
            self.bias_keys = self.bias_keys[:, index]
            self.bias_mask = self.bias_mask[:, index]
        self.mask_memo, self._copies = {}, {}

    def static_layout(self, n_calls: int, arena: dict[str, torch.Tensor] | None = None,
                      system_end: int | None = None) -> None:
        """Switch to a static KV cache's layout (after `on_layout`, whose `max_len` is the cache length).

        Why: a compiled or CUDA-graph-captured decode step is specialised on every Python value
        it reads (dynamo guards on them: a changing int or list means a recompile per step), and
        a captured graph reads tensors at fixed addresses. So here nothing the engine reads
        changes between steps: each call covers all key slots (`kv_len` is the cache length,
        lo = 0, hi = K; unfilled slots are hidden by the causal mask), the split-softmax strength
        is a tensor, and pi is written in place into a preallocated buffer at the step index
        held in a tensor (a list append would change per step, and a graph's outputs are
        overwritten by its next replay). `arena` holds the tensors of earlier calls of the same
        shapes: the values are copied into them, so a captured graph sees this call's state.
        `n_calls` bounds the forward passes of the call (prefill + decode steps). `system_end`:
        the system-only call of pi and split-softmax covers slots [0, system_end) (default: all);
        the caller rounds it up to a few buckets, since each value compiles its own graph.
        The query's slot is a tensor too (`last_slot`, with the rows' first slots in `first`):
        the FlexAttention path masks a decode step with them instead of a block mask per step.
        """
        self.static = True
        arena = {} if arena is None else arena

        def put(name: str, value: torch.Tensor) -> torch.Tensor:
            held = arena.get(name)
            if held is None or held.shape != value.shape or held.dtype != value.dtype or held.device != value.device:
                held = arena[name] = value.clone()
                torch._dynamo.mark_static_address(held)
            else:
                held.copy_(value)
            return held

        for name in ("system_keys", "bias_keys", "split_mask", "bias_mask"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, put(name, value))
        if self.split_mask is not None:
            self.split_k = put("split_k", torch.tensor(float(self.split_k), device=self.device))
        self.step = put("step", torch.zeros(1, dtype=torch.long, device=self.device))
        self.first = put("first", torch.tensor(self.pads, dtype=torch.long, device=self.device))
        self.last_slot = put("last_slot", torch.zeros((), dtype=torch.long, device=self.device))
        if self.system_slots is not None:
            slots = self.system_keys.shape[1]
            self.system_end = slots if system_end is None else min(max(system_end, self.system_slots[1]), slots)
        if self.trace:
            B = self.system_keys.shape[0]
            self.trace_buf = put("trace", torch.zeros(self.n_layers, B, self.n_heads, n_calls, device=self.device))

    def forward_kwargs(self, kv_len: int) -> dict:
        """Called by the decode loop before each forward pass: `kv_len` is the number of key slots."""
        self.kv_len = kv_len
        self.prefilling = self._calls == 0
        # Masks are shared by the layers of one forward pass only (each pass gets its own from
        # transformers): the memo holds this pass's, so it stays bounded over a long decode.
        self.mask_memo.clear()
        if self.step is not None:  # outside any compiled region: the graph reads them
            self.step.fill_(self._calls)
            self.last_slot.fill_(self.prompt_len - 1 + self._calls)  # the prefill ends at the prompt's last slot
        self._calls += 1
        return {"driftlab": self}

    # -- queried by the attention function ---------------------------------------------------
    def acts_on(self, layer: int) -> bool:
        return self._acts[layer]

    def split_heads_for(self, layer: int, device: torch.device | None = None) -> torch.Tensor | None:
        if not self._split_layers[layer]:
            return None
        return self.on("split_mask", device or self.device)[layer]

    def system_range(self, lo: int, hi: int) -> tuple[int, int] | None:
        """[a, b) relative to a call whose keys are absolute slots [lo, hi): the slots that
        may hold system keys (any row's), or None when none of them is among these keys."""
        if self.system_slots is None:
            return None
        if self.static:  # the same slice every step (the mask hides non-system keys)
            return (0, min(self.system_end, hi) - lo)
        a, b = max(self.system_slots[0], lo), min(self.system_slots[1], hi)
        return (a - lo, b - lo) if a < b else None

    def layer_bias(self, layer: int, lo: int, hi: int, device: torch.device | None = None) -> torch.Tensor | None:
        """[B, H, 1, K] additive logits for this layer's keys (the sum of the terms), or None."""
        if not self._bias_layers[layer]:
            return None
        out = None
        device = device or self.device
        for keys, heads in zip(self.on("bias_keys", device)[:, :, lo:hi], self.on("bias_mask", device)[:, :, layer],
                               strict=True):
            term = keys[:, None, None, :] * heads[:, :, None, None].to(keys.dtype)
            out = term if out is None else out + term
        return out

    def record(self, layer: int, pi: torch.Tensor) -> None:
        """Keep pi [B, H, q]: all queries on the prefill if asked, else only the last."""
        if self.trace_buf is not None:  # static layout: in place, at the step index (see static_layout)
            self.trace_buf[layer].index_copy_(-1, self.step, pi[..., -1:].float())
            if self.prefilling and self.config.trace_prefill:
                self.records[layer].append(pi.float())
            return
        keep = pi if (self.config.trace_prefill and not self.records[layer]) else pi[..., -1:]
        self.records[layer].append(keep.float())

    # -- results -------------------------------------------------------------------------------
    def row_traces(self, n_steps: Sequence[int], pads: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Per row: `decode` [n_tokens, L, H] (pi when predicting each generated token) and,
        with trace_prefill, `prefill` [prompt_tokens, L, H] (pi at each prompt query)."""
        if not self.trace or (not self.records[0] and (self.trace_buf is None or not self._calls)):
            return [{} for _ in n_steps]
        if self.trace_buf is not None:
            stacked = self.trace_buf[..., : self._calls]  # [L, B, H, F]
        else:
            # Layers of a device-mapped model record where they ran: gather them on the state's device.
            per_layer_last = [torch.cat([r[..., -1:] for r in recs], dim=-1).to(self.device)
                              for recs in self.records]  # [B,H,F]
            stacked = torch.stack(per_layer_last, dim=0)  # [L, B, H, F]
        out = []
        for b, n in enumerate(n_steps):
            row = {"decode": stacked[:, b, :, :n].permute(2, 0, 1).cpu()}
            if self.config.trace_prefill:
                pre = torch.stack([recs[0][b].to(self.device) for recs in self.records], dim=0)  # [L, H, q0]
                row["prefill"] = pre[:, :, pads[b] :].permute(2, 0, 1).cpu()
            out.append(row)
        return out
