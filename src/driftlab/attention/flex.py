"""The engine's FlexAttention path: key bias, pi and split-softmax with no T x T work.

Why: the SDPA path can only add a per-key bias through a float mask of shape [B, H, q, K]
(built per query chunk: quadratic at long prefill), and on CUDA it gets pi from extra V
channels that push SDPA off its fastest kernels. FlexAttention takes the bias as a
`score_mod` reading a [B, H, K] tensor, the causal / left-padding / sliding-window pattern as
a block-sparse `BlockMask` (fully masked blocks are skipped, never materialised), and
reports each query's log-sum-exp (LSE). Two calls then give everything:

* over all visible keys: O and LSE_all;
* over the system keys only (a block mask restricted to the system slots): O_sys, LSE_sys;

so pi = exp(LSE_sys - LSE_all), 1 - pi = -expm1(LSE_sys - LSE_all) (full precision near
pi = 1), and split-softmax is the engine's `_split_softmax(O, O_sys, pi, 1 - pi)`.

On CUDA flex runs compiled (one module-level `torch.compile(flex_attention)`, created on
first use). On CPU, torch 2.13's compiled flex cannot return the LSE, so the CPU runs eager
flex_attention: unfused (it materialises the scores), good for checking correctness at small
shapes; the engine's default on CPU stays the SDPA path (`DRIFTLAB_ATTENTION_KERNEL`).

This module needs torch >= 2.9 (`AuxRequest`; 2.5-2.8 have FlexAttention with only
`return_lse`). Only the engine imports it, on first use and guarded (`engine._flex_module`),
so an older torch fails here and nowhere else.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

# Dynamo compiles one graph per distinct (shapes, score_mod, mask) combination; past the
# default limit of 8 it stops compiling and flex silently runs its T x T math fallback
# (seen on an H100: a 128 GiB allocation at 32k keys). Prefill, decode, biased and
# unbiased, all-key and system-only calls of one run easily exceed 8.
_RECOMPILE_LIMIT = 256
_compiled: Callable | None = None


def _flex_fn(device: torch.device) -> Callable:
    """flex_attention, compiled once per process on GPUs; eager on CPU (see module doc).

    Inside a compiled region (a static decode step) it is the plain op: the enclosing
    compilation fuses it, and nothing global may change while dynamo traces."""
    global _compiled
    if device.type == "cpu" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled is None:
        from torch._dynamo import config

        config.cache_size_limit = max(config.cache_size_limit, _RECOMPILE_LIMIT)
        if hasattr(config, "accumulated_cache_size_limit"):
            config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 4 * _RECOMPILE_LIMIT)
        # dynamic=None: a shape is first compiled static; a dimension that changes (decode's
        # growing key count) is then compiled dynamic, once, instead of once per length.
        _compiled = torch.compile(flex_attention, dynamic=None)
    return _compiled


@contextmanager
def _without_dynamo(active: bool) -> Iterator[None]:
    """Run eager flex without its dynamo trace (CPU only, inference only).

    Eager flex_attention still traces its higher-order op through dynamo once per new shape
    or closure, so a decode (new key count every step, new bias every call) recompiles over
    and over: ~25 ms a call instead of ~5. torch's own debug switch runs the op directly;
    its caveat is about the backward pass, so it is used only when no gradient is asked for
    (`active`); flex rescales the LSE to the natural log either way (checked by the tests).
    Where torch lacks the switch, the public eager path runs unchanged.
    """
    module = sys.modules[flex_attention.__module__]
    name = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"
    if not active or not hasattr(module, name):
        yield
        return
    old = getattr(module, name)
    setattr(module, name, True)
    try:
        yield
    finally:
        setattr(module, name, old)


def visible_mod(first: torch.Tensor, q: int, K: int, window: int | None, key_offset: int = 0,
                keys: torch.Tensor | None = None, shift: int | torch.Tensor | None = None) -> Callable:
    """mask_mod of the keys a query may see: query i sits at key slot `shift` + i (default
    K - q: the queries are the last q of K keys; a static cache's decode step passes its
    query's slot as a 0-d tensor, which a compiled step reads without recompiling).

    `first` [B] int: each row's first non-padding key (left padding). `window`: a sliding
    layer's window (a query sees keys less than `window` positions back). `key_offset` and
    `keys` [B, n] bool restrict the call to keys [key_offset, key_offset + n) of the layer
    that are True in `keys` (the system-only call).
    """
    if shift is None:
        shift = K - q

    def mod(b, h, q_idx, kv_idx):
        pos_q, pos_k = q_idx + shift, kv_idx + key_offset
        ok = (pos_k >= first[b]) & (pos_k <= pos_q)
        if window is not None:
            ok = ok & (pos_q - pos_k < window)
        if keys is not None:
            ok = ok & keys[b, kv_idx]
        return ok

    return mod


def block_mask(mod: Callable, B: int, q: int, n_keys: int, device: torch.device) -> BlockMask:
    """A BlockMask of `mod` (head-independent). On GPUs it is built compiled, in blocks, so
    not even a boolean T x T mask is materialised."""
    return create_block_mask(mod, B, None, q, n_keys, device=device, _compile=device.type != "cpu")


def score_mod(bias: torch.Tensor | None, visible: Callable | None = None) -> Callable | None:
    """score_mod adding the per-(row, head, key) logit bias `bias` [B, H, n_keys], and with
    `visible` (a mask_mod) sending the keys it hides to -inf.

    Why `visible` here: a block mask is built outside the kernel from Python values, which a
    captured decode step cannot rebuild per step; a one-query step reads every cache slot
    anyway, so masking in the score costs nothing a block mask would have skipped."""
    if bias is None and visible is None:
        return None

    def mod(score, b, h, q_idx, kv_idx):
        if bias is not None:
            score = score + bias[b, h, kv_idx]
        if visible is not None:
            score = torch.where(visible(b, h, q_idx, kv_idx), score, float("-inf"))
        return score

    return mod


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: BlockMask | None,
    bias: torch.Tensor | None,
    scale: float,
    *,
    lse: bool = False,
    visible: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One flex call: ([B, H, q, dv] output, and with `lse` the natural-log LSE [B, H, q]).

    The keys a query sees are given by the block mask `mask`, or with `mask` None by the
    mask_mod `visible` applied in the score (see `score_mod`). Grouped-query heads go through
    `enable_gqa` (no K/V copies). A query that sees no key through a block mask gets output 0
    and LSE -inf (flex's own convention); through `visible`, LSE -inf and an output that
    callers must not use (`system_share` gives pi = 0 there, which the engine checks).
    """
    fn = _flex_fn(query.device)
    kwargs = dict(score_mod=score_mod(bias, visible), block_mask=mask, scale=scale,
                  enable_gqa=query.shape[1] != key.shape[1], return_aux=AuxRequest(lse=True) if lse else None)
    if query.device.type == "cpu" and not torch.compiler.is_compiling():
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        with warnings.catch_warnings(), _without_dynamo(not grad):
            # Eager is deliberate on CPU (compiled CPU flex cannot return the LSE).
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
            result = fn(query, key, value, **kwargs)
    else:
        result = fn(query, key, value, **kwargs)
    if lse:
        out, aux = result
        # flex reports the natural-log LSE (it rescales its kernels' base-2 statistics).
        return out, aux.lse.float()
    return result, None


def system_share(lse_all: torch.Tensor, lse_sys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pi, 1 - pi), each [B, H, q, 1] float32, from the two calls' LSEs.

    A query that sees no system key has LSE_sys = -inf (pi = 0, rest = 1); a query that sees
    no key at all (left padding) also has LSE_all = -inf: -inf - -inf would be NaN.
    """
    seen = torch.isfinite(lse_sys)
    delta = torch.where(seen, (lse_sys - lse_all).clamp(max=0.0), torch.full_like(lse_sys, float("-inf")))
    delta = delta[..., None]
    return delta.exp(), -torch.expm1(delta)
