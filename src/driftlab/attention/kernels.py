"""The attention math the engine's paths share: an SDPA call that reports LSEs, pi from two
calls' LSEs (or from one decode call that attends twice), and split-softmax from the two
attentions' outputs.

Why here: the engine (attention/engine.py: prefill, dynamic decode) and the steered decode
step of a static layout (attention/decode.py) compute the same things; one copy each keeps
them the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# PyTorch's fused CPU attention also returns each query's log-sum-exp. The public SDPA hides
# it, and extra V channels (dv != d) push CPU SDPA onto its math path, which materialises
# the weights and is 2-10x slower; so on CPU we call the kernel itself.
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flash_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Can PyTorch's fused CPU kernel (which reports log-sum-exps) run this call?"""
    return (CPU_FLASH is not None and query.device.type == "cpu" and query.dtype in _CPU_FLASH_DTYPES
            and key.dtype == query.dtype and query.shape[-1] == value.shape[-1])


def attend_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    n_rep: int,
    *,
    causal: bool = False,
    lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA over grouped-query heads, without copying K/V when decoding one token.

    query [B, H, q, d]; key/value [B, Hkv, k, dv]; mask broadcastable to [B, H, q, k]
    (bool: True = attend, or float additive; a float mask of the query dtype with `lse`).
    Returns ([B, H, q, dv], and with `lse` the float32 log-sum-exp of the logits [B, H, q]).
    """
    B, H, q, d = query.shape
    packed = n_rep > 1 and q == 1 and not causal  # packed heads are queries: a causal flag would mask them
    if packed:
        # The n_rep query heads sharing a KV head become n_rep queries of that head.
        query = query.reshape(B, H // n_rep, n_rep, d)
        if mask is not None and mask.dim() == 4 and mask.shape[1] == H:
            mask = mask.reshape(B, H // n_rep, n_rep, mask.shape[-1])
    elif n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    if lse:
        out, log_sum = CPU_FLASH(query, key, value, 0.0, causal, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scale)
        log_sum = None
    if packed:
        out = out.reshape(B, H, 1, out.shape[-1])
        log_sum = log_sum.reshape(B, H, 1) if log_sum is not None else None
    return out, log_sum


def attend_both(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masks: torch.Tensor,
                scale: float, n_rep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's attention over all keys and over the system keys alone, in one kernel call.

    query [B, H, 1, d]; key/value [B, Hkv, K, dv]; `masks` [B, 1, 2 n_rep, K] additive, of the
    query dtype (`both_masks`): its first n_rep rows the step's mask over all keys, the others
    over the system keys alone. Each query head goes in twice, once under each mask, so the call
    reads K/V once. A decode step's attention is a tiny kernel whose time is mostly per call,
    which is why a second call over the system keys cost about as much as the step's own.
    Returns views in grouped layout, head h = g n_rep + r at [:, g, r]: the outputs over all keys
    and over the system keys [B, Hkv, n_rep, dv], and their float32 LSEs [B, Hkv, n_rep].
    """
    B, H, _, d = query.shape
    G = H // n_rep
    twice = query.reshape(B, G, 1, n_rep, d).expand(B, G, 2, n_rep, d).reshape(B, G, 2 * n_rep, d)
    out, lse = CPU_FLASH(twice, key, value, 0.0, False, attn_mask=masks, scale=scale)
    out, lse = out.view(B, G, 2, n_rep, out.shape[-1]), lse.view(B, G, 2, n_rep)
    return out[:, :, 0], out[:, :, 1], lse[:, :, 0], lse[:, :, 1]


def both_masks(all_keys: torch.Tensor | None, system_keys: torch.Tensor, n_rep: int, dtype: torch.dtype) -> torch.Tensor:
    """`attend_both`'s masks [B, 1, 2 n_rep, K] from a decode step's additive mask over
    all keys ([B, 1, 1, K] or None: every key visible) and its system keys [B, K] bool."""
    neg = torch.finfo(dtype).min
    visible = torch.zeros((), dtype=dtype, device=system_keys.device) if all_keys is None else all_keys
    B, K = system_keys.shape
    rows = (visible.expand(B, 1, 1, K), torch.where(system_keys[:, None, None, :], visible, neg).to(dtype))
    return torch.cat([r.expand(B, 1, n_rep, K) for r in rows], dim=2).contiguous()


def attend_with_mass(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     system_keys: torch.Tensor, scale: float, n_rep: int, *, causal: bool = False):
    """SDPA where no kernel reports LSEs (e.g. CUDA's): V gets indicator channels, 1 on the system
    keys and 1 on the others, so one call returns (O [B, H, q, dv], pi and 1 - pi [B, H, q, 1]), each
    mass with full relative precision even in bf16 where pi is close to 1. Zero channels pad V to a
    multiple of 8, which fused GPU kernels need. `system_keys` [B, K] bool."""
    B, K, dv = value.shape[0], value.shape[2], value.shape[-1]
    n_extra = 2 + (-(dv + 2)) % 8
    ind = torch.zeros((B, K, n_extra), dtype=value.dtype, device=value.device)
    ind[..., 0] = system_keys.to(value.dtype)
    ind[..., 1] = (~system_keys).to(value.dtype)
    ind = ind[:, None].expand(B, value.shape[1], K, n_extra)
    o_ext, _ = attend_sdpa(query, key, torch.cat([value, ind], dim=-1), mask, scale, n_rep, causal=causal)
    mass = o_ext[..., dv : dv + 2].float().clamp(0.0, 1.0)
    return o_ext[..., :dv], mass[..., :1], mass[..., 1:]


def system_share(lse_all: torch.Tensor, lse_sys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pi, 1 - pi), each [B, H, q, 1] float32, from the all-keys and system-only LSEs.

    Both LSEs come from fp32 accumulators; 1 - pi is computed directly (expm1), so it keeps full
    precision where pi is close to 1. A query that sees no system key has LSE_sys = -inf (pi = 0,
    rest = 1); a query that sees no key at all (left padding) also has LSE_all = -inf: -inf - -inf
    would be NaN.
    """
    seen = torch.isfinite(lse_sys)
    delta = torch.where(seen, (lse_sys - lse_all).clamp(max=0.0), float("-inf"))
    delta = delta[..., None]
    return delta.exp(), -torch.expm1(delta)


def system_pi(lse_all: torch.Tensor, lse_sys: torch.Tensor) -> torch.Tensor:
    """pi alone [B, H, q, 1], for queries that each see some key (a decode step's: its own token):
    a trace needs no 1 - pi, and no -inf - -inf can arise (a query that sees no system key has
    LSE_sys = -inf, hence pi = 0). Three ops where `system_share` takes six, in every layer."""
    return (lse_sys - lse_all).clamp(max=0.0).exp()[..., None]


def decode_lses(query: torch.Tensor, key_blocks: torch.Tensor, visible: torch.Tensor, system_keys: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exps of one decode query per row over all its visible keys and over its system keys,
    from the logits alone (no values, no output): what pi needs where an engine's own kernel already
    made the output and returns no LSE (vLLM's CPU kernel).

    query [..., B, G, r, d] (the r query heads of each of G KV heads); key_blocks [..., B, n, G, d, bs],
    each row's keys in blocks of bs slots, transposed (vLLM's CPU cache stores them so: read in place,
    not laid out again); visible [B, K] bool, system [B, K] (bool or 0/1 float), K <= n bs. Returns
    float32 (LSE_all, LSE_sys) [..., B, G, r]; feed them to `system_pi`. One batched matmul and a few
    reductions sharing one max and one exp: a decode step's attention is tiny, and what it costs is
    mostly per call and per copy of the keys (two logsumexp calls took half again as long)."""
    weights, top = _decode_weights(query, key_blocks, visible, scale)
    return weights.sum(-1).log() + top, (weights * system_keys[:, None, None, :]).sum(-1).log() + top


def decode_system_parts(query: torch.Tensor, key_blocks: torch.Tensor, visible: torch.Tensor,
                        system_keys: torch.Tensor, values: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decode_lses` and the attention output over the system keys alone, o_sys [B, G, r, dv] float32:
    with an engine's own all-keys output O, what `split_softmax` reweights (split-softmax, the pi floor)
    without attending to every key's value again. `values` [B, G, S, dv] are those of the first S key
    slots, which hold every system key (a system prompt is a prefix). A row without a system key gets
    o_sys = NaN, which `split_softmax` never reads (pi = 0 there). Any other set of keys may stand for
    the system keys (`boost_keys`' set: the keys PASTA spares), with the values of every slot it holds."""
    weights, top = _decode_weights(query, key_blocks, visible, scale)
    S = values.shape[2]
    on_system = weights[..., :S] * system_keys[:, None, None, :S]
    mass = on_system.sum(-1)
    o_sys = torch.matmul(on_system, values.float()) / mass[..., None]
    return weights.sum(-1).log() + top, mass.log() + top, o_sys


def _decode_weights(query: torch.Tensor, key_blocks: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(logits - max) [..., B, G, r, K] of one decode query per row over its visible keys, and the max
    [..., B, G, r]. The logits come block by block ([..., B, n, G, r, bs]: a broadcast matmul over the
    blocks as they lie) and only they, tiny, are laid out as [.., K]."""
    K = visible.shape[-1]
    logits = torch.matmul(query.float().unsqueeze(-4), key_blocks.float())  # [..., B, n, G, r, bs]
    logits = logits.movedim(-4, -2).flatten(-2)[..., :K].mul_(scale)  # [..., B, G, r, K]
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)
    return torch.exp(logits - top), top[..., 0]


def _f32(x: torch.Tensor) -> torch.Tensor:
    """`x` as float32 (itself where it is already: no op in a decode step's graph)."""
    return x if x.dtype == torch.float32 else x.float()


def split_softmax(out: torch.Tensor, o_sys: torch.Tensor, pi: torch.Tensor, rest: torch.Tensor,
                  k: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Reweight attention so the system keys get t = max(pi^k, floor) of the mass, exactly, in
    O(T) memory.

    O = pi O_sys + (1 - pi) O_rest, so t O_sys + (1 - t) O_rest = t O_sys + w (O - pi O_sys) with
    w = (1 - t) / (1 - pi). `k` is the split-softmax strength per head ([H], or [B, H]); `floor`
    (pi-floor), broadcastable to pi [B, H, q, 1], the least mass the system keys get (0: none).
    A head with k = 1 whose floor does not bind (pi >= floor) keeps `out` bit for bit, and where
    the floor does not bind the result is split-softmax's alone, bit for bit.
    """
    k = _f32(k)
    k = k.reshape(1, -1, 1, 1) if k.dim() == 1 else k.reshape(*k.shape, 1, 1)
    pk = pi.pow(k)
    # w = (1 - (1 - r)^k) / r with r = 1 - pi measured directly; where no rest key is
    # visible (queries inside the system span) r = 0 and the rest term vanishes anyway.
    # k = 0 gives (1 - 1) / r = 0, where the formula would give 0 * log(0) = NaN at r = 1: masked,
    # not branched on, since k is a tensor read by a compiled decode step.
    # Written over -r ((1 - x) / r = (x - 1) / -r, exactly): one op fewer in the steered decode
    # step, whose ops per layer tests/test_static_decode.py bounds.
    seen_rest = rest > 0
    neg_rest = -rest
    neg_r = neg_rest.clamp_max(-1e-30)
    w = torch.where(seen_rest & (k != 0), torch.expm1(k * torch.log1p(neg_rest)) / neg_r, 0.0)
    change = k != 1
    if floor is not None:
        # Where the floor binds: t = floor, w = (1 - floor) / r. Never where no rest key is visible
        # (all the mass is on the system keys already; a 1 - pi rounded to 0 must not divide).
        floor = _f32(floor)
        binds = (floor > pk) & seen_rest
        pk = torch.where(binds, floor, pk)
        w = torch.where(binds, (floor - 1.0) / neg_r, w)
        change = change | binds
    o32, s32 = _f32(out), _f32(o_sys)
    new = pk * s32 + w * (o32 - pi * s32)
    new = torch.where(pi > 0, new, o32)  # no system key visible: unchanged (o_sys is garbage there)
    return torch.where(change, new if new.dtype == out.dtype else new.to(out.dtype), out)


def boost_keys(out: torch.Tensor, o_set: torch.Tensor, pi: torch.Tensor, rest: torch.Tensor,
               bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An output computed without a key bias, turned into the output with `bias` added to the logits of
    one set of keys (InstABoost: log m on the system keys; PASTA: minus log alpha on the keys it spares,
    the same softmax as log alpha on all the others). `o_set` is the attention output over that set
    alone and pi, rest its share of the attention and the others'; `bias` broadcastable to pi
    [B, H, q, 1], 0: unchanged. Returns (that output, the set's share under the bias, the others'),
    what `split_softmax` then takes where the set is the system keys.

    Why it is exact: a bias on one set of keys scales their softmax mass by m = e^bias and leaves
    their own output unchanged, so their share moves from pi to t = m pi / (m pi + 1 - pi) and the
    output is t O_set + ((1 - t) / (1 - pi)) (O - pi O_set), split-softmax's epilogue with another t.
    An engine whose kernel takes no key bias (vLLM's CPU one) reads only that set's values for it,
    not every key's again."""
    m = _f32(bias).exp()
    lifted = m * pi
    total = lifted + rest
    t, rest_t = lifted / total, rest / total
    w = torch.where(rest > 0, 1.0 / total, 0.0)  # (1 - t) / (1 - pi); no other key visible: O is O_set
    o32, s32 = _f32(out), _f32(o_set)
    new = (t * s32 + w * (o32 - pi * s32)).to(out.dtype)
    # `out` itself, bit for bit, on a head without a bias and where no key of the set is seen (o_set is garbage there).
    return torch.where((pi > 0) & (bias != 0), new, out), t, rest_t


def merge(out: torch.Tensor, o_sys: torch.Tensor, lse_all: torch.Tensor, lse_sys: torch.Tensor,
          k: torch.Tensor | None, floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The epilogue of the two attention calls: (the output, split-softmax applied with per-head
    strengths `k` where given and pi-floor's `floor` where given (then `k` too: ones where no head
    splits); pi [B, H, q, 1])."""
    pi, rest = system_share(lse_all, lse_sys)
    return (out if k is None else split_softmax(out, o_sys, pi, rest, k, floor)), pi


_merge_compiled = None


def merge_fn(device: torch.device):
    """`merge` as one compiled function on GPUs: eager, a prefill's epilogue is ~20 kernels per
    layer, half of them over the whole float32 output; compiled it is a few fused ones. Eager on
    a CPU, and inside a compiled region (a decode step), which fuses it anyway."""
    global _merge_compiled
    if device.type == "cpu" or torch.compiler.is_compiling():
        return merge
    if _merge_compiled is None:
        _merge_compiled = torch.compile(merge, dynamic=True)
    return _merge_compiled
