"""An independent, slow reference for the attention engine: it materialises the weights.

Registered as attention implementation "driftlab_reference". From the AttentionState it
reads only the raw inputs the caller gave — each row's AttentionConfig, the per-row token
spans and the left-padding of each row — and builds everything else itself with plain loops:
which key slots are system/biased keys, which (layer, head) pairs are selected. None of
the engine's layout code (on_layout, head_mask, system_range, layer_bias) is used, so a
bug there shows up as a disagreement. Then it computes the textbook way: logits = QK^T *
scale + mask (+ every bias term), softmax, the split-softmax reweighting of the persona-drift paper's Eq. 7 applied to
the weights themselves, then weights @ V.

pi-floor: the floors as given to `AttentionState.set_floors` (`floor_table` [B, L, H], the
values themselves, and `floor_queries`, each row's first floor query as a token index of its
unpadded prompt); the reference places the first floor slot at pads[b] + floor_queries[b]
itself. At each query from there on, with pi the weight mass on the system keys, t = max(pi^k,
floor) (k = 1 on heads split-softmax does not select): the system weights are scaled by t / pi,
the others by (1 - t) / (1 - pi). The queries of a call are the last q of its `kv_len` slots
(the dynamic layout; a static one is checked against the dynamic loop, tests/test_pi_floor.py).

Every tensor it builds lives on the query's device, so it runs wherever the model does
(`pytest --device cuda`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

NAME = "driftlab_reference"


def _selected(heads, layer: int, n_heads: int) -> list[bool]:
    """Is each head of `layer` in the selection? (None = every head of every layer.)"""
    if heads is None:
        return [True] * n_heads
    return [any(sel_layer == layer and (sel_head is None or sel_head == h) for sel_layer, sel_head in heads)
            for h in range(n_heads)]


def _key_slots(state, span_name: str, n_slots: int, device: torch.device) -> torch.Tensor:
    """[B, n_slots] bool: absolute key slot p of row b holds a token of span `span_name`."""
    out = torch.zeros(len(state.pads), n_slots, dtype=torch.bool, device=device)
    for b, (pad, spans) in enumerate(zip(state.pads, state.spans)):
        for start, end in spans.get(span_name, []):
            for token in range(start, end):
                out[b, pad + token] = True
    return out


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    state = kwargs.pop("driftlab", None)
    B, H, q, d = query.shape
    K = key.shape[2]
    n_rep = H // key.shape[1]
    key = key.repeat_interleave(n_rep, dim=1).float()
    value = value.repeat_interleave(n_rep, dim=1).float()
    scale = scaling if scaling is not None else d**-0.5
    logits = torch.matmul(query.float(), key.transpose(-1, -2)) * scale  # [B, H, q, K]
    if attention_mask is None:
        allowed = torch.ones(q, K, dtype=torch.bool, device=query.device).tril(diagonal=K - q)[None, None]
    else:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1e30
    layer = module.layer_idx
    if state is not None:
        cfg = state.config
        total = state.kv_len  # this call's keys are the last K of `total` absolute slots
        sys = _key_slots(state, "system", total, query.device)[:, total - K :]  # [B, K]
        for b, (pad, row) in enumerate(zip(state.pads, state.rows)):
            for term in row.biases:  # several terms (bias, instaboost, pasta) add up
                target = _key_slots(state, term.span, total, query.device)[b]
                if not state.spans[b].get(term.span):
                    continue  # a row without the span is left alone
                # prompt scope: only keys before the row's prompt end (pastalib); else every key
                end = state.ends[b] if term.scope == "prompt" else total
                if term.invert:
                    target[pad:end] = ~target[pad:end]
                target[end:] = False
                heads = torch.tensor(_selected(term.heads, layer, H), device=query.device)  # [H]
                bias = target[total - K :][None, None, :].float() * term.value * heads[:, None, None].float()
                logits[b] = logits[b] + bias
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if state is not None:
        sys4 = sys[:, None, None, :]
        pi = (weights * sys4).sum(-1, keepdim=True)  # [B, H, q, 1]
        floors = _floors(state, layer, B, H, q, query.device)  # [B, H, q, 1] or None
        if cfg.split_k != 1.0 or floors is not None:
            split = torch.tensor(_selected(cfg.split_heads, layer, H), device=query.device) & (cfg.split_k != 1.0)
            k = torch.where(split, cfg.split_k, 1.0)[None, :, None, None]  # [1, H, 1, 1]
            target = pi.pow(k)
            rescale = split[None, :, None, None].expand_as(pi)
            if floors is not None:
                binds = floors > target
                target = torch.where(binds, floors, target)
                rescale = rescale | binds
            up = torch.where(pi > 0, target / pi, torch.zeros_like(pi))
            down = torch.where(pi < 1, (1 - target) / (1 - pi), torch.zeros_like(pi))
            new = torch.where(sys4, weights * up, weights * down)
            new = torch.where(pi > 0, new, weights)
            weights = torch.where(rescale, new, weights)
        if cfg.trace:
            state.record(layer, pi[..., 0])
    out = torch.matmul(weights, value).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _floors(state, layer: int, B: int, H: int, q: int, device: torch.device) -> torch.Tensor | None:
    """[B, H, q, 1] the pi floor of each query of this call (0 before its row's first floor
    slot), from the floors as given; None where no floor was set."""
    table = getattr(state, "floor_table", None)
    queries = getattr(state, "floor_queries", None)
    if table is None or queries is None or not bool((table > 0).any()):
        return None
    out = torch.zeros(B, H, q, 1, device=device)
    total = state.kv_len
    for b in range(B):
        first = state.pads[b] + queries[b]  # the absolute slot of the row's first floor query
        for i in range(q):
            if total - q + i >= first:  # query i sits at slot total - q + i
                out[b, :, i, 0] = table[b, layer].to(device)
    return out


def register_reference() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, reference_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def both_engines_on_one_thread() -> Iterator[None]:
    """Register the engine and this reference, and run on one torch thread meanwhile.

    (The thread count only concerns CPU work; on a GPU it is harmless and left the same.)

    Why one thread: the test models are tiny, so two threads barely help, while on a shared
    2-core machine an OpenMP barrier waiting for a descheduled thread made a test file 8x
    slower (30 s -> 270 s). Engine and reference always run with the same setting.
    """
    from driftlab.attention import register

    register()
    register_reference()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def left_padded(backend, convs) -> tuple[torch.Tensor, torch.Tensor, list[int], list]:
    """The conversations rendered and left-padded into one batch on the backend's device: (ids,
    mask, pads, rendered), as the backend batches them."""
    rendered = [backend.render(c) for c in convs]
    T = max(len(r.ids) for r in rendered)
    pads = [T - len(r.ids) for r in rendered]
    ids = torch.full((len(convs), T), backend.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rendered):
        ids[b, pads[b]:] = torch.tensor(r.ids)
        mask[b, pads[b]:] = 1
    return ids.to(backend.device), mask.to(backend.device), pads, rendered
