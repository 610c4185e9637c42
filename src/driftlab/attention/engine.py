"""driftlab's attention function, registered with transformers' AttentionInterface.

One function serves every decoder (Llama, Qwen2, Gemma3, ...). With no state it is plain
SDPA. With an `AttentionState` it composes, per batch row:

* tracing: pi = attention mass on system-prompt keys, per layer and head;
* an additive key bias on chosen keys and (layer, head) pairs (PASTA, InstABoost);
* exact split-softmax (persona-drift paper Eq. 6-7): with O_sys from a second SDPA over only the
  system keys, the reweighted output is pi^k O_sys + (1-pi^k)/(1-pi) (O - pi O_sys);
* pi-floor: the same rescaling with t = max(pi^k, floor) in place of pi^k, on the queries from
  each row's first floor slot on (`AttentionState.set_floors`).

pi comes from log-sum-exps where the fused kernel reports them (PyTorch's CPU flash
kernel): pi = exp(LSE_sys - LSE_all), with LSE_sys from the same second, system-only call
that split-softmax needs anyway. Elsewhere pi comes from extra V channels that are 1 on
system keys (one SDPA call gives O and pi). Either way nothing materialises the T x T
attention weights. A prefill whose mask is causal plus left padding (the usual batch) passes
the kernel a [B, H, 1, K] key mask with its causal flag, bias and pi included; other masks
(sliding windows, cached prefixes) get a float mask per query chunk.

Kernels (`DRIFTLAB_ATTENTION_KERNEL`, read per call): on CUDA the intervention path runs on
FlexAttention (flex.py): the bias as a score_mod, causal / padding / sliding window as block
masks, pi and split-softmax from two calls' LSEs, so no per-query mask and nothing T x T.
On CPU it stays on SDPA (above), unless `flex` is asked for (eager flex: for tests).
Calls without interventions always go to SDPA. flex.py is imported on first use: on a torch
without FlexAttention or its `AuxRequest` (before 2.9) every backend still loads, `auto` runs
SDPA (said once) and an explicit `flex` is a DriftlabError.
"""

from __future__ import annotations

import logging
import math
import os
from types import ModuleType

import torch

from driftlab.attention import decode
from driftlab.attention.kernels import (
    attend_both,
    attend_sdpa,
    attend_with_mass,
    both_masks,
    flash_ok,
    merge_fn,
    split_softmax,
    system_pi,
    system_share,
)
from driftlab.attention.state import AttentionState, every_block
from driftlab.cuda_support import auto_fast_path
from driftlab.errors import DriftlabError

ATTENTION_NAME = "driftlab"
logger = logging.getLogger(__name__)
_CHUNK_ELEMS = 1 << 24  # max elements of a per-head float mask built at once (64 MB in fp32)

# Attention kwargs that change the computation; with any of them set we leave it to transformers.
_SPECIAL_KWARGS = ("softcap", "position_bias", "cache", "s_aux", "sinks", "is_causal")
# Of those, the ones the intervention path does not implement: refuse rather than drop them.
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")


def _refuse_unsupported(module, kwargs: dict) -> None:
    used = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if kwargs.get("is_causal") is False:
        used.append("is_causal=False")
    if used:
        raise DriftlabError(
            f"{type(module).__name__} uses {', '.join(used)} in attention, which driftlab's attention "
            "interventions do not implement (ignoring it would give silently wrong outputs).",
            hint="Run this model without attention interventions (--steer), or use a Llama/Qwen2/Gemma-style model.",
        )


def _causal_mask(q: int, k: int, device: torch.device) -> torch.Tensor:
    """Boolean [1, 1, q, k] mask for queries that are the last q of k positions.

    transformers passes attention_mask=None when the pattern is plainly causal and relies
    on SDPA's `is_causal`, which is top-left aligned: wrong whenever q != k (decoding).
    """
    rows = torch.arange(k - q, k, device=device)[:, None]
    return (torch.arange(k, device=device)[None, :] <= rows)[None, None]


def _plain(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """Attention without any driftlab state: transformers' SDPA, except one CPU decode case.

    For one query with grouped-query heads and no mask, transformers asks SDPA for
    `enable_gqa`, which PyTorch's CPU kernels serve on the math path (about 7x slower than
    folding the query heads onto their KV head, as it does itself when a mask is present).
    """
    n_rep = query.shape[1] // key.shape[1]
    if (
        query.shape[2] == 1
        and n_rep > 1
        and query.device.type == "cpu"
        and not (module.training and dropout > 0)
        and all(kwargs.get(name) is None for name in _SPECIAL_KWARGS)
    ):
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        out, _ = attend_sdpa(query, key, value, attention_mask, scale, n_rep)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


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
    if state is None:
        return _plain(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        # Falling back to layer 0 would silently apply layer 0's head selection everywhere.
        raise DriftlabError(
            f"{type(module).__name__} has no layer_idx, so driftlab cannot tell which layer it is steering.",
            hint="This architecture is not supported for attention interventions; run it without --steer.",
        )
    if state.static and query.shape[2] == 1:  # a static layout's decode step: the steered graph
        _refuse_unsupported(module, kwargs)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        out = decode.steered_step(state, layer, query, key, value, scale, kernel_for(query.device))
        return out.transpose(1, 2).contiguous(), None
    if not state.acts_on(layer):
        return _plain(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    _refuse_unsupported(module, kwargs)

    B, H, q, d = query.shape
    K = key.shape[2]
    n_rep = H // key.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    dtype, neg = query.dtype, torch.finfo(query.dtype).min
    # Keys of this call are the last K of the absolute key slots (sliding-window layers keep fewer).
    lo, hi = state.kv_len - K, state.kv_len
    bias = state.layer_bias(layer, lo, hi, query.device)  # [B, H, 1, K] or None
    split_heads = state.split_strength(layer, query.device)  # [B, H] strength per row and head, or None
    floor = state.layer_floor(layer, q, query.device)  # [B, H, q, 1] pi floor per query, or None
    if bias is None and split_heads is None and floor is None and not state.trace:
        # A floor acts on this layer, but not on these queries (all before their rows' first floor slot).
        return _plain(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if floor is not None and split_heads is None:  # the rescaling's strengths: 1 (no split) on every head
        split_heads = state.on("split_table", query.device)[:, layer]
    need_pi = state.trace or split_heads is not None
    sys_range = state.system_range(lo, hi) if need_pi else None  # [a, b) of this call's keys
    sys_keys = state.on("system_keys", query.device)[:, lo:hi] if need_pi else None
    if kernel_for(query.device) == "flex":
        out = _flex_path(state, layer, query, key, value, attention_mask, scale, bias, split_heads, floor,
                         sys_range, lo, kwargs.get("sliding_window"))
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    use_lse = need_pi and flash_ok(query, key, value)

    base = attention_mask
    if base is not None and base.dtype != torch.bool:  # some models hand over an additive float mask
        base = base > neg / 2
    if (bias is not None or need_pi) and q == K and q > 1 and flash_ok(query, key, value):
        # A key bias (PASTA, InstABoost), pi or split-softmax on a prefill whose mask is causal
        # plus key padding: the CPU flash kernel takes the causal flag with a [B, H, 1, K] key
        # mask (bias, and the dtype's minimum on padding keys), so no per-query mask is built.
        # The memo keeps the mask alive; only the caller's own tensor is worth it (a converted
        # float mask is a fresh [B, 1, q, K] tensor per layer).
        memo = state.mask_memo if base is attention_mask else {}
        keys = None if base is None else _padding_keys(memo, base, q, K, state.kv_len)
        if base is None or keys is not None:
            key_bias = None if bias is None else bias.to(dtype)
            if keys is not None:
                key_bias = torch.where(keys[:, None, None, :], 0.0 if key_bias is None else key_bias, neg).to(dtype)
            out, lse_all = attend_sdpa(query, key, value, key_bias, scale, n_rep, causal=True, lse=True)
            if need_pi:
                out = _pi_of_causal_prefill(state, layer, out, lse_all, query, key, value, key_bias, sys_keys,
                                            sys_range, split_heads, floor, scale, n_rep)
            return out.transpose(1, 2).contiguous(), None
    # None = every key visible to every query: q == 1, or (q == K) with the causal flag.
    causal = base is None and q == K and q > 1 and bias is None
    if base is None and q > 1 and not causal:
        base = _causal_mask(q, K, query.device)

    # Query chunks bound the size of any per-head float mask.
    step = q if bias is None else max(1, _CHUNK_ELEMS // max(1, B * H * K))
    outs, pis = [], []
    need_sys = need_pi and sys_range is not None
    if use_lse and q == 1 and bias is None and sys_range is not None:  # a decode step that needs pi
        return _decode_with_pi(state, layer, query, key, value, base, sys_keys, split_heads, floor, scale, n_rep)
    for s in range(0, q, step):
        qs = query[:, :, s : s + step]
        qc = qs.shape[2]
        if q == 1 and bias is None:  # a decode step: every layer of a kind builds the same masks
            mf, m_sys = _decode_masks(state, base, sys_keys if need_sys else None, sys_range, K, dtype)
        else:
            m = None if base is None else (base[:, :, s : s + step] if base.shape[2] > 1 else base)
            mf, m_sys = _float_masks(m, bias, sys_keys if need_sys else None, sys_range, causal, dtype,
                                     (q, K, s, step))
        o_sys = pi = rest = None
        if need_sys:
            a, b = sys_range
        if use_lse:
            o, lse_all = attend_sdpa(qs, key, value, mf, scale, n_rep, causal=causal, lse=True)
            if sys_range is not None:
                o_sys, lse_sys = attend_sdpa(qs, key[:, :, a:b], value[:, :, a:b], m_sys, scale, n_rep, lse=True)
                if q == 1 and split_heads is None:  # a traced decode step
                    pi = system_pi(lse_all, lse_sys)
                else:
                    pi, rest = system_share(lse_all, lse_sys)
            else:
                pi = torch.zeros((B, H, qc, 1), device=query.device)
        elif need_pi:
            o, pi, rest = attend_with_mass(qs, key, value, mf, sys_keys, scale, n_rep, causal=causal)
            if split_heads is not None and sys_range is not None:
                o_sys, _ = attend_sdpa(qs, key[:, :, a:b], value[:, :, a:b], m_sys, scale, n_rep)
        else:
            o, _ = attend_sdpa(qs, key, value, mf, scale, n_rep, causal=causal)
        if split_heads is not None and o_sys is not None:
            o = split_softmax(o, o_sys, pi, rest, split_heads, floor if floor is None else floor[:, :, s : s + step])
        outs.append(o)
        if pi is not None:
            pis.append(pi[..., 0])
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    if state.trace:
        state.record(layer, torch.cat(pis, dim=2) if len(pis) > 1 else pis[0])
    return out.transpose(1, 2).contiguous(), None


def _float_masks(m: torch.Tensor | None, bias: torch.Tensor | None, sys_keys: torch.Tensor | None,
                 sys_range: tuple[int, int] | None, causal: bool, dtype: torch.dtype,
                 chunk: tuple[int, int, int, int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(all keys, system keys only) additive masks of one query chunk (`chunk`: q, K, its first
    query, its size) from the boolean mask `m` and the key bias; the system mask where `sys_keys`
    is given. Float masks throughout: a boolean one gives NaN on fully masked (left-padding) rows."""
    neg = torch.finfo(dtype).min
    if bias is not None:
        mf = bias.to(dtype) if m is None else torch.where(m, bias.to(dtype), neg)
    else:
        mf = None if m is None else torch.where(m, 0.0, neg).to(dtype)
    if sys_keys is None:
        return mf, None
    a, b = sys_range
    sys_slots = sys_keys[:, None, None, a:b]
    if mf is not None:
        return mf, torch.where(sys_slots, mf[..., a:b], neg)
    if causal:
        q, K, s, step = chunk
        sys_slots = sys_slots & _causal_mask(q, K, sys_keys.device)[:, :, s : s + step, a:b]
    return mf, torch.where(sys_slots, 0.0, neg).to(dtype)


def _per_step(state: AttentionState, name: str, base: torch.Tensor | None, K: int, extra: tuple, build):
    """`build()`'s masks of a one-token decode step, built by the first layer of the forward pass
    and reused by the others (transformers hands every layer of a kind the same mask tensor; a tag
    of the step's key count keeps one entry per `name`, the last step's)."""
    tag = (None if base is None else (base.data_ptr(), tuple(base.shape)), K, state.kv_len, *extra)
    held = state.mask_memo.get(name)
    if held is None or held[0] != tag:
        held = state.mask_memo[name] = (tag, build())
    return held[1]


def _decode_masks(state: AttentionState, base: torch.Tensor | None, sys_keys: torch.Tensor | None,
                  sys_range: tuple[int, int] | None, K: int, dtype: torch.dtype):
    """`_float_masks` of a one-token decode step without a key bias, once per step."""
    return _per_step(state, "decode", base, K, (sys_range, sys_keys is not None, dtype),
                     lambda: _float_masks(base, None, sys_keys, sys_range, False, dtype, (1, K, 0, 1)))


def _decode_both_masks(state: AttentionState, base: torch.Tensor | None, sys_keys: torch.Tensor, K: int,
                       n_rep: int, dtype: torch.dtype) -> torch.Tensor:
    """`both_masks` of a one-token decode step that needs pi, once per step."""
    def build() -> torch.Tensor:
        all_keys, _ = _float_masks(base, None, None, None, False, dtype, (1, K, 0, 1))
        return both_masks(all_keys, sys_keys, n_rep, dtype)

    return _per_step(state, "decode-both", base, K, (n_rep, dtype), build)


def _decode_with_pi(state: AttentionState, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    base: torch.Tensor | None, sys_keys: torch.Tensor, split_heads: torch.Tensor | None,
                    floor: torch.Tensor | None, scale: float, n_rep: int):
    """A one-token decode step without a key bias that traces pi or reweights it (split-softmax,
    pi floor): both of its attentions in one kernel call (`attend_both`). Every op counts here
    (drift telemetry runs this in every layer of every step), so a trace alone copies nothing but
    its output into the model's layout."""
    B, H, _, _ = query.shape
    masks = _decode_both_masks(state, base, sys_keys, key.shape[2], n_rep, query.dtype)
    out, o_sys, lse_all, lse_sys = attend_both(query, key, value, masks, scale, n_rep)
    dv = out.shape[-1]
    if split_heads is None:
        pi = system_pi(lse_all, lse_sys).reshape(B, H, 1, 1)
        out = out.reshape(B, 1, H, dv)  # the layout the model wants, in one copy
    else:
        pi, rest = system_share(lse_all.reshape(B, H, 1), lse_sys.reshape(B, H, 1))
        out = split_softmax(out.reshape(B, H, 1, dv), o_sys.reshape(B, H, 1, dv), pi, rest, split_heads, floor)
        out = out.transpose(1, 2).contiguous()
    if state.trace:
        state.record(layer, pi[..., 0])
    return out, None


def _pi_of_causal_prefill(state: AttentionState, layer: int, out: torch.Tensor, lse_all: torch.Tensor,
                          query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          key_mask: torch.Tensor | None,
                          sys_keys: torch.Tensor, sys_range: tuple[int, int] | None,
                          split_heads: torch.Tensor | None, floor: torch.Tensor | None, scale: float,
                          n_rep: int) -> torch.Tensor:
    """pi (traced), split-softmax and pi-floor (`floor` [B, H, q, 1] or None) for a causal prefill
    whose mask is a [B, H|1, 1, K] key mask (or none).

    The system-only call needs no per-query mask either: query i sees system key j iff j <= i,
    so the queries from the span's first slot `a` on, against keys [a, b), are causal in the
    kernel's top-left sense (query a + i sees key a + j iff j <= i). Queries before `a` see no
    system key: pi = 0 there, as the masked call would give. Returns the (reweighted) output.
    """
    B, H, q, dv = *query.shape[:3], value.shape[-1]
    pi = torch.zeros((B, H, q, 1), device=query.device)
    if sys_range is not None:
        a, b = sys_range
        neg = torch.finfo(query.dtype).min
        visible = 0.0 if key_mask is None else key_mask[..., a:b]
        m_sys = torch.where(sys_keys[:, None, None, a:b], visible, neg).to(query.dtype)
        o_tail, lse_tail = attend_sdpa(query[:, :, a:], key[:, :, a:b], value[:, :, a:b], m_sys, scale, n_rep,
                                   causal=True, lse=True)
        pi_tail, rest_tail = system_share(lse_all[:, :, a:], lse_tail)
        pi[:, :, a:] = pi_tail
        if split_heads is not None:
            rest = torch.ones_like(pi)
            rest[:, :, a:] = rest_tail
            o_sys = out.new_zeros((B, H, q, dv))
            o_sys[:, :, a:] = o_tail
            out = split_softmax(out, o_sys, pi, rest, split_heads, floor)
    if state.trace:
        state.record(layer, pi[..., 0])
    return out


def _padding_keys(memo: dict, base: torch.Tensor, q: int, K: int, kv_len: int) -> torch.Tensor | None:
    """[B, K] visible keys if the boolean mask `base` [B, 1, q, K] is exactly causal plus
    key padding (left padding), else None (e.g. a sliding window).

    transformers hands every layer of a kind the same mask tensor, so the answer is kept in
    `memo` per mask for the rest of the forward pass (the check reads all B q K entries)."""
    if base.dim() != 4 or base.shape[1] != 1 or base.shape[2] != q:
        return None
    tag = (base.data_ptr(), tuple(base.shape), kv_len)
    if tag not in memo:
        keys = base[:, 0, -1, :]  # the last query sees every key that is not padding
        same = torch.equal(base, keys[:, None, None, :] & _causal_mask(q, K, base.device))
        memo[tag] = keys if same else None
    return memo[tag]


KERNEL_ENV = "DRIFTLAB_ATTENTION_KERNEL"
KERNELS = ("auto", "flex", "sdpa")


def _kernel_setting(value: str) -> str:
    """The validated setting for one value of the env var (the engine reads it every call: a
    few string operations, and no lru_cache, which dynamo would trace through with a warning
    inside a compiled decode step)."""
    setting = value.strip().lower() or "auto"
    if setting not in KERNELS:
        raise DriftlabError(
            f"{KERNEL_ENV}={value!r} is not an attention kernel driftlab knows.",
            hint=f"Use one of {', '.join(KERNELS)} (auto: flex on CUDA with a tested torch, sdpa elsewhere), or unset it.",
        )
    return setting


# Device types on which `auto` picks flex (a test widens it to reach the fallback on CPU).
_AUTO_FLEX_DEVICES = ("cuda",)


def _auto_flex(device: torch.device) -> bool:
    """Whether `auto` picks flex on `device`: CUDA with a torch the fast path is tested on
    (`driftlab.cuda_support`), or a device a test adds."""
    if device.type == "cuda":
        return auto_fast_path(device)
    return device.type in _AUTO_FLEX_DEVICES
# flex.py, imported on first use (`_flex_module`); or why this torch cannot run it, and
# whether the SDPA fallback has been said.
_flex: ModuleType | None = None
_flex_missing: str | None = None
_flex_fallback_said = False


def _flex_module() -> ModuleType | None:
    """driftlab.attention.flex, imported on first use; None where this torch cannot run it
    (`_flex_missing` then says why). flex.py needs torch.nn.attention.flex_attention with
    `AuxRequest` (flex_attention's `return_aux`, torch >= 2.9): importing it with the engine
    would make every HF backend fail to import on an older torch."""
    global _flex, _flex_missing
    if _flex is None and _flex_missing is None:
        try:
            from driftlab.attention import flex as module
        except ImportError as err:
            _flex_missing = _why_no_flex(err)
        else:
            _flex = module
    return _flex


def _why_no_flex(err: ImportError) -> str:
    if isinstance(err, ModuleNotFoundError) and (err.name or "").startswith("torch.nn.attention"):
        what = "no FlexAttention (torch.nn.attention.flex_attention)"
    elif "AuxRequest" in str(err):
        what = "FlexAttention without AuxRequest (flex_attention's return_aux, which driftlab reads LSEs from)"
    else:
        what = f"no FlexAttention driftlab can use ({type(err).__name__}: {err})"
    return f"torch {torch.__version__} has {what}"


def _say_flex_fallback(device: torch.device) -> None:
    """Say once per process that `auto` runs SDPA where it would run flex, and why."""
    global _flex_fallback_said
    if _flex_fallback_said:
        return
    _flex_fallback_said = True
    from driftlab.console import err_console

    message = (f"attention interventions on {device.type} run on the SDPA path, not FlexAttention: {_flex_missing}; "
               "torch >= 2.9 runs them on flex (set DRIFTLAB_ATTENTION_KERNEL=sdpa to choose SDPA explicitly).")
    err_console().print(f"note: {message}", highlight=False, markup=False)


def kernel_for(device: torch.device) -> str:
    """'flex' or 'sdpa': the kernel family the intervention path uses on `device`.

    `DRIFTLAB_ATTENTION_KERNEL` is read at call time so a process (or a test) can switch:
    auto (default) = flex on CUDA, where it is fused and block-sparse, and sdpa elsewhere,
    where PyTorch's CPU flash kernel already returns LSEs and eager flex would materialise
    the scores; flex or sdpa force one everywhere. On a torch that cannot run flex.py, auto
    runs sdpa (said once) and an explicit flex is a DriftlabError.
    """
    setting = _kernel_setting(os.environ.get(KERNEL_ENV, "auto"))
    if setting == "sdpa" or (setting == "auto" and not _auto_flex(device)):
        return "sdpa"
    if _flex_module() is not None:
        return "flex"
    if setting == "flex":
        raise DriftlabError(
            f"{KERNEL_ENV}=flex asks for FlexAttention, but {_flex_missing}.",
            hint=f"Install torch 2.9 or later for the flex path, or unset {KERNEL_ENV} (auto: SDPA on this torch) "
                 "or set it to sdpa.",
        )
    _say_flex_fallback(device)
    return "sdpa"


_flex_declines_said: set[str] = set()


def _flex_declined(reason: str) -> None:
    """The flex path handed a call back to the SDPA path (tests make this fatal). Said once per
    reason and process: on a GPU that fallback is slower and builds per-query masks, so a run that
    takes it should say so, not leave it to a debug log."""
    logger.debug("flex attention path declined: %s", reason)
    if reason in _flex_declines_said:
        return
    _flex_declines_said.add(reason)
    from driftlab.console import err_console

    err_console().print(f"note: an attention call ran on the SDPA path instead of FlexAttention: {reason} "
                        "(said once per reason).", highlight=False, markup=False)


def _flex_masks(state: AttentionState, attention_mask: torch.Tensor | None, B: int, q: int, K: int, lo: int,
                window: int | None, sys_range: tuple[int, int] | None, device: torch.device):
    """(all-keys BlockMask, system-only BlockMask or None) for this call, or None if the mask
    transformers passed is not causal + left padding (+ `window`) over the state's layout.

    Built once per distinct (mask, shapes, window) and kept in `state.mask_memo`, so the
    layers sharing a mask in one forward pass share the block masks too.
    """
    flex = _flex_module()
    # Query i sits at slot shift + i of this call's keys: the last q of them, except on a static
    # cache, whose keys are every slot and whose prefill ends at the prompt's last slot.
    shift = (state.prompt_len - lo if state.static else K) - q
    ptr = None if attention_mask is None else attention_mask.data_ptr()
    tag = ("flex", ptr, B, q, K, state.kv_len, shift, window, sys_range, str(device))
    if tag in state.mask_memo:
        return state.mask_memo[tag]
    pads = getattr(state, "pads", None)
    if attention_mask is None:
        first = torch.zeros(B, dtype=torch.long)  # transformers' word for "causal, no padding"
    elif pads is None or len(pads) != B:
        first = None
    else:
        first = torch.tensor(pads, dtype=torch.long) - lo
    masks = None
    if first is None:
        _flex_declined("no padding layout")
    elif attention_mask is not None and not _mask_matches(attention_mask, first, q, K, window, shift):
        _flex_declined("the attention mask is not causal + left padding (+ window)")
    else:
        first = first.to(device)
        full = flex.block_mask(flex.visible_mod(first, q, K, window, shift=shift), B, q, K, device)
        sys_mask = None
        if sys_range is not None:
            a, b = sys_range
            sys_keys = state.on("system_keys", device)[:, lo + a : lo + b].contiguous()
            sys_mask = flex.block_mask(flex.visible_mod(first, q, K, window, a, sys_keys, shift=shift), B, q, b - a,
                                       device)
        masks = (full, sys_mask)
    state.mask_memo[tag] = masks
    return masks


def _mask_matches(mask: torch.Tensor, first: torch.Tensor, q: int, K: int, window: int | None, shift: int) -> bool:
    """Does `mask` [B or 1, 1, q, K] agree with causal + padding (+ window) on two query rows,
    query i sitting at key slot `shift` + i?

    O(B K), not O(B q K): the last query (real in every row) and the first query that is
    past every row's padding. That catches a wrong layout, offset or window convention.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != q or mask.shape[3] != K:
        return False
    rows = sorted({q - 1, min(max(int(first.max()) - shift, 0), q - 1)})
    got = mask[:, 0, rows, :]
    if got.dtype != torch.bool:
        got = got > torch.finfo(got.dtype).min / 2
    pos_q = torch.tensor(rows, device=mask.device)[:, None] + shift
    pos_k = torch.arange(K, device=mask.device)[None, :]
    want = (pos_k[None] >= first.to(mask.device)[:, None, None]) & (pos_k <= pos_q)[None]
    if window is not None:
        want = want & (pos_q - pos_k < window)[None]
    return bool(torch.equal(got.expand_as(want), want))


def _flex_decode_masks(state: AttentionState, B: int, K: int, lo: int, window: int | None,
                       sys_range: tuple[int, int] | None, device: torch.device):
    """(all-keys BlockMask, system-only BlockMask or None) of a dynamic loop's decode step, once
    per forward pass (the layers share them; `state.mask_memo`). Every key block is listed
    (all are filled), the query's slot and the system call's offset are 0-d tensors, so a
    compiled flex does not specialise on the step's key count."""
    tag = ("decode", K, lo, window, sys_range, str(device))
    if tag in state.mask_memo:
        return state.mask_memo[tag]
    flex = _flex_module()
    first = state.first_keys(device)
    first = first - lo if lo else first
    slot = torch.full((), K - 1, dtype=torch.long, device=device)
    full = flex.decode_block_mask(*every_block(B, K, device), flex.visible_mod(first, 1, K, window, shift=slot), K)
    sys_mask = None
    if sys_range is not None:
        a, b = sys_range
        keys = state.on("system_keys", device)[:, lo + a : lo + b].contiguous()
        offset = torch.full((), a, dtype=torch.long, device=device)
        see_sys = flex.visible_mod(first, 1, K, window, offset, keys, shift=slot)
        sys_mask = flex.decode_block_mask(*every_block(B, b - a, device), see_sys, b - a)
    state.mask_memo[tag] = (full, sys_mask)
    return full, sys_mask


def _flex_path(state: AttentionState, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scale: float, bias: torch.Tensor | None,
               split_heads: torch.Tensor | None, floor: torch.Tensor | None, sys_range: tuple[int, int] | None,
               lo: int, window: int | None) -> torch.Tensor | None:
    """The intervention path on FlexAttention ([B, H, q, dv]), or None to use the SDPA path.

    Key bias as a score_mod, the mask as block masks; pi, split-softmax and pi-floor from a
    second call over the system keys only, merged through the two calls' LSEs (see flex.py).
    """
    flex = _flex_module()  # not None: kernel_for chose flex
    B, H, q, _ = query.shape
    K = key.shape[2]
    if q == 1 and getattr(state, "pads", None) is not None and len(state.pads) == B:
        # A dynamic loop's decode step: block masks from the rows' first slots (a tensor kept per
        # layout) and the key count, never checked against transformers' mask (a host sync).
        full, sys_mask = _flex_decode_masks(state, B, K, lo, window, sys_range, query.device)
    else:
        masks = _flex_masks(state, attention_mask, B, q, K, lo, window, sys_range, query.device)
        if masks is None:
            return None
        full, sys_mask = masks
    key_bias = None if bias is None else bias[:, :, 0]  # [B, H, K]
    need_pi = state.trace or split_heads is not None
    out, lse_all = flex.attend(query, key, value, full, key_bias, scale, lse=need_pi)
    if not need_pi:
        return out
    if sys_range is None:  # no system key among this layer's keys
        pi = torch.zeros((B, H, q, 1), device=query.device)
    else:
        a, b = sys_range
        sys_bias = None if key_bias is None else key_bias[..., a:b]
        # Tracing alone needs only the system pass's LSE: its output is 16 channels wide, not d.
        sys_value = value[:, :, a:b] if split_heads is not None or value.shape[-1] <= 16 else value[:, :, a:b, :16]
        o_sys, lse_sys = flex.attend(query, key[:, :, a:b], sys_value, sys_mask, sys_bias, scale, lse=True)
        out, pi = merge_fn(query.device)(out, o_sys, lse_all, lse_sys, split_heads, floor)
    if state.trace:
        state.record(layer, pi[..., 0])
    return out


def register() -> None:
    """Make `attn_implementation="driftlab"` available to every transformers model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(batch_size, q_length, kv_length, *args, allow_is_causal_skip: bool = True, **kwargs):
        """SDPA's mask format: a boolean [B, 1, q, k] mask, or None for plain causal. A decode step
        (q = 1) always gets the mask: deciding to skip it reads the padding mask on the host
        (`padding_mask.all()`), a device sync every step, for a mask of one row per sequence."""
        return sdpa_mask(batch_size, q_length, kv_length, *args,
                         allow_is_causal_skip=allow_is_causal_skip and q_length != 1, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, driftlab_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, mask)
