"""driftlab's attention function, registered with transformers' AttentionInterface.

One function serves every decoder (Llama, Qwen2, Gemma3, ...). With no state it is plain
SDPA. With an `AttentionState` it composes, per batch row:

* tracing: pi = attention mass on system-prompt keys, per layer and head, obtained by
  appending to V a channel that is 1 on system keys (one fused SDPA call gives O and pi);
* an additive key bias on chosen keys and (layer, head) pairs (PASTA, InstABoost);
* exact split-softmax (seed 000 Eq. 6-7): with O_sys from a second SDPA over only the
  system keys, the reweighted output is pi^k O_sys + (1-pi^k)/(1-pi) (O - pi O_sys).

Nothing materialises the T x T attention weights; a bias mask is built per query chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from driftlab.attention.state import AttentionState

ATTENTION_NAME = "driftlab"
_CHUNK_ELEMS = 1 << 24  # max elements of a per-head float mask built at once (64 MB in fp32)


def _causal_mask(q: int, k: int, device: torch.device) -> torch.Tensor:
    """Boolean [1, 1, q, k] mask for queries that are the last q of k positions.

    transformers passes attention_mask=None when the pattern is plainly causal and relies
    on SDPA's `is_causal`, which is top-left aligned: wrong whenever q != k (decoding).
    """
    rows = torch.arange(k - q, k, device=device)[:, None]
    return (torch.arange(k, device=device)[None, :] <= rows)[None, None]


def _sdpa(query, key, value, mask, scale, n_rep: int) -> torch.Tensor:
    """SDPA over grouped-query heads without copying K/V when decoding one token.

    query [B, H, q, d]; key/value [B, Hkv, k, dv]; mask broadcastable to [B, H, q, k]
    (bool: True = attend, or float additive). Returns [B, H, q, dv].
    """
    B, H, q, _ = query.shape
    if n_rep > 1 and q == 1:
        # Treat the n_rep query heads sharing a KV head as n_rep queries of that head.
        qg = query.reshape(B, H // n_rep, n_rep, query.shape[-1])
        if mask is not None and mask.dim() == 4 and mask.shape[1] == H:
            mask = mask.reshape(B, H // n_rep, n_rep, mask.shape[-1])
        out = F.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scale)
        return out.reshape(B, H, 1, value.shape[-1])
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def driftlab_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    state: AttentionState | None = kwargs.pop("driftlab", None)
    layer = getattr(module, "layer_idx", 0)
    if state is None or not state.acts_on(layer):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("driftlab attention does not support logit soft-capping.")

    B, H, q, d = query.shape
    K, dv = key.shape[2], value.shape[-1]
    n_rep = H // key.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    base = attention_mask if attention_mask is not None else _causal_mask(q, K, query.device)
    if base.dtype != torch.bool:  # some models hand over an additive float mask
        base = base > torch.finfo(base.dtype).min / 2
    # Keys of this call are the last K of the absolute key slots (sliding-window layers keep fewer).
    lo, hi = state.kv_len - K, state.kv_len
    sys_keys = state.system_keys[:, lo:hi] if state.system_keys is not None else None
    bias = state.layer_bias(layer, lo, hi)  # [B, H, 1, K] or None
    split_heads = state.split_heads_for(layer)  # [H] bool or None
    need_pi = state.trace or split_heads is not None

    # Query chunks bound the size of any per-head float mask.
    step = q if bias is None else max(1, _CHUNK_ELEMS // max(1, B * H * K))
    outs, pis = [], []
    for s in range(0, q, step):
        qs = query[:, :, s : s + step]
        m = base[:, :, s : s + step] if base.shape[2] > 1 else base
        if bias is not None:
            m = torch.where(m, bias.to(qs.dtype), torch.finfo(qs.dtype).min)
        elif not m.any(dim=-1).all():
            # Fully masked rows (left padding) would give NaN with a boolean mask.
            m = torch.where(m, 0.0, torch.finfo(qs.dtype).min).to(qs.dtype)
        if need_pi:
            # Indicator channels: mass on system keys (pi) and on the rest (1 - pi), each
            # with full relative precision even in bf16 where pi is close to 1.
            ind = torch.stack([sys_keys, ~sys_keys], dim=-1).to(value.dtype)[:, None]
            ind = ind.expand(B, value.shape[1], K, 2)
            o_ext = _sdpa(qs, key, torch.cat([value, ind], dim=-1), m, scale, n_rep)
            o, mass = o_ext[..., :dv], o_ext[..., dv:].float().clamp(0.0, 1.0)
            pi, rest = mass[..., :1], mass[..., 1:]  # [B, H, q, 1] each
        else:
            o, pi, rest = _sdpa(qs, key, value, m, scale, n_rep), None, None
        if split_heads is not None:
            o = _split_softmax(qs, key, value, m, sys_keys, o, pi, rest, state.split_k, split_heads, scale, n_rep)
        outs.append(o)
        if pi is not None:
            pis.append(pi[..., 0])
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    if state.trace:
        state.record(layer, torch.cat(pis, dim=2) if len(pis) > 1 else pis[0])
    return out.transpose(1, 2).contiguous(), None


def _split_softmax(query, key, value, mask, sys_keys, out, pi, rest, k: float, heads, scale, n_rep):
    """Reweight attention so the system keys get pi^k of the mass, exactly, in O(T) memory.

    O = pi O_sys + (1 - pi) O_rest, so pi^k O_sys + (1 - pi^k) O_rest
      = pi^k O_sys + w (O - pi O_sys) with w = (1 - pi^k) / (1 - pi).
    """
    cols = torch.nonzero(sys_keys.any(dim=0)).flatten()
    if cols.numel() == 0:
        return out
    a, b = int(cols[0]), int(cols[-1]) + 1  # the key slots holding any row's system span
    sys_slice = sys_keys[:, a:b]
    if mask.dtype == torch.bool:
        m_sys = mask[..., a:b] & sys_slice[:, None, None, :]
        m_sys = torch.where(m_sys, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    else:
        m_sys = torch.where(sys_slice[:, None, None, :], mask[..., a:b], torch.finfo(query.dtype).min)
    o_sys = _sdpa(query, key[:, :, a:b], value[:, :, a:b], m_sys, scale, n_rep).float()
    pk = pi.pow(k)
    # w = (1 - (1 - r)^k) / r with r = 1 - pi measured directly; where no rest key is
    # visible (queries inside the system span) r = 0 and the rest term vanishes anyway.
    w = torch.where(rest > 0, -torch.expm1(k * torch.log1p(-rest)) / rest.clamp_min(1e-30), torch.zeros_like(rest))
    o32 = out.float()
    new = pk * o_sys + w * (o32 - pi * o_sys)
    new = torch.where(pi > 0, new, o32)  # no system key visible: unchanged (o_sys is garbage there)
    return torch.where(heads[None, :, None, None], new.to(out.dtype), out)


def register() -> None:
    """Make `attn_implementation="driftlab"` available to every transformers model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, driftlab_attention)
    # Same mask format as SDPA: a boolean [B, 1, q, k] mask, or None for plain causal.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
