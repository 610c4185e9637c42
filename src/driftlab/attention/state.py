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
        config: AttentionConfig,
        spans: Sequence[dict[str, list[Span]]],
        n_layers: int,
        n_heads: int,
        device: torch.device,
        row_heads: Sequence[Heads] | None = None,
    ) -> None:
        """`row_heads` gives each batch row its own bias heads (head profiling batches many
        single-head steerings at once); otherwise every row uses `config.bias_heads`."""
        self.config = config
        self.spans = spans
        self.row_heads = row_heads
        self.n_layers, self.n_heads, self.device = n_layers, n_heads, device
        self.split_k = config.split_k
        self.trace = config.trace
        split = head_mask(config.split_heads, n_layers, n_heads) if config.splits else None
        bias = None
        if config.biases:
            if row_heads is not None:  # [B, L, H]
                bias = torch.stack([head_mask(h, n_layers, n_heads) for h in row_heads])
            else:  # [1, L, H]
                bias = head_mask(config.bias_heads, n_layers, n_heads)[None]
        self.split_mask = split.to(device) if split is not None else None
        self.bias_mask = bias.to(device) if bias is not None else None
        # Per-layer flags on the host: asking the device tensors would sync a GPU every layer.
        self._split_layers = split.any(dim=1).tolist() if split is not None else [False] * n_layers
        self._bias_layers = bias.any(dim=(0, 2)).tolist() if bias is not None else [False] * n_layers
        self._acts = [self.trace or sp or bi for sp, bi in zip(self._split_layers, self._bias_layers)]
        self.system_keys: torch.Tensor | None = None
        self.system_slots: tuple[int, int] | None = None  # [first, last + 1) slot of any row's system key
        self.bias_keys: torch.Tensor | None = None
        self.kv_len = 0
        self.records: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.mask_memo: dict = {}  # the engine's per-mask facts, for the layers sharing a mask

    # -- layout, set by the decode loop ------------------------------------------------------
    def on_layout(self, pads: list[int], prompt_len: int, max_len: int, ends: Sequence[int] | None = None) -> None:
        """Lay the row spans out in padded key slots: row b's token j sits at pads[b] + j.

        `ends[b]` is the slot after row b's prompt (default `prompt_len`): a teacher-forced
        continuation after it counts as generated for `bias_scope="prompt"`.
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
        if self.config.biases:
            target = torch.zeros(B, max_len, dtype=torch.bool)
            for b, spans in enumerate(self.spans):
                if not spans.get(self.config.bias_span):
                    continue  # nothing to emphasise or boost in this row
                for s, e in spans[self.config.bias_span]:
                    target[b, pads[b] + s : pads[b] + e] = True
                end = ends[b] if self.config.bias_scope == "prompt" else max_len
                if self.config.bias_invert:
                    target[b, pads[b] : end] = ~target[b, pads[b] : end]
                target[b, end:] = False
            self.bias_keys = (target.float() * self.config.bias).to(self.device)
        self.kv_len = prompt_len
        self.records = [[] for _ in range(self.n_layers)]

    def forward_kwargs(self, kv_len: int) -> dict:
        self.kv_len = kv_len
        return {"driftlab": self}

    # -- queried by the attention function ---------------------------------------------------
    def acts_on(self, layer: int) -> bool:
        return self._acts[layer]

    def split_heads_for(self, layer: int) -> torch.Tensor | None:
        if not self._split_layers[layer]:
            return None
        return self.split_mask[layer]

    def system_range(self, lo: int, hi: int) -> tuple[int, int] | None:
        """[a, b) relative to a call whose keys are absolute slots [lo, hi): the slots that
        may hold system keys (any row's), or None when none of them is among these keys."""
        if self.system_slots is None:
            return None
        a, b = max(self.system_slots[0], lo), min(self.system_slots[1], hi)
        return (a - lo, b - lo) if a < b else None

    def layer_bias(self, layer: int, lo: int, hi: int) -> torch.Tensor | None:
        """[B, H, 1, K] additive logits for this layer's keys, or None."""
        if not self._bias_layers[layer]:
            return None
        keys = self.bias_keys[:, lo:hi]
        return keys[:, None, None, :] * self.bias_mask[:, layer, :, None, None].to(keys.dtype)

    def record(self, layer: int, pi: torch.Tensor) -> None:
        """Keep pi [B, H, q]: all queries on the prefill if asked, else only the last."""
        keep = pi if (self.config.trace_prefill and not self.records[layer]) else pi[..., -1:]
        self.records[layer].append(keep.float())

    # -- results -------------------------------------------------------------------------------
    def row_traces(self, n_steps: Sequence[int], pads: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Per row: `decode` [n_tokens, L, H] (pi when predicting each generated token) and,
        with trace_prefill, `prefill` [prompt_tokens, L, H] (pi at each prompt query)."""
        if not self.trace or not self.records[0]:
            return [{} for _ in n_steps]
        per_layer_last = [torch.cat([r[..., -1:] for r in recs], dim=-1) for recs in self.records]  # [B,H,F]
        stacked = torch.stack(per_layer_last, dim=0)  # [L, B, H, F]
        out = []
        for b, n in enumerate(n_steps):
            row = {"decode": stacked[:, b, :, :n].permute(2, 0, 1).cpu()}
            if self.config.trace_prefill:
                pre = torch.stack([recs[0][b] for recs in self.records], dim=0)  # [L, H, q0]
                row["prefill"] = pre[:, :, pads[b] :].permute(2, 0, 1).cpu()
            out.append(row)
        return out
