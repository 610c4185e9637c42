"""The engine's FlexAttention path (flex.py) against the same independent eager reference.

Why: on CUDA the intervention path runs on FlexAttention (bias as a score_mod, masks as
block masks, pi and split-softmax from two calls' log-sum-exps), a different computation
from the CPU's SDPA path. FlexAttention also runs on the CPU (eager, unfused), so with
DRIFTLAB_ATTENTION_KERNEL=flex every mode is checked here against `attention_reference.py`
with the tolerances the SDPA path gets, on the models of test_attention_engine (tiny Qwen2 and
Gemma3: 4 query / 2 KV heads, Gemma3 with sliding-window layers, for every case; SmolLM2: 9 / 3,
for each matrix's "composed" case and the flex-vs-SDPA pi check).
The path may hand a call back to SDPA (a mask it does not recognise); here that is an error,
so every comparison really exercises flex.
"""

from __future__ import annotations

import math

import pytest
import torch

import test_attention_engine as base
from driftlab.attention import engine as engine_module
from driftlab.attention import flex
from driftlab.attention.kernels import system_share
from driftlab.errors import DriftlabError
from driftlab.steering import Interventions
from test_attention_engine import (  # noqa: F401  (fixtures, used by name)
    CASES,
    DECODE_CASES,
    LOGIT_TOL,
    PI_TOL,
    REFERENCE,
    _implementations,
    backend,
    gemma,
    max_diff,
    on_models,
    on_tiny_models,
    plain_prefill,
    prefill,
    real_positions,
    tiny_dirs,
)


@pytest.fixture(autouse=True)
def _flex_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_module.KERNEL_ENV, "flex")

    def declined(reason: str) -> None:
        raise AssertionError(f"the flex path fell back to SDPA: {reason}")

    monkeypatch.setattr(engine_module, "_flex_declined", declined)


# -- flex.py alone, on random tensors ------------------------------------------------------------
def _hand_attention(q, k, v, allowed, bias, scale):
    """Textbook softmax attention in float64: (out, natural-log LSE); GQA by repeating K/V."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    logits = q.double() @ k.transpose(-1, -2) * scale + bias.double()[:, :, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    weights = torch.softmax(logits, -1).nan_to_num(0.0)
    return weights @ v, lse


@pytest.mark.parametrize("q,window", [(12, None), (12, 5), (1, None), (1, 5)])
def test_flex_unit_bias_padding_and_system_lse(q: int, window: int | None, device, tol) -> None:
    """On the test device (`--device cuda`: the compiled kernels, with their LSE), against a float64 hand reference."""
    torch.manual_seed(0)
    B, H, Hkv, K, d = 3, 4, 2, 12, 16
    query, key, value = (torch.randn(B, H, q, d, device=device), torch.randn(B, Hkv, K, d, device=device),
                         torch.randn(B, Hkv, K, d, device=device))
    bias = torch.randn(B, H, K, device=device) * 2
    first = torch.tensor([0, 3, 11], device=device)  # row 2: only the last key is real
    a, b = 2, 7  # system slots: [2, 7) of every row that has them there
    sys_keys = torch.zeros(B, b - a, dtype=torch.bool, device=device)
    sys_keys[0], sys_keys[1, 1:] = True, True
    scale = 0.3

    pos_q = torch.arange(K - q, K, device=device)[:, None]
    pos_k = torch.arange(K, device=device)[None, :]
    allowed = (pos_k[None] >= first[:, None, None]) & (pos_k <= pos_q)[None]
    if window is not None:
        allowed = allowed & (pos_q - pos_k < window)[None]
    allowed = allowed[:, None]  # [B, 1, q, K]
    sys_allowed = torch.zeros_like(allowed)
    sys_allowed[..., a:b] = allowed[..., a:b] & sys_keys[:, None, None, :]

    full = flex.block_mask(flex.visible_mod(first, q, K, window), B, q, K, query.device)
    sys_mask = flex.block_mask(flex.visible_mod(first, q, K, window, a, sys_keys), B, q, b - a, query.device)
    out, lse_all = flex.attend(query, key, value, full, bias, scale, lse=True)
    o_sys, lse_sys = flex.attend(query, key[:, :, a:b], value[:, :, a:b], sys_mask, bias[..., a:b], scale, lse=True)
    want, want_lse = _hand_attention(query, key, value, allowed, bias, scale)
    want_sys, want_lse_sys = _hand_attention(query, key, value, sys_allowed, bias, scale)

    assert (out.double() - want).abs().max() < tol(1e-5) and (o_sys.double() - want_sys).abs().max() < tol(1e-5)
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse_all))
    # flex's LSE is the natural log (its kernels keep base-2 statistics and rescale them):
    # a base-2 LSE would be off by a factor ln 2 ~ 0.69, far beyond this tolerance.
    assert (lse_all.double()[finite] - want_lse[finite]).abs().max() < tol(1e-5)
    assert (lse_all.double()[finite] * math.log(2) - want_lse[finite]).abs().max() > 0.1
    pi, rest = system_share(lse_all, lse_sys)
    weights = torch.softmax(
        (query.double() @ key.repeat_interleave(2, 1).double().transpose(-1, -2) * scale + bias.double()[:, :, None])
        .masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    want_pi = (weights * sys_allowed).sum(-1, keepdim=True)
    assert (pi.double() - want_pi).abs().max() < tol(1e-6)
    assert (pi + rest - 1).abs().max() < tol(1e-6)
    # Fully masked queries (left padding) and rows without system keys: zeros, never NaN.
    assert not (out.isnan().any() or o_sys.isnan().any() or pi.isnan().any() or rest.isnan().any())
    if q == K:
        assert bool((pi[1, :, :3] == 0).all()) and bool((out[1, :, :3] == 0).all())
    assert bool((pi[2] == 0).all()) and bool((rest[2, :, -1] == 1).all())  # row 2 has no system key


def _listed(mask, n_keys: int) -> torch.Tensor:
    """[B, n_keys] bool: the keys inside the key blocks a decode BlockMask lists (its dense form)."""
    from driftlab.attention.state import DECODE_BLOCK

    dense = mask.to_dense()[:, 0, 0].bool()  # [B, blocks]
    return dense.repeat_interleave(DECODE_BLOCK, dim=-1)[:, :n_keys]


@pytest.mark.parametrize("window", [None, 4])
def test_flex_unit_decode_step_through_block_masks_from_tensors(window: int | None, device, tol) -> None:
    """A decode step: one query at slot 200 of 300 (the third key block not yet filled), its slot
    and the system call's key offset 0-d tensors, block masks listing whole key blocks built from
    tensors (`decode_block_mask`). Same hand reference as above; unfilled slots, padding and the
    window must stay hidden, and every key the query sees must lie in a listed block (eager flex on
    a CPU computes densely, so the block lists are checked through their dense form)."""
    from driftlab.attention.state import DECODE_BLOCK

    torch.manual_seed(1)
    B, H, Hkv, K, d, at = 3, 4, 2, 300, 16, 200
    query, key, value = (torch.randn(B, H, 1, d, device=device), torch.randn(B, Hkv, K, d, device=device),
                         torch.randn(B, Hkv, K, d, device=device))
    bias = torch.randn(B, H, K, device=device) * 2
    first, slot = torch.tensor([0, 3, 150], device=device), torch.tensor(at, device=device)
    a, b = 0, 140  # the system-only call covers slots [0, 140); row 2 has no system key
    sys_keys = torch.zeros(B, b - a, dtype=torch.bool, device=device)
    sys_keys[0, 1:4], sys_keys[1, 3:6], sys_keys[1, 130:133] = True, True, True
    pos_k = torch.arange(K, device=device)
    allowed = (pos_k[None] >= first[:, None]) & (pos_k <= at)
    if window is not None:
        allowed = allowed & (at - pos_k < window)
    sys_allowed = allowed.clone()
    sys_allowed[:, b:] = False
    sys_allowed[:, a:b] &= sys_keys
    scale = 0.3

    def blocks(n_keys: int, filled: int):
        n = -(-n_keys // DECODE_BLOCK)
        order = torch.arange(n, dtype=torch.int32, device=device).view(1, 1, 1, n).expand(B, 1, 1, n)
        return torch.full((B, 1, 1), filled, dtype=torch.int32, device=device), order

    full = flex.decode_block_mask(*blocks(K, at // DECODE_BLOCK + 1), flex.visible_mod(first, 1, K, window,
                                                                                         shift=slot), K)
    offset = torch.tensor(a, device=device)
    sys_mask = flex.decode_block_mask(*blocks(b - a, 2), flex.visible_mod(first, 1, K, window, offset, sys_keys,
                                                                          shift=slot), b - a)
    listed = _listed(full, K)
    assert bool((listed >= allowed).all()) and not bool(listed[:, 2 * DECODE_BLOCK :].any())  # filled blocks only
    assert bool((_listed(sys_mask, b - a) >= sys_allowed[:, a:b]).all())
    out, lse_all = flex.attend(query, key, value, full, bias, scale, lse=True)
    o_sys, lse_sys = flex.attend(query, key[:, :, a:b], value[:, :, a:b], sys_mask, bias[..., a:b], scale, lse=True)
    want, want_lse = _hand_attention(query, key, value, allowed[:, None, None], bias, scale)
    want_sys, _ = _hand_attention(query, key, value, sys_allowed[:, None, None], bias, scale)
    assert (out.double() - want).abs().max() < tol(1e-5) and (lse_all.double() - want_lse).abs().max() < tol(1e-5)
    assert (o_sys[:2].double() - want_sys[:2]).abs().max() < tol(1e-5)  # row 2's is unused (pi = 0)
    pi, rest = system_share(lse_all, lse_sys)
    logits = (query.double() @ key.repeat_interleave(2, 1).double().transpose(-1, -2) * scale
              + bias.double()[:, :, None]).masked_fill(~allowed[:, None, None], float("-inf"))
    want_pi = (torch.softmax(logits, -1) * sys_allowed[:, None, None]).sum(-1, keepdim=True)
    assert (pi.double() - want_pi).abs().max() < tol(1e-6) and bool((pi[2] == 0).all()) and bool((rest[2] == 1).all())
    assert not (pi.isnan().any() or rest.isnan().any())


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (7, 1), (3, 3)])
def test_flex_unit_steered_decode_step_folds_odd_query_groups(heads: int, kv_heads: int, device, tol) -> None:
    """The steered decode step's flex call (`DecodeMods`, `attend_decode`): key-bias slots read
    per (row, key) and per (row, head), the key pattern from the first-slot and slot tensors. A
    group of query heads per KV head that is not a power of two (3, 7: Qwen2.5-7B's 28/4) is folded
    into query rows; the result must equal the hand reference with its heads in their own order."""
    from driftlab.attention.state import DECODE_BLOCK

    torch.manual_seed(2)
    B, K, d, at = 2, 260, 16, 140
    query = torch.randn(B, heads, 1, d, device=device)
    key, value = torch.randn(B, kv_heads, K, d, device=device), torch.randn(B, kv_heads, K, d, device=device)
    keys = torch.randn(2, B, K, device=device)  # two bias slots [J, B, K]
    head_sel = (torch.rand(2, B, heads, device=device) > 0.5).float()  # their heads [J, B, H]
    first, slot = torch.tensor([0, 9], device=device), torch.tensor(at, device=device)
    group = flex.fold(query, kv_heads)
    assert group == (heads // kv_heads if (heads // kv_heads) in (3, 7) else 1)
    mods = flex.DecodeMods(first, slot, keys, head_sel, group)
    n = -(-K // DECODE_BLOCK)
    order = torch.arange(n, dtype=torch.int32, device=device).view(1, 1, 1, n).expand(B, 1, 1, n)
    filled = torch.full((B, 1, 1), at // DECODE_BLOCK + 1, dtype=torch.int32, device=device)
    mask = flex.decode_block_mask(filled, order, mods.visible, K, group)
    out, lse = flex.attend_decode(query, key, value, mask, mods, 0.25)
    pos = torch.arange(K, device=device)
    allowed = (pos[None] >= first[:, None]) & (pos[None] <= at)
    bias = (keys[:, :, None, :] * head_sel[:, :, :, None]).sum(0)  # [B, H, K]
    want, want_lse = _hand_attention(query, key, value, allowed[:, None, None], bias, 0.25)
    assert out.shape == (B, heads, 1, d) and lse.shape == (B, heads, 1)
    assert (out.double() - want).abs().max() < tol(1e-5) and (lse.double() - want_lse).abs().max() < tol(1e-5)


def test_flex_fn_on_a_gpu_is_compiled_once_with_a_raised_recompile_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of `_flex_fn` (no GPU needed: torch.compile is lazy): one compiled
    function, and dynamo's cache limit raised so flex never falls back to its T x T math path."""
    from torch._dynamo import config

    monkeypatch.setattr(flex, "_compiled", None)
    with config.patch(cache_size_limit=8):  # torch's patch API: monkeypatch would hide the entry on undo
        fn = flex._flex_fn(torch.device("cuda"))
        assert fn is flex._flex_fn(torch.device("cuda")) and fn is not flex.flex_attention
        assert config.cache_size_limit >= 256
    assert flex._flex_fn(torch.device("cpu")) is flex.flex_attention


@pytest.mark.compile
def test_a_flex_call_under_a_dispatch_mode_leaves_compiled_flex_working(device, tol, monkeypatch) -> None:
    """A flex call while a TorchDispatchMode is active (a profiler, a FLOP counter, a host-read
    counter) runs eager flex without dynamo, never the compiled function: entering it under a mode
    made every later compiled flex call of the process trace flex's dense fallback and fail
    ("Attempted to call function marked as skipped", torch._safe_softmax; an H200 with torch 2.11,
    and a CPU with torch 2.13 once flex is compiled there, as here). Same numbers on each route."""
    from host_reads import HostReads

    monkeypatch.setattr(flex, "COMPILED_DEVICES", (device.type,))
    monkeypatch.setattr(flex, "_compiled", None)
    torch.manual_seed(3)
    B, H, K, d = 2, 4, 40, 16
    query, key, value = (torch.randn(B, H, 1, d, device=device), torch.randn(B, 2, K, d, device=device),
                         torch.randn(B, 2, K, d, device=device))
    bias = torch.randn(B, H, K, device=device)
    first = torch.tensor([0, 5], device=device)
    mask = flex.block_mask(flex.visible_mod(first, 1, K, None), B, 1, K, device)
    lse = device.type != "cpu"  # a CPU's compiled flex returns no LSE
    want, _ = flex.attend(query, key, value, mask, bias, 0.25, lse=lse)
    assert flex._route(query) == "compiled" and flex._compiled is not None
    with HostReads():
        assert flex._route(query) == "eager"
        under, _ = flex.attend(query, key, value, mask, bias, 0.25, lse=lse)
    after, _ = flex.attend(query, key, value, mask, bias, 0.25, lse=lse)
    assert (under - want).abs().max() < tol(1e-5) and (after - want).abs().max() < tol(1e-6)


# -- the kernel setting ---------------------------------------------------------------------------
def test_kernel_setting_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from driftlab import cuda_support

    monkeypatch.setattr(cuda_support, "TORCH_RANGE", f"=={cuda_support.Version(torch.__version__).base_version}")
    assert engine_module.kernel_for(torch.device("cpu")) == "flex"
    for value, cpu, cuda in (("auto", "sdpa", "flex"), ("", "sdpa", "flex"), ("SDPA", "sdpa", "sdpa"),
                             ("flex", "flex", "flex")):
        monkeypatch.setenv(engine_module.KERNEL_ENV, value)
        assert engine_module.kernel_for(torch.device("cpu")) == cpu
        assert engine_module.kernel_for(torch.device("cuda")) == cuda
    monkeypatch.setenv(engine_module.KERNEL_ENV, "flash")
    with pytest.raises(DriftlabError, match="DRIFTLAB_ATTENTION_KERNEL='flash'") as err:
        engine_module.kernel_for(torch.device("cpu"))
    assert "auto, flex, sdpa" in err.value.hint
    q = k = v = torch.randn(1, 4, 6, 8)
    with pytest.raises(DriftlabError, match="not an attention kernel"):
        engine_module.driftlab_attention(base._Layer(1), q, k, v, None, driftlab=base._state())


def test_a_cuda_torch_outside_the_tested_range_takes_sdpa_and_the_dynamic_loop_said_once(monkeypatch, capsys) -> None:
    """The torch range the CUDA fast path has run on is declared once (`cuda_support.TORCH_RANGE`). On
    CUDA with another torch, auto runs the SDPA kernels and the dynamic decode loop, said in one
    line once per process; an explicit flex still gets flex, and the CPU is not concerned."""
    from driftlab import cuda_support
    from driftlab.chat.static_decode import auto_decode

    cuda = torch.device("cuda")
    assert cuda_support.tested("2.11.0+cu130") and cuda_support.tested("2.11.1")
    assert not cuda_support.tested("2.10.0") and not cuda_support.tested("2.13.0+cu130")
    monkeypatch.setenv(engine_module.KERNEL_ENV, "auto")
    monkeypatch.setattr(cuda_support, "_said", False)
    for version, kernel, loop in (("2.11.0+cu130", "flex", "compiled"), ("2.13.0+cu130", "sdpa", "dynamic")):
        monkeypatch.setattr(cuda_support.torch, "__version__", version)
        assert [engine_module.kernel_for(cuda), auto_decode(cuda), engine_module.kernel_for(cuda)] == [kernel, loop, kernel]
        assert auto_decode(torch.device("cpu")) == "dynamic"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "torch 2.13.0+cu130 is outside" in lines[0] and cuda_support.TORCH_RANGE in lines[0], lines
    monkeypatch.setenv(engine_module.KERNEL_ENV, "flex")
    assert engine_module.kernel_for(cuda) == "flex"


def test_auto_keeps_the_cpu_on_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default on CPU never enters flex: the CPU path keeps its guarantees and speed."""
    monkeypatch.setenv(engine_module.KERNEL_ENV, "auto")

    def no_flex(*args, **kwargs):
        raise AssertionError("flex ran on CPU under auto")

    monkeypatch.setattr(flex, "attend", no_flex)
    q = k = v = torch.randn(1, 4, 6, 8)
    out, _ = engine_module.driftlab_attention(base._Layer(1), q, k, v, None, driftlab=base._state())
    assert out.shape == (1, 6, 4, 8)


# -- whole models against the reference -----------------------------------------------------------
@on_models(list(CASES))
def test_flex_prefill_matches_reference(backend, case: str) -> None:  # noqa: F811 (fixture imported from test_attention_engine)
    cfg = CASES[case]
    plain, _, pads = plain_prefill(backend)
    assert min(pads) == 0 and max(pads) > 0  # left-padded batch
    got, pi, _ = prefill(backend, cfg)
    want, pi_ref, _ = prefill(backend, cfg, impl=REFERENCE)
    assert max_diff(got, want, pads, dim=1) <= LOGIT_TOL
    if cfg.fingerprint():
        assert max_diff(got, plain, pads, dim=1) > 100 * LOGIT_TOL
    else:
        # Tracing runs the main call on flex while the plain model runs SDPA: equal within
        # float tolerance (the SDPA path, where both are the same kernel, is bit-equal).
        assert max_diff(got, plain, pads, dim=1) <= LOGIT_TOL
    assert not got.isnan().any()  # padding queries see no key: no NaN to leak anywhere
    if "trace" in cfg.kinds:
        assert max_diff(pi, pi_ref, pads, dim=3) <= PI_TOL
        real = torch.cat([p.flatten() for p in real_positions(pi, pads, 3)])
        assert real.min() >= 0 and real.max() <= 1 and 0.05 < real.mean() < 0.999


# Eager flex on a CPU costs ~0.5 s per decode step on SmolLM2 (30 layers, two calls each): 6 steps,
# not the SDPA path's 12, check the same per-step code; the batch test reuses the "composed" run
# (on the tiny models: SmolLM2's one flex decode is the "composed" case's).
FLEX_DECODE_TOKENS = 6


@on_models(DECODE_CASES)
def test_flex_greedy_decode_matches_reference(backend, case: str) -> None:  # noqa: F811 (fixture imported from test_attention_engine)
    base.test_greedy_decode_matches_reference(backend, case, new_tokens=FLEX_DECODE_TOKENS)


@on_tiny_models
def test_flex_batch_rows_match_solo_runs(backend) -> None:  # noqa: F811 (fixture imported from test_attention_engine)
    base.test_batch_rows_match_solo_runs(backend, new_tokens=FLEX_DECODE_TOKENS)


@on_tiny_models
def test_flex_uses_gqa_without_copies(backend, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 (fixture imported from test_attention_engine)
    """Every model here has fewer KV heads than query heads; flex gets the KV heads as they are."""
    seen: list[tuple[int, int]] = []
    real = flex.attend

    def spy(query, key, *args, **kwargs):
        seen.append((query.shape[1], key.shape[1]))
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(flex, "attend", spy)
    prefill(backend, CASES["composed"])
    L, H = base._dims(backend)
    n_kv = backend.model.config.get_text_config().num_key_value_heads
    assert n_kv < H and seen and set(seen) == {(H, n_kv)}


@pytest.mark.parametrize("case", ["trace", "composed"])
def test_flex_sliding_window_decode_equals_full_recompute(gemma, case: str) -> None:  # noqa: F811 (fixture imported from test_attention_engine)
    base.test_sliding_window_decode_equals_full_recompute(gemma, case)


@pytest.mark.model
def test_flex_pi_equals_sdpa_pi_on_smollm2(smol32, monkeypatch: pytest.MonkeyPatch, tol) -> None:
    """pi from the two flex calls' LSEs = pi from the CPU flash kernel's LSEs (the SDPA path)."""
    cfg = Interventions.parse(["trace", "split-softmax:k=0.7,heads=0-10", "instaboost:m=4"])
    pis, logits = {}, {}
    for kernel in ("sdpa", "flex"):
        monkeypatch.setenv(engine_module.KERNEL_ENV, kernel)
        logits[kernel], pis[kernel], pads = prefill(smol32, cfg)
    assert max_diff(pis["flex"], pis["sdpa"], pads, dim=3) <= tol(1e-5)
    assert max_diff(logits["flex"], logits["sdpa"], pads, dim=1) <= LOGIT_TOL
