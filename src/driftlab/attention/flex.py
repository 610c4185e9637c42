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
first use), except under a TorchDispatchMode (`_route` says why). On CPU, torch 2.13's compiled flex cannot return the LSE, so the CPU runs eager
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
from torch.utils._python_dispatch import _get_current_dispatch_mode

from driftlab.attention.state import DECODE_BLOCK

# Dynamo compiles one graph per distinct (shapes, score_mod, mask) combination; past the
# default limit of 8 it stops compiling and flex silently runs its T x T math fallback
# (seen on an H100: a 128 GiB allocation at 32k keys). Prefill, decode, biased and
# unbiased, all-key and system-only calls of one run easily exceed 8.
_RECOMPILE_LIMIT = 256
_compiled: Callable | None = None


def _flex_fn(device: torch.device) -> Callable:
    """flex_attention, compiled once per process on GPUs; eager on a CPU (see module doc).

    Inside a compiled region (a static decode step) it is the plain op: the enclosing
    compilation fuses it, and nothing global may change while dynamo traces."""
    global _compiled
    if device.type not in COMPILED_DEVICES or torch.compiler.is_compiling():
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
    """Run eager flex without its dynamo trace (the eager route of `_route`, inference only).

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


def visible_mod(first: torch.Tensor, q: int, K: int, window: int | None, key_offset: int | torch.Tensor = 0,
                keys: torch.Tensor | None = None, shift: int | torch.Tensor | None = None) -> Callable:
    """mask_mod of the keys a query may see: query i sits at key slot `shift` + i (default
    K - q: the queries are the last q of K keys; a decode step passes its query's slot as a 0-d
    tensor, which a compiled flex reads without specialising on it, and so the key offset).

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


def score_mod(bias: torch.Tensor | None) -> Callable | None:
    """score_mod adding the per-(row, head, key) logit bias `bias` [B, H, n_keys]."""
    if bias is None:
        return None

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, kv_idx]

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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One flex call: ([B, H, q, dv] output, and with `lse` the natural-log LSE [B, H, q]).

    The keys a query sees are given by the block mask `mask`. Grouped-query heads go through
    `enable_gqa` (no K/V copies). A query that sees no key gets output 0 and LSE -inf (flex's
    own convention; `system_share` gives pi = 0 there).
    """
    result = _call(query, key, value, score_mod=score_mod(bias), block_mask=mask, scale=scale,
                   enable_gqa=query.shape[1] != key.shape[1], return_aux=AuxRequest(lse=True) if lse else None)
    if lse:
        out, aux = result
        # flex reports the natural-log LSE (it rescales its kernels' base-2 statistics).
        return out, aux.lse.float()
    return result, None


def _call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs):
    """flex_attention, by the one route that is safe for this call (`_route`): the plain op inside
    a compiled region, the module's compiled function on a GPU, else eager flex without its
    dynamo trace where no gradient is asked (`_without_dynamo`)."""
    route = _route(query)
    if route == "traced":
        return flex_attention(query, key, value, **kwargs)
    if route == "compiled":
        return _flex_fn(query.device)(query, key, value, **kwargs)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    with warnings.catch_warnings(), _without_dynamo(not grad):
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
        return flex_attention(query, key, value, **kwargs)


# Device types on which flex runs compiled (a test widens it to reach that route on a CPU).
COMPILED_DEVICES = ("cuda",)


def _route(query: torch.Tensor) -> str:
    """How a flex call runs: "traced" inside a compiled region (the enclosing compile fuses it),
    "compiled" on a GPU, "eager" on a CPU (compiled CPU flex cannot return the LSE) and wherever a
    TorchDispatchMode is active.

    Why the last: dynamo does not compile a frame while a dispatch mode is on the stack (a profiler,
    a FLOP counter, a test's host-read counter). The compiled function then runs flex eagerly, whose
    own eager route compiles a wrapper of flex's operator with fullgraph=True, and from then on
    every compiled flex call of the process traces flex's dense fallback (`sdpa_dense`) and fails
    ("Attempted to call function marked as skipped": torch._safe_softmax; seen on an H200 with torch
    2.11 and reproduced on a CPU with torch 2.13). Never entering the compiled function under a mode
    makes that impossible."""
    if torch.compiler.is_compiling():
        return "traced"
    if query.device.type in COMPILED_DEVICES and _get_current_dispatch_mode() is None:
        return "compiled"
    return "eager"


def decode_block_mask(blocks: torch.Tensor, order: torch.Tensor, mask_mod: Callable, n_keys: int,
                      q_len: int = 1) -> BlockMask:
    """A decode step's BlockMask from tensors: `blocks` [B, 1, 1] int32 key blocks to visit
    (the filled ones, or a row's system blocks), `order` [B, 1, 1, n] int32 their indices first.

    Why from tensors: without a block mask flex uses one block of 2^30 keys, so its decoding
    kernel cannot split the keys over programs (one program per head reads them all) and reads
    the unfilled slots of a static cache too; `create_block_mask` evaluates `mask_mod` over the
    whole key range from Python values, per step. Built from a count computed inside the
    compiled step, the mask lists only the blocks to read, and nothing is rebuilt on the host.
    Every listed block is partial (`mask_mod` applies in it): the last filled block is always
    partial, and left padding or a system span rarely fills a block.

    Both tensors are made contiguous: flex's Triton kernels (flex_attention.py.jinja and
    flex_decode.py.jinja, torch 2.9-2.13) find a row's block list at (b * heads + h) * stride(1),
    never reading the batch stride. An `expand`ed order (batch stride 0) then sends row b >= 1
    past the tensor's storage, to whatever the allocator left there: block indices out of range,
    the suspected cause of an illegal memory access on an H200 (torch 2.11; docs/performance.md,
    hypothesis H-A). Copied only where they are not (a compiled step keeps its static tensors as
    graph inputs)."""
    blocks, order = (t if t.is_contiguous() else t.contiguous() for t in (blocks, order))
    return BlockMask.from_kv_blocks(blocks, order, BLOCK_SIZE=DECODE_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(q_len, n_keys), compute_q_blocks=False)


def fold(query: torch.Tensor, n_kv: int) -> int:
    """How many query heads a decode step folds into query rows per KV head: the group size when
    it is not a power of two (Qwen2.5-7B's 28/4 = 7), where flex's decoding kernel would not
    take the grouped heads itself; 1 (no folding: `enable_gqa`) otherwise. A compiled step keeps
    the cache's head counts static (`StaticDecoder._call`), so this is a Python int there too: the
    bias score_mod computes a head index from it."""
    group = query.shape[1] // n_kv
    return group if group > 1 and group & (group - 1) else 1


class DecodeMods:
    """The score and mask functions of a static layout's steered decode step, over tensors only.

    `first` [B] each row's first real slot, `slot` [] the query's slot, `keys` [J, B, K] and
    `heads` [J, B, H] the layer's key-bias slots (zeros where unused: inert). With `group` > 1 the
    query heads of a KV head are folded into query rows (see `fold`): flex's head index h and
    query index q then name query head h * group + q, which every query row shares the slot of.
    """

    def __init__(self, first: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor, heads: torch.Tensor,
                 group: int = 1) -> None:
        self.first, self.slot, self.keys, self.heads, self.group = first, slot, keys, heads, group

    def visible(self, b, h, q_idx, kv_idx):
        return (kv_idx >= self.first[b]) & (kv_idx <= self.slot)

    def visible_system(self, system: torch.Tensor) -> Callable:
        def mod(b, h, q_idx, kv_idx):
            return self.visible(b, h, q_idx, kv_idx) & system[b, kv_idx]
        return mod

    def score(self, score, b, h, q_idx, kv_idx):
        head = h * self.group + q_idx if self.group > 1 else h
        for j in range(self.keys.shape[0]):
            score = score + self.keys[j, b, kv_idx] * self.heads[j, b, head]
        return score


# kernel_options of a decode step whose batch is concrete (a compiled step per batch bucket on
# CUDA): flex's split-KV decoding kernel, asked for by name, so a shape it cannot take fails the
# compile (and is said, and recorded) instead of running the generic kernel unnoticed.
DECODE_KERNEL = {"BACKEND": "TRITON_DECODE"}


def decode_options(state) -> dict | None:
    """The kernel options of a static layout's decode step: the decode kernel where its compiled
    step asks for it (`AttentionState.decode_kernel`), else flex's choice."""
    return DECODE_KERNEL if state.decode_kernel else None


def attend_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, mods: DecodeMods,
                  scale: float, kernel_options: dict | None = None, *,
                  lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode query per row through `mask` with `mods`' key bias: ([B, H, 1, dv], natural-log
    LSE [B, H, 1] float32, or None without `lse`). With `mods.group` > 1 the grouped query heads
    are query rows; a plain step (`mods.keys` None) adds no score term."""
    B, H, _, d = query.shape
    n_kv = key.shape[1]
    if mods.group > 1:
        query = query.reshape(B, n_kv, mods.group, d)
    result = _call(query, key, value, score_mod=mods.score if mods.keys is not None else None, block_mask=mask,
                   scale=scale, enable_gqa=query.shape[1] != n_kv, kernel_options=kernel_options,
                   return_aux=AuxRequest(lse=True) if lse else None)
    out, aux = result if lse else (result, None)
    out = out.reshape(B, H, 1, out.shape[-1])
    if aux is None:
        return out, None
    return out, (aux.lse if aux.lse.dtype == torch.float32 else aux.lse.float()).reshape(B, H, 1)
