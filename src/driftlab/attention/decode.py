"""The steered decode step of a static layout: every knob is data, one graph for every steer.

Why: a decode step compiled (and on a GPU captured in a CUDA graph) is specialised on every
Python value it reads, so a step that branched on which layers act, whether pi is traced, how
many bias terms there are or where the system prompt ends compiled a new graph for each steer,
strength and prompt. This step branches on nothing a steer sets. Every layer, whatever the
steer:

* attends over all filled keys with the key bias of the state's tables as a score term
  (`bias_keys` [J, B, K] times `bias_heads` [J, B, L, H]: zero where no term acts);
* attends over the system keys only (a block mask of each row's system blocks on flex);
* takes pi = exp(LSE_sys - LSE_all), writes it into the trace buffer at the step index, and
  applies split-softmax with the layer's per-head strength and pi-floor with the layer's floor
  where the query's slot has reached its row's first floor slot (k = 1 and a floor that does not
  bind, a floor of 0 among them, leave a head's output as it is, bit for bit).

So a new strength, span, head set or intervention kind is new values in the same tensors, and
the compiled step runs on without compiling. The key pattern (causal, left padding) is masked
from the rows' first slots and the query's slot, both tensors; on FlexAttention the block masks
list only the filled key blocks (their count is a static tensor the decode loop updates before
each step) and each row's system blocks, so the decode kernel splits its work over the filled
keys and never reads unfilled slots.
"""

from __future__ import annotations

import torch

from driftlab.attention.kernels import attend_sdpa, attend_with_mass, flash_ok, split_softmax, system_share
from driftlab.attention.state import AttentionState, bias_logits


def steered_step(state: AttentionState, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float, kernel: str) -> torch.Tensor:
    """One query per row ([B, H, 1, d]) against the static cache's keys ([B, Hkv, K, d]): the
    layer's output [B, H, 1, dv], steered by the state's tables."""
    if state.lean:
        return _lean(state, query, key, value, scale)
    if kernel == "flex":
        out, o_sys, pi, rest = _flex(state, layer, query, key, value, scale)
    else:
        out, o_sys, pi, rest = _sdpa(state, layer, query, key, value, scale)
    out = split_softmax(out, o_sys, pi, rest, state.split_table[:, layer], _floor(state, layer, query.shape[1]))
    pi_now = pi[..., 0]
    state.trace_buf[layer].index_copy_(-1, state.step, pi_now if pi_now.dtype == state.trace_buf.dtype
                                       else pi_now.to(state.trace_buf.dtype))
    if state.prefilling and state.config.trace_prefill:  # an eager prefill of one query (the rest was cached)
        state.records[layer].append(pi[..., 0].float())
    return out


def _floor(state: AttentionState, layer: int, H: int) -> torch.Tensor:
    """[B, H, 1, 1] the layer's pi floor per row and head, 0 in rows whose first floor slot is
    past the query's slot."""
    B = state.floor_first.shape[0]
    on = (state.last_slot >= state.floor_first).view(B, 1, 1, 1)
    return torch.where(on, state.floor_table[:, layer].view(B, H, 1, 1), 0.0)


def _visible(state: AttentionState, K: int, device: torch.device) -> torch.Tensor:
    """[B, K] keys the query may see: from its row's first slot to its own slot."""
    pos = torch.arange(K, device=device)
    return (pos[None] >= state.first[:, None]) & (pos[None] <= state.last_slot)


def _sdpa(state, layer, query, key, value, scale):
    """The SDPA kernel family: two calls over every slot, the bias as a [B, H, 1, K] float mask
    and hidden keys at the dtype's minimum. pi from the calls' LSEs where PyTorch's CPU flash
    kernel reports them, else from indicator channels appended to V (1 on system keys, 1 on the
    others: `kernels.attend_with_mass`)."""
    H = query.shape[1]
    K, dtype = key.shape[2], query.dtype
    neg = torch.finfo(dtype).min
    bias = bias_logits(state.bias_keys, state.bias_heads[:, :, layer])
    visible = _visible(state, K, query.device)[:, None, None, :]
    n_rep = H // key.shape[1]
    mask = _as(torch.where(visible, bias, neg), dtype)
    sys_mask = _as(torch.where(visible & state.system_keys[:, None, None, :], bias, neg), dtype)
    if flash_ok(query, key, value):
        out, lse_all = attend_sdpa(query, key, value, mask, scale, n_rep, lse=True)
        o_sys, lse_sys = attend_sdpa(query, key, value, sys_mask, scale, n_rep, lse=True)
        return out, o_sys, *system_share(lse_all, lse_sys)
    out, pi, rest = attend_with_mass(query, key, value, mask, state.system_keys, scale, n_rep)
    o_sys, _ = attend_sdpa(query, key, value, sys_mask, scale, n_rep)
    return out, o_sys, pi, rest


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` (itself where it is already: no op in the step's graph)."""
    return x if x.dtype == dtype else x.to(dtype)


def _flex(state, layer, query, key, value, scale):
    """FlexAttention: the bias in the score_mod, the key pattern in block masks built from tensors."""
    from driftlab.attention import flex

    K = key.shape[2]
    group = flex.fold(query, key.shape[1])
    mods = flex.DecodeMods(state.first, state.last_slot, state.bias_keys, state.bias_heads[:, :, layer], group)
    full = flex.decode_block_mask(*state.filled_blocks, mods.visible, K, group)
    sys_mask = flex.decode_block_mask(*state.system_blocks, mods.visible_system(state.system_keys), K, group)
    options = flex.decode_options(state)
    out, lse_all = flex.attend_decode(query, key, value, full, mods, scale, options)
    o_sys, lse_sys = flex.attend_decode(query, key, value, sys_mask, mods, scale, options)
    return out, o_sys, *system_share(lse_all, lse_sys)


def _lean(state, query, key, value, scale):
    """A plain decode step of a static layout (`AttentionState.lean`): one flex pass over the filled
    key blocks. Why not transformers' SDPA: on a static cache it needs a mask, and with a mask
    under compile it repeats grouped K/V heads over every slot (7x Qwen2.5-7B's KV, per layer and
    step) and reads every allocated slot; flex takes grouped heads as they are and reads only the
    filled blocks."""
    from driftlab.attention import flex

    group = flex.fold(query, key.shape[1])
    mods = flex.DecodeMods(state.first, state.last_slot, None, None, group)
    full = flex.decode_block_mask(*state.filled_blocks, mods.visible, key.shape[2], group)
    out, _ = flex.attend_decode(query, key, value, full, mods, scale, flex.decode_options(state), lse=False)
    return out
