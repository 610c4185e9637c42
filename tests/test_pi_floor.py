"""pi-floor, the engine side: the system keys get at least a floor of the attention.

pi-floor rescales a head's attention like split-softmax, exactly and in O(T) memory, with the
target mass t = max(pi^k, floor[b, l, h]) (k = 1 where split-softmax is off), on the queries from
each row's first floor slot on (`AttentionState.set_floors(values, first_query)`). Checked here:

1. the engine equals the slow eager reference (tests/attention_reference.py, which rescales the
   materialised weights) on a left-padded prefill and through the dynamic decode loop: three rows
   with different floors and first slots (one acting only from the third generated token on),
   alone and composed with split-softmax (k < 1) and with key biases (InstABoost, a bias), on
   tiny Qwen2, Llama, Gemma3 (sliding windows) and Qwen2 with a query group of 7, and on the real
   SmolLM2-135M;
2. after the hook the system keys hold at least the floor at every head and query from the first
   slot on (measured through the engine itself, with V replaced by indicator channels); a floor
   that does not bind leaves every logit bit for bit as it is, and so does any floor on the queries
   before the first slot; `kernels.split_softmax` alone, on random tensors, for the same and for
   its guards;
3. a static layout's decode step (eager and compiled) equals the dynamic loop, and a compiled step
   compiles no second graph when the floor changes from zeros to values;
4. the FlexAttention path (on the CPU, eager) equals the SDPA path with a floor.

Each comparison also checks that the floor changes the outputs, or that a wrong floor is caught,
so agreement is never agreement on a no-op. The backend does not set floors yet (it will, from
`AttentionConfig.pi_floor`); the tests here call `set_floors` after every `on_layout`, each row's
floors looked up by its prompt length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from attention_reference import NAME as REFERENCE
from attention_reference import _key_slots, both_engines_on_one_thread, left_padded
from devices import backend_device, cpu_only, current, exact, tol
from driftlab.attention import ATTENTION_NAME, kernels
from driftlab.attention import engine as engine_module
from driftlab.attention.config import AttentionConfig, BiasTerm
from driftlab.attention.state import AttentionState
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.errors import DriftlabError
from driftlab.steering import Interventions
from tiny_models import make_tiny_model

LOGIT_TOL = 5e-4  # as tests/test_attention_engine.py: fp32 logits, engine vs reference
PI_TOL = 1e-5  # fp32 attention mass
SLIDING_WINDOW = 8
FAMILIES = ("qwen2", "llama", "gemma3", "qwen2-gqa7")
CHECK = "driftlab_floorcheck"  # the engine, also measuring the mass it leaves on the system keys

CONVS = [
    [{"role": "system", "content": "You are a pirate. Always answer like a pirate, arr, and never stop."},
     {"role": "user", "content": "Hello! Could you tell me how to bake a loaf of bread at home?"}],
    [{"role": "system", "content": "Réponds toujours en français."},
     {"role": "user", "content": "What is the capital of Italy?"}],
    [{"role": "system", "content": "Answer briefly and politely."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
CASES = {
    "floor": [],
    "floor+split": ["split-softmax:k=0.6,heads=0-1"],
    "floor+instaboost": ["instaboost:m=4"],
    "floor+split+bias": ["split-softmax:k=0.7", "bias:value=-2.0,invert=true,heads=1.2+2.3"],
}
# The floors' range per case: InstABoost already puts 0.7-0.95 of the mass on these system prompts.
RANGES = {"floor+instaboost": (0.6, 0.95), "floor+split+bias": (0.5, 0.95)}
DECODE_CASES = ["floor", "floor+split+bias"]


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _implementations() -> Iterator[None]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    with both_engines_on_one_thread():
        AttentionInterface.register(CHECK, _floorcheck_attention)
        AttentionMaskInterface.register(CHECK, sdpa_mask)
        yield


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pi_floor")
    return {family: make_tiny_model(family, root / family, sliding_window=SLIDING_WINDOW) for family in FAMILIES}


_BACKENDS: dict[str, HFChatBackend] = {}


def _backend(path: str, name: str) -> HFChatBackend:
    if name not in _BACKENDS:
        _BACKENDS[name] = HFChatBackend(path, dtype="float32", device=backend_device(), prefix_cache_bytes=0)
    return _BACKENDS[name]


@pytest.fixture(scope="module", params=FAMILIES)
def backend(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> HFChatBackend:
    return _backend(str(tiny_dirs[request.param]), request.param)


@pytest.fixture(autouse=True)
def _strict_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call the flex path hands back to SDPA is an error (where a test asks for flex)."""
    def declined(reason: str) -> None:
        raise AssertionError(f"the flex path fell back to SDPA: {reason}")

    monkeypatch.setattr(engine_module, "_flex_declined", declined)


# -- floors ---------------------------------------------------------------------------------------
def _dims(backend: HFChatBackend) -> tuple[int, int]:
    cfg = backend.model.config.get_text_config()
    return cfg.num_hidden_layers, cfg.num_attention_heads


def conv_floors(backend: HFChatBackend, convs=CONVS, scale: float = 1.0,
                low_high: tuple[float, float] = (0.1, 0.7)) -> dict[int, tuple[torch.Tensor, int]]:
    """Per prompt length (each conversation's is different): (floors [L, H], first query).

    Row 0 from two tokens after its system prompt, row 1 on its last three prompt tokens, row 2
    from its third generated token (decode only), and no floor on layer 0 there; head 0 never has
    one. The floors, from `low_high` (0.1-0.7), times `scale`, bind on many heads and queries of these
    random models, not on all."""
    L, H = _dims(backend)
    out = {}
    for conv in convs:
        index = CONVS.index(conv)
        rendered = backend.render(conv)
        n, (_, end) = len(rendered.ids), rendered.system_span
        g = torch.Generator().manual_seed(100 + index)
        low, high = low_high
        values = (low + (high - low) * torch.rand(L, H, generator=g)) * scale
        values[:, 0] = 0.0
        if index == 2:
            values[0] = 0.0
        first = [end + 2, n - 3, n + 2][index]
        assert n not in out, "two conversations of one length"
        out[n] = (values.clamp(0.0, 1.0), first)
    return out


@contextlib.contextmanager
def floors_on_layout(table: dict[int, tuple[torch.Tensor, int]]) -> Iterator[None]:
    """`set_floors` after every `on_layout` (what the backend will do), each row's floors looked up
    by its prompt length (slots from its padding to the prompt's end)."""
    original = AttentionState.on_layout

    def on_layout(self, pads, prompt_len, max_len, ends=None):
        original(self, pads, prompt_len, max_len, ends)
        rows = [table[prompt_len - p] for p in pads]
        self.set_floors(torch.stack([v for v, _ in rows]), [f for _, f in rows])

    AttentionState.on_layout = on_layout
    try:
        yield
    finally:
        AttentionState.on_layout = original


# -- a prefill forward ------------------------------------------------------------------------------
@contextlib.contextmanager
def implementation(backend: HFChatBackend, name: str) -> Iterator[None]:
    backend.model.set_attn_implementation(name)
    try:
        yield
    finally:
        backend.model.set_attn_implementation(ATTENTION_NAME)


def prefill(backend: HFChatBackend, specs: list[str] | None, floors=None, impl: str = ATTENTION_NAME,
            convs=CONVS, trace: bool = True):
    """Full-logit forward of the left-padded batch: (logits [B, T, V], pi [B, L, H, T] or None,
    pads, first floor slots). `specs` None: no state at all (the plain model); `floors` the
    `conv_floors` table (None: no floor)."""
    ids, mask, pads, rendered = left_padded(backend, convs)
    T = ids.shape[1]
    extra, state, firsts = {}, None, None
    if specs is not None:
        iv = Interventions.parse([*specs, "trace"] if trace else specs) if specs or trace else Interventions()
        cfg = iv.attention() or AttentionConfig()
        cfg = cfg.model_copy(update={"trace_prefill": cfg.trace, "pi_floor": 1.0 if floors else 0.0})
        state = AttentionState(cfg, [{"system": [r.system_span]} for r in rendered], *_dims(backend), backend.device)
        state.on_layout(pads, T, T)
        if floors is not None:
            rows = [floors[len(r.ids)] for r in rendered]
            state.set_floors(torch.stack([v for v, _ in rows]), [f for _, f in rows])
            firsts = [p + f for p, (_, f) in zip(pads, rows, strict=True)]
        extra = state.forward_kwargs(T)
    with implementation(backend, impl), torch.inference_mode():
        out = backend.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                            use_cache=False, **extra)
    pi = None
    if state is not None and state.trace:
        pi = torch.stack([recs[0] for recs in state.records], dim=1)  # the prefill's record per layer: [B, L, H, T]
    return out.logits.float(), pi, pads, firsts


def max_diff(a: torch.Tensor, b: torch.Tensor, pads: list[int], dim: int) -> float:
    """Largest difference at real (non-padding) positions along `dim` (1: logits, 3: pi)."""
    def real(x: torch.Tensor, pad: int) -> torch.Tensor:
        return x.narrow(dim - 1, pad, x.shape[dim - 1] - pad)

    return max((real(x, p) - real(y, p)).abs().max().item() for x, y, p in zip(a, b, pads, strict=True))


# -- 1. the engine equals the eager reference ---------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_with_floors_matches_reference(backend: HFChatBackend, case: str) -> None:
    specs = CASES[case]
    floors = conv_floors(backend, low_high=RANGES.get(case, (0.1, 0.7)))
    got, pi, pads, _ = prefill(backend, specs, floors)
    want, pi_ref, _, _ = prefill(backend, specs, floors, impl=REFERENCE)
    assert max_diff(got, want, pads, dim=1) <= tol(LOGIT_TOL)
    assert max_diff(pi, pi_ref, pads, dim=3) <= tol(PI_TOL)
    # The floor acts: without it (the same steer) the logits move far beyond the tolerance ...
    unfloored, _, _, _ = prefill(backend, specs)
    assert max_diff(got, unfloored, pads, dim=1) > 100 * LOGIT_TOL
    # ... and the reference given other floors (first slots 3 tokens early, or half the floors) disagrees.
    shifted = {n: (v, f - 3) for n, (v, f) in floors.items()}
    for wrong in (shifted, conv_floors(backend, scale=0.5, low_high=RANGES.get(case, (0.1, 0.7)))):
        off, _, _, _ = prefill(backend, specs, wrong, impl=REFERENCE)
        assert max_diff(got, off, pads, dim=1) > 10 * LOGIT_TOL


@cpu_only("forces the extra-V-channel path on the CPU by hiding the CPU flash kernel")
@pytest.mark.parametrize("case", ["floor", "floor+split+bias"])
def test_channel_path_with_floors_matches_reference(backend: HFChatBackend, case: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """pi from indicator channels appended to V (where no kernel reports LSEs, e.g. CUDA's SDPA)."""
    monkeypatch.setattr(kernels, "CPU_FLASH", None)
    specs = CASES[case]
    floors = conv_floors(backend, low_high=RANGES.get(case, (0.1, 0.7)))
    got, pi, pads, _ = prefill(backend, specs, floors)
    want, pi_ref, _, _ = prefill(backend, specs, floors, impl=REFERENCE)
    assert max_diff(got, want, pads, dim=1) <= LOGIT_TOL and max_diff(pi, pi_ref, pads, dim=3) <= PI_TOL
    unfloored, _, _, _ = prefill(backend, specs)
    assert max_diff(got, unfloored, pads, dim=1) > 100 * LOGIT_TOL


def _chat(backend: HFChatBackend, specs: list[str], floors, convs=CONVS, sampling=None, **request) -> list:
    sampling = sampling or Sampling(greedy=True, max_new_tokens=8, ignore_eos=True)
    iv = Interventions.parse(specs)
    with floors_on_layout(floors) if floors is not None else contextlib.nullcontext():
        return backend.generate(ChatRequest(convs, sampling, interventions=iv, **request))


def _logprobs(replies) -> np.ndarray:
    """[rows, steps, 3]: each generated token's log-probability and its 2 best alternatives'."""
    return np.array([[[t.logprob, *(lp for _, lp in t.top)] for t in r.logprobs] for r in replies])


def assert_same_decode(got: list, want: list, pi_tol: float = PI_TOL) -> None:
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.trace.decode, w.trace.decode, atol=tol(pi_tol), rtol=0)


@pytest.mark.parametrize("case", DECODE_CASES)
def test_dynamic_decode_with_floors_matches_reference(backend: HFChatBackend, case: str) -> None:
    """Through the backend's decode loop: the same greedy tokens and decode pi as the reference;
    row 2's floor starts at its third generated token."""
    specs = [*CASES[case], "trace"]
    floors = conv_floors(backend, low_high=RANGES.get(case, (0.1, 0.7)))
    got = _chat(backend, specs, floors, logprobs=2)
    with implementation(backend, REFERENCE):
        want = _chat(backend, specs, floors, logprobs=2)
    assert_same_decode(got, want)
    np.testing.assert_allclose(_logprobs(got), _logprobs(want), atol=tol(1e-4), rtol=0)
    plain = _chat(backend, specs, None, logprobs=2)
    # The floor moves every row's log-probabilities (Gemma3's sliding layers see no system key by
    # then, and its one global layer is the last, whose pi is traced before its floor acts: there
    # only the log-probabilities move).
    moved = np.abs(_logprobs(got) - _logprobs(plain)).max(axis=(1, 2))
    assert (moved > 1e-3).all(), moved
    # Row 2's floor acts from the query at slot n + 2 (decode step 3) on: the steps before are the
    # floor-less steer's, bit for bit (CPU), the later ones are not.
    assert np.array_equal(got[2].trace.decode[:3], plain[2].trace.decode[:3]) or not exact()
    assert np.array_equal(_logprobs(got)[2, :3], _logprobs(plain)[2, :3]) or not exact()
    assert np.abs(_logprobs(got)[2, 3:] - _logprobs(plain)[2, 3:]).max() > 1e-3


def test_rows_leaving_the_batch_keep_their_floors(backend: HFChatBackend) -> None:
    """`select_rows` (rows that are done leave a dynamic batch): every row's tokens equal its run alone."""
    specs = ["instaboost:m=3"]  # untraced, so the loop compacts the batch
    floors = conv_floors(backend, low_high=RANGES["floor+instaboost"])
    sampling = Sampling(greedy=True, max_new_tokens=10, ignore_eos=True)
    limits = [2, 10, 10]
    batched = _chat(backend, specs, floors, sampling=sampling, row_max_tokens=limits)
    for conv, row, limit in zip(CONVS, batched, limits, strict=True):
        (solo,) = _chat(backend, specs, floors, convs=[conv], sampling=sampling.model_copy(
            update={"max_new_tokens": limit}))
        assert solo.token_ids == row.token_ids
    unfloored = _chat(backend, specs, None, sampling=sampling, row_max_tokens=limits)
    assert [r.token_ids for r in unfloored] != [r.token_ids for r in batched]  # the floors act here


def test_select_rows_keeps_the_floor_tables_consistent() -> None:
    state = AttentionState(AttentionConfig(pi_floor=0.5), [{"system": [(0, 2)]}] * 3, 2, 3, current())
    state.on_layout([0, 2, 1], 6, 8)
    values = torch.zeros(3, 2, 3)
    values[0, 1, 2], values[2, 0, 1] = 0.3, 0.6
    state.set_floors(values, [4, 3, 5])
    assert state.floor_first.tolist() == [4, 5, 6] and state.acts_on(0) and state.acts_on(1)
    state.select_rows([2, 1])
    assert torch.equal(state.floor_table.cpu(), values[[2, 1]]) and state.floor_first.tolist() == [6, 5]
    assert state.floor_queries == [5, 3] and state.acts_on(0) and not state.acts_on(1)  # row 0 held layer 1's
    state.forward_kwargs(7)  # one query at slot 6: row 0 (first slot 6) on, row 1 (5) on
    assert state.layer_floor(0, 1)[:, 1, 0, 0].tolist() == pytest.approx([0.6, 0.0])
    assert state.layer_floor(1, 1) is None


# -- 2. the mass after the hook, and exactness where the floor does not bind -----------------------------
_MASS: list[tuple[int, torch.Tensor, torch.Tensor]] = []


def _floorcheck_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The engine's output, and (into _MASS) the attention mass it puts on the system keys and on
    all keys: the same call with V replaced by indicator channels (1 on system keys; 1 everywhere)."""
    state = kwargs.get("driftlab")
    out = engine_module.driftlab_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if state is not None:
        K, total = key.shape[2], state.kv_len
        sys = _key_slots(state, "system", total, query.device)[:, total - K:]  # [B, K]
        ind = torch.zeros_like(value)
        ind[..., 0] = sys[:, None, :].to(value.dtype)
        ind[..., 1] = 1.0
        mass, _ = engine_module.driftlab_attention(module, query, key, ind, attention_mask, scaling, dropout, **kwargs)
        q = query.shape[2]
        allowed = (attention_mask if attention_mask is not None
                   else torch.ones(q, K, dtype=torch.bool, device=query.device).tril(K - q)[None, None])
        seen = (allowed & sys[:, None, None, :]).any(-1)[:, 0]  # [B, q]: some system key visible
        _MASS.append((module.layer_idx, mass[..., :2].permute(0, 2, 1, 3).float(), seen))  # [B, H, q, 2]
    return out


def _masses(backend: HFChatBackend, specs: list[str], floors) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    _MASS.clear()
    prefill(backend, specs, floors, impl=CHECK, trace=False)
    return {layer: (mass, seen) for layer, mass, seen in _MASS}


@pytest.mark.parametrize("case", ["floor", "floor+split"])
def test_after_the_hook_the_system_keys_hold_at_least_the_floor(backend: HFChatBackend, case: str) -> None:
    floors = conv_floors(backend)
    rendered = [backend.render(c) for c in CONVS]
    T = max(len(r.ids) for r in rendered)
    L, _ = _dims(backend)
    slots = torch.arange(T)

    def shortfall(masses) -> float:
        """The most any acting head and query misses its floor by (where a system key is visible)."""
        worst = -1.0
        for b, r in enumerate(rendered):
            values, first = floors[len(r.ids)]
            acting = slots >= T - len(r.ids) + first  # [T]
            for layer in range(L):
                mass, seen = masses[layer]
                m = mass[b, :, :, 0].cpu()  # [H, T]
                assert (mass[b, :, T - len(r.ids):, 1] - 1).abs().max() <= tol(PI_TOL)  # still a distribution
                ok = acting & seen[b].cpu()
                if ok.any():
                    worst = max(worst, (values[layer][:, None] - m[:, ok]).max().item())
                assert (m[:, acting & ~seen[b].cpu()] == 0).all()  # no system key visible: nothing to raise
        return worst

    assert shortfall(_masses(backend, CASES[case], floors)) <= tol(PI_TOL)
    # Without the floor (the same steer) many heads and queries fall well short of these floors.
    assert shortfall(_masses(backend, CASES[case], None)) > 0.05


@cpu_only("bit-equality with the plain model holds where the fused kernel is the plain model's")
def test_a_floor_that_does_not_bind_changes_nothing_bit_for_bit(backend: HFChatBackend) -> None:
    """Floors below every plain pi they meet: every logit is the plain model's, exactly. Floors that
    bind: the logits before each row's first floor slot still are, the later ones are not."""
    plain, pi, pads, _ = prefill(backend, [], trace=True)
    plain_untraced, _, _, _ = prefill(backend, None)
    assert max_diff(plain, plain_untraced, pads, dim=1) == 0.0  # (padding queries are undefined)
    floors = conv_floors(backend)
    rendered = [backend.render(c) for c in CONVS]
    under = {}
    for b, r in enumerate(rendered):
        values, first = floors[len(r.ids)]
        seen = pi[b, :, :, pads[b] + first:]  # [L, H, queries from the first slot on]
        if seen.shape[-1] == 0:
            seen = pi[b, :, :, -1:]
        under[len(r.ids)] = (0.5 * seen.min(-1).values.cpu(), min(first, len(r.ids) - 1))
    got, _, _, _ = prefill(backend, [], under, trace=False)
    assert max_diff(got, plain, pads, dim=1) == 0.0
    # Just above the smallest plain pi of each head: they bind somewhere, and change the outputs.
    over = {n: ((2.0 * v + 0.1).clamp(max=1.0), f) for n, (v, f) in under.items()}
    bound, _, _, firsts = prefill(backend, [], over, trace=False)
    for b in range(len(CONVS)):
        assert torch.equal(bound[b, pads[b] : firsts[b]], plain[b, pads[b] : firsts[b]])
        assert (bound[b, firsts[b]:] - plain[b, firsts[b]:]).abs().max() > 100 * LOGIT_TOL


def test_split_softmax_with_a_floor_on_random_tensors() -> None:
    """The kernel alone: t = max(pi^k, floor) of the mass on the system keys (read through indicator
    channels of O and O_sys), bit for bit the floor-less result wherever the floor does not bind,
    and the guards: no system key seen, no rest key seen, k = 0."""
    torch.manual_seed(0)
    B, H, q, d = 3, 4, 50, 8
    lse_all = torch.randn(B, H, q)
    lse_sys = lse_all - torch.rand(B, H, q) * 6
    lse_sys[0, 0, :5] = float("-inf")  # no system key visible
    lse_sys[1, 1, :5] = lse_all[1, 1, :5]  # inside the system span: no rest key, pi = 1
    pi, rest = kernels.system_share(lse_all, lse_sys)
    o_sys = torch.randn(B, H, q, d)
    o_rest = torch.randn(B, H, q, d)
    o_sys[..., 0], o_rest[..., 0] = 1.0, 0.0  # channel 0: the mass on the system keys
    o_sys[..., 1], o_rest[..., 1] = 1.0, 1.0  # channel 1: the total mass
    out = pi * o_sys + rest * o_rest
    floor = torch.rand(B, H, q, 1)
    floor[2] = 0.0
    for k in (torch.ones(H), torch.tensor([1.0, 0.5, 0.0, 0.8])):
        got = kernels.split_softmax(out, o_sys, pi, rest, k, floor)
        unfloored = kernels.split_softmax(out, o_sys, pi, rest, k)
        kk = k.view(1, H, 1, 1)
        target = torch.maximum(pi.pow(kk), floor)
        acts = (pi > 0) & (rest > 0)
        assert (got[..., :1] - torch.where(acts, target, pi.pow(kk) * (pi > 0))).abs().max() < 1e-5
        assert (got[..., 1] - 1).abs().max() < 1e-5
        binds = ((floor > pi.pow(kk)) & acts).expand_as(out)
        assert binds.any() and (~binds).any()
        assert torch.equal(got[~binds], unfloored[~binds])
        assert torch.equal(kernels.split_softmax(out, o_sys, pi, rest, k, torch.zeros_like(floor)), unfloored)
        if bool((k == 1).all()):
            assert torch.equal(got[~binds], out[~binds])  # k = 1 and a floor that does not bind: `out` itself
    assert torch.equal(got[0, 0, :5], out[0, 0, :5]) and torch.equal(got[1, 1, :5, 1:], out[1, 1, :5, 1:])
    assert not got.isnan().any()
    # Masses from indicator channels (no LSEs) can say pi = 0.99, rest = 0 inside the system span:
    # a floor above pi must not divide by that 0 (nor scale O_sys down to the floor).
    pi_c, rest_c = pi.clone(), rest.clone()
    pi_c[2, 2, :5], rest_c[2, 2, :5] = 0.99, 0.0
    guarded = kernels.split_softmax(out, o_sys, pi_c, rest_c, torch.ones(H), torch.ones_like(floor))
    assert torch.equal(guarded[2, 2, :5], out[2, 2, :5])
    # The flex epilogue: the same numbers from the two LSEs.
    merged, pi_m = kernels.merge(out, o_sys, lse_all, lse_sys, k, floor)
    assert torch.equal(merged, got) and torch.equal(pi_m, pi)


# -- the API -----------------------------------------------------------------------------------------
def test_config_and_set_floors_validate() -> None:
    cfg = AttentionConfig(pi_floor=0.8)
    assert cfg.floors and cfg.changes_outputs and cfg.active and not AttentionConfig().floors
    assert not AttentionConfig(pi_floor=0.0).changes_outputs
    assert cfg.shared() == AttentionConfig().shared()  # rows may differ in it
    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            AttentionConfig(pi_floor=bad)
    rows = [AttentionConfig(pi_floor=0.8), AttentionConfig(pi_floor=0.3, biases=[BiasTerm(value=1.0)])]
    state = AttentionState(rows, [{"system": [(0, 2)]}] * 2, 2, 3, current())
    with pytest.raises(DriftlabError, match="on_layout first"):
        state.set_floors(torch.zeros(2, 2, 3), [0, 0])
    state.on_layout([0, 1], 5, 6)
    assert torch.equal(state.floor_table.cpu(), torch.zeros(2, 2, 3)) and state.floor_first.tolist() == [0, 1]
    for values, first, match in ((torch.zeros(2, 3, 3), [0, 0], "shape"), (torch.zeros(2, 2, 3), [0], "shape"),
                                 (torch.full((2, 2, 3), 1.5), [0, 0], r"\[0, 1\]"),
                                 (torch.full((2, 2, 3), float("nan")), [0, 0], r"\[0, 1\]"),
                                 (torch.zeros(2, 2, 3), [0, -1], "negative")):
        with pytest.raises(DriftlabError, match=match):
            state.set_floors(values, first)
    flags = AttentionState(AttentionConfig(pi_floor=0.5), [{"system": [(0, 2)]}], 3, 2, current())
    flags.on_layout([0], 5, 6)
    assert not any(flags.acts_on(layer) for layer in range(3))
    values = torch.zeros(1, 3, 2)
    values[0, 1, 0] = 0.4
    flags.set_floors(values, [4])
    assert [flags.acts_on(layer) for layer in range(3)] == [False, True, False]
    flags.forward_kwargs(4)  # queries at slots 0-3: before the first floor slot (4)
    assert flags.layer_floor(1, 4) is None
    flags.forward_kwargs(5)  # slots 0-4
    assert flags.layer_floor(1, 5)[0, :, :, 0].flatten().tolist() == pytest.approx([0.0] * 4 + [0.4] + [0.0] * 5)
    assert flags.layer_floor(0, 5) is None


def test_static_layout_holds_the_floor_tables_always() -> None:
    """Zeros without a floor, the floors' values with one, at the same addresses (set before the
    static layout or after it)."""
    arena: dict[str, torch.Tensor] = {}
    state = AttentionState(AttentionConfig(trace=True), [{"system": [(0, 2)]}] * 2, 2, 3, current())
    state.on_layout([0, 1], 5, 256)
    state.static_layout(arena)
    assert state.floor_table.shape == (2, 2, 3) and not state.floor_table.any() and state.floor_first.tolist() == [0, 1]
    held = arena["floor_table"], arena["floor_first"]
    again = AttentionState(AttentionConfig(pi_floor=0.5), [{"system": [(0, 2)]}] * 2, 2, 3, current())
    again.on_layout([0, 1], 5, 256)
    again.set_floors(torch.full((2, 2, 3), 0.25), [3, 2])
    again.static_layout(arena)
    assert again.floor_table is held[0] and again.floor_first is held[1]
    assert bool((held[0] == 0.25).all()) and held[1].tolist() == [3, 3]
    again.set_floors(torch.full((2, 2, 3), 0.5), [4, 4])  # after the static layout: in place
    assert again.floor_table is held[0] and bool((held[0] == 0.5).all()) and held[1].tolist() == [4, 5]


# -- 3. a static layout's decode step ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def static_backends(tiny_dirs: dict[str, Path]) -> dict[str, HFChatBackend]:
    def make(decode: str) -> HFChatBackend:
        return HFChatBackend(str(tiny_dirs["qwen2"]), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                             decode=decode)

    return {"dynamic": make("dynamic"), "static": make("static"), "compiled": make("compiled")}


@pytest.fixture
def cheap_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo with aot_eager (no code generation), as tests/test_static_decode.py compiles a steered step."""
    import driftlab.chat.static_decode as sd

    monkeypatch.setitem(sd.COMPILE_OPTIONS, backend_device().split(":")[0],
                        {"backend": "aot_eager", "fullgraph": True, "dynamic": True})


# The second static row's floor starts at its third generated token (decode step 3): 5 tokens give it
# two floored steps and one (step 2) that a floor one slot early would change. Eager flex on a CPU
# costs tens of ms a call (vmap over its score_mod), so every step counts.
STATIC_TOKENS = 5


def _tokens_run(backend: HFChatBackend, specs: list[str], floors, convs=CONVS[:2]) -> list:
    iv = Interventions.parse(specs)
    with floors_on_layout(floors) if floors is not None else contextlib.nullcontext():
        return backend.generate_tokens([backend.render(c, interventions=iv) for c in convs],
                                       Sampling(greedy=True, max_new_tokens=STATIC_TOKENS, ignore_eos=True),
                                       interventions=iv)


STATIC_CASES = {"floor": ["trace"], "floor+split+instaboost": ["split-softmax:k=0.6,heads=0-1", "instaboost:m=3",
                                                               "trace"]}
STATIC_RANGES = {"floor": (0.1, 0.7), "floor+split+instaboost": (0.6, 0.95)}
_DYNAMIC_RUNS: dict[tuple[int, str], tuple[dict, list, list]] = {}


def dynamic_runs(backend: HFChatBackend, case: str) -> tuple[dict, list, list]:
    """(floors, floored run, floor-less run) of the dynamic loop on SDPA for the static tests'
    conversations, once per case: every kernel's static run is checked against the same two."""
    if (id(backend), case) not in _DYNAMIC_RUNS:
        convs = [CONVS[0], CONVS[2]]
        floors = conv_floors(backend, convs=convs, low_high=STATIC_RANGES[case])
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(engine_module.KERNEL_ENV, "sdpa")
            runs = [_tokens_run(backend, STATIC_CASES[case], f, convs) for f in (floors, None)]
        _DYNAMIC_RUNS[id(backend), case] = (floors, *runs)
    return _DYNAMIC_RUNS[id(backend), case]


@pytest.mark.parametrize("kernel", ["sdpa", "flex", "sdpa-channels"])
@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_static_decode_with_floors_equals_the_dynamic_loop(static_backends, case: str, kernel: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager static steps (each a `decode.steered_step`, the floor applied where the query's slot has
    reached the row's first floor slot: the first row's in its prompt, the second row's (the third
    conversation) at its third generated token) against the dynamic loop on SDPA."""
    specs = STATIC_CASES[case]
    convs = [CONVS[0], CONVS[2]]
    floors, ref, unfloored = dynamic_runs(static_backends["dynamic"], case)
    assert max(np.abs(a.trace.decode - b.trace.decode).max() for a, b in zip(ref, unfloored, strict=True)) > 1e-3
    monkeypatch.setenv(engine_module.KERNEL_ENV, kernel.split("-")[0])
    if kernel == "sdpa-channels":  # pi from indicator channels appended to V, as CUDA's SDPA family gets it
        monkeypatch.setattr(kernels, "CPU_FLASH", None)
    got = _tokens_run(static_backends["static"], specs, floors, convs)
    assert_same_decode(got, ref)
    # A floor applied one step early in the second row would be caught (it starts in the decode).
    early = {n: (v, f - 1) if f > n else (v, f) for n, (v, f) in floors.items()}
    wrong = _tokens_run(static_backends["static"], specs, early, convs)
    assert np.abs(wrong[1].trace.decode - ref[1].trace.decode).max() > 1e-4


@pytest.mark.compile  # on the CPU out of the fast part (tests/conftest.py)
def test_compiled_step_compiles_no_second_graph_when_the_floor_changes(static_backends, cheap_compile) -> None:
    compiled, dynamic = static_backends["compiled"], static_backends["dynamic"]
    specs, convs = STATIC_CASES["floor+split+instaboost"], [CONVS[0], CONVS[2]]
    floors, ref, unfloored = dynamic_runs(dynamic, "floor+split+instaboost")  # the static test's
    zeros = _tokens_run(compiled, specs, None, convs)  # floors of zeros: the steered graph
    assert_same_decode(zeros, unfloored)
    ran = compiled.ran()["decode"]
    # The compiled step ran (no eager fallback); its graph may be one this worker compiled before for an
    # identical tiny model (dynamo keys graphs by code and guards, not by model instance): graphs may be 0.
    assert ran["loop"] == "compiled" and "eager_after" not in ran
    graphs = ran["graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        got = _tokens_run(compiled, specs, floors, convs)
    assert compiled.ran()["decode"]["graphs"] == graphs
    assert_same_decode(got, ref)
    assert max(np.abs(a.trace.decode - b.trace.decode).max() for a, b in zip(got, zeros, strict=True)) > 1e-3


# -- 4. FlexAttention on the CPU -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "gemma3", "qwen2-gqa7"])
def test_flex_path_with_floors_equals_the_sdpa_path(tiny_dirs, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend(str(tiny_dirs[family]), family)
    specs = CASES["floor+split+bias"]
    floors = conv_floors(backend)
    results = {}
    for kernel in ("sdpa", "flex"):
        monkeypatch.setenv(engine_module.KERNEL_ENV, kernel)
        results[kernel] = prefill(backend, specs, floors), _chat(backend, [*specs, "trace"], floors,
                                                                 sampling=Sampling(greedy=True, max_new_tokens=5,
                                                                                   ignore_eos=True))
    (logits, pi, pads, _), replies = results["flex"]
    (want, pi_want, _, _), want_replies = results["sdpa"]
    assert max_diff(logits, want, pads, dim=1) <= tol(LOGIT_TOL)
    assert max_diff(pi, pi_want, pads, dim=3) <= tol(PI_TOL)
    assert_same_decode(replies, want_replies)
    monkeypatch.setenv(engine_module.KERNEL_ENV, "flex")
    off, _, _, _ = prefill(backend, specs, conv_floors(backend, scale=0.5))
    assert max_diff(logits, off, pads, dim=1) > 10 * LOGIT_TOL  # other floors: other logits


# -- the real model ----------------------------------------------------------------------------------------
@pytest.mark.model
def test_smollm2_floors_match_reference(smol32) -> None:
    """SmolLM2-135M (Llama, 9 query / 3 KV heads, 30 layers): prefill and decode with floors and
    split-softmax equal the reference, and the floor moves the outputs."""
    specs = ["split-softmax:k=0.8,heads=0-10"]
    floors = conv_floors(smol32, convs=CONVS[:2])
    got, pi, pads, _ = prefill(smol32, specs, floors, convs=CONVS[:2])
    want, pi_ref, _, _ = prefill(smol32, specs, floors, impl=REFERENCE, convs=CONVS[:2])
    assert max_diff(got, want, pads, dim=1) <= tol(LOGIT_TOL)
    assert max_diff(pi, pi_ref, pads, dim=3) <= tol(PI_TOL)
    unfloored, _, _, _ = prefill(smol32, specs, None, convs=CONVS[:2])
    assert max_diff(got, unfloored, pads, dim=1) > 100 * LOGIT_TOL
    sampling = Sampling(greedy=True, max_new_tokens=6, ignore_eos=True)
    replies = _chat(smol32, [*specs, "trace"], floors, convs=CONVS[:2], sampling=sampling)
    with implementation(smol32, REFERENCE):
        reference = _chat(smol32, [*specs, "trace"], floors, convs=CONVS[:2], sampling=sampling)
    assert_same_decode(replies, reference)
