"""An independent, slow reference for the attention engine: it materialises the weights.

Registered as attention implementation "driftlab_reference". It reads the same per-row
inputs (system key slots, bias, heads) from the AttentionState but computes everything the
textbook way: logits = QK^T * scale + mask (+ bias), softmax, then (for split-softmax) the
reweighting of seed 000 Eq. 7 applied to the weights themselves, then weights @ V.
"""

from __future__ import annotations

import torch

NAME = "driftlab_reference"


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
        allowed = torch.ones(q, K, dtype=torch.bool).tril(diagonal=K - q)[None, None]
    else:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1e30
    layer = module.layer_idx
    if state is not None:
        lo, hi = state.kv_len - K, state.kv_len
        bias = state.layer_bias(layer, lo, hi)
        if bias is not None:
            logits = logits + bias.float()
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if state is not None:
        sys = state.system_keys[:, lo:hi][:, None, None, :]  # [B, 1, 1, K]
        pi = (weights * sys).sum(-1, keepdim=True)  # [B, H, q, 1]
        heads = state.split_heads_for(layer)
        if heads is not None:
            k = state.split_k
            up = torch.where(pi > 0, pi.pow(k) / pi, torch.zeros_like(pi))
            down = torch.where(pi < 1, (1 - pi.pow(k)) / (1 - pi), torch.zeros_like(pi))
            new = torch.where(sys, weights * up, weights * down)
            new = torch.where(pi > 0, new, weights)
            weights = torch.where(heads[None, :, None, None], new, weights)
        if state.trace:
            state.record(layer, pi[..., 0])
    out = torch.matmul(weights, value).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def register_reference() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, reference_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
