"""The attention engine against an independent eager reference, on several model families.

Why these tests: the engine never materialises attention weights (extra V channels for pi,
a second SDPA over the system keys for split-softmax, per-chunk float masks for key bias),
so its correctness is not obvious from reading it. `attention_reference.py` computes the
same quantities the textbook way, on the weights. We compare, in fp32:

* logits of a left-padded prefill forward (max abs diff <= LOGIT_TOL at real positions) and
  the per-query pi traces (<= PI_TOL);
* greedy generations and decode pi traces through the backend's full decode loop;
* exact no-ops (k = 1, bias = 0) against the plain model with torch.equal.

Devices: everything runs on `pytest --device` (default cpu). The tolerances below are the
CPU ones; `tol()` (tests/devices.py) loosens them on CUDA, where fused kernels and the
reference reduce in other orders. Tests of CPU-only kernel paths skip elsewhere.

Models: tiny random Qwen2 and Gemma3 models (grouped-query attention; Gemma3 adds
sliding-window layers and `query_pre_attn_scalar` scaling) run every case; the pulled
SmolLM2-135M (Llama, 9 query / 3 KV heads, 30 layers) runs one case of each matrix, the
richest ("composed"), plus the tests about the real model itself (a long decode, span modes,
transformers' own SDPA): one real-model check per feature, the option matrix on models
whose forward costs a millisecond. Every comparison also checks that the intervention does
change the output, so agreement with the reference is not agreement on a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attention_reference import NAME as REFERENCE
from attention_reference import both_engines_on_one_thread, left_padded
from devices import backend_device, cpu_only, current, exact, tol
from driftlab.attention import ATTENTION_NAME, kernels
from driftlab.attention import engine as engine_module
from driftlab.attention.config import BiasTerm
from driftlab.attention.state import AttentionConfig, AttentionState, head_mask, parse_heads
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.chat.templates import Renderer
from driftlab.errors import DriftlabError
from driftlab.steering import Interventions
from tiny_models import make_tiny_model

# fp32 logits, engine (fused SDPA kernels) vs reference (matmul + softmax). SmolLM2's plain
# model already differs from the reference by 1.0e-4 (logits up to ~37, 30 layers); the
# tiny models by ~3e-6.
LOGIT_TOL = 5e-4
PI_TOL = 1e-5  # fp32 attention mass on the system keys
SLIDING_WINDOW = 8  # tiny Gemma3's window: every test prompt is longer

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a pirate. Always answer like a pirate, arr, and never stop."},
        {"role": "user", "content": "Hello! Could you tell me how to bake a loaf of bread at home?"},
    ],
    [
        {"role": "system", "content": "Réponds toujours en français."},
        {"role": "user", "content": "What is the capital of Italy?"},
    ],
]

# Head selections valid for all three models (>= 3 layers, >= 4 heads each).
CASES = {
    name: Interventions.parse(specs)
    for name, specs in {
        "trace": ["trace"],
        "bias_all": ["bias:value=2.0"],
        "bias_layers": ["bias:value=2.0,heads=0-1"],
        "bias_pairs": ["bias:value=3.0,heads=0.1+2.3"],
        "bias_inverted": ["bias:value=-3.0,invert=true"],
        "instaboost": ["instaboost:m=8"],
        "split_all": ["split-softmax:k=0.6"],
        "split_subset": ["split-softmax:k=0.5,heads=1+2.0"],
        "split_zero": ["split-softmax:k=0.0,heads=0"],
        "composed": ["trace", "split-softmax:k=0.8,heads=0-1", "bias:value=-3.0,invert=true,heads=1.2+2"],
        "biases_summed": ["instaboost:m=4", "pasta:heads=0.1+2,alpha=0.05,span=system", "bias:value=1.5,heads=1"],
    }.items()
}
TRACE = Interventions.parse(["trace"])
DECODE_CASES = ["trace", "bias_layers", "split_subset", "composed"]
TINY = ["qwen2", "gemma3"]
REAL_CASE = "composed"  # every intervention kind at once: the matrices' one case on SmolLM2


def on_models(cases: list[str]) -> pytest.MarkDecorator:
    """Parametrize (backend, case): every case on the tiny models, REAL_CASE alone on SmolLM2 (the
    other options' math is the same code on the real model, at ~30x the cost a forward)."""
    assert REAL_CASE in cases
    return pytest.mark.parametrize("backend,case", [("smollm2", REAL_CASE), *((m, c) for m in TINY for c in cases)],
                                   indirect=["backend"])


# Tests about bookkeeping (padding, chunking, no-ops, batch rows) that SmolLM2 adds nothing to.
on_tiny_models = pytest.mark.parametrize("backend", TINY, indirect=True)


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _implementations() -> Iterator[None]:
    with both_engines_on_one_thread():
        yield


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        family: make_tiny_model(family, root / family, sliding_window=SLIDING_WINDOW)
        for family in ("qwen2", "gemma3")
    }


_BACKENDS: dict[str, HFChatBackend] = {}


@pytest.fixture(scope="module", params=["smollm2", "qwen2", "gemma3"])
def backend(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> HFChatBackend:
    """One fp32 backend per model on the test device, loaded once per module (the reference is swapped in per call).
    SmolLM2 is the session's `smol32` (the same settings): a worker loads it once for every file."""
    name = request.param
    if name == "smollm2":
        return request.getfixturevalue("smol32")
    if name not in _BACKENDS:
        _BACKENDS[name] = HFChatBackend(str(tiny_dirs[name]), dtype="float32", device=backend_device(),
                                        prefix_cache_bytes=0)
    return _BACKENDS[name]


@pytest.fixture(scope="module")
def smol(smol32: HFChatBackend) -> HFChatBackend:
    return smol32


@pytest.fixture(scope="module")
def gemma(tiny_dirs: dict[str, Path]) -> HFChatBackend:
    if "gemma3" not in _BACKENDS:
        _BACKENDS["gemma3"] = HFChatBackend(str(tiny_dirs["gemma3"]), dtype="float32", device=backend_device(),
                                            prefix_cache_bytes=0)
    return _BACKENDS["gemma3"]


# -- helpers -------------------------------------------------------------------------------------
@contextlib.contextmanager
def implementation(backend: HFChatBackend, name: str) -> Iterator[None]:
    """Run the backend's model with another registered attention implementation."""
    backend.model.set_attn_implementation(name)
    try:
        yield
    finally:
        backend.model.set_attn_implementation(ATTENTION_NAME)


def _dims(backend: HFChatBackend) -> tuple[int, int]:
    cfg = backend.model.config.get_text_config()
    return cfg.num_hidden_layers, cfg.num_attention_heads


def traced(iv: Interventions) -> Interventions:
    return iv if "trace" in iv.kinds else Interventions(items=(*iv.items, *TRACE.items))


def chat(backend: HFChatBackend, convs, sampling: Sampling, iv: Interventions = Interventions()) -> list:
    return backend.generate(ChatRequest(convs, sampling, interventions=iv))


def prefill(
    backend: HFChatBackend, iv: Interventions | None, convs=CONVERSATIONS, impl: str = ATTENTION_NAME
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Full-logit forward of the left-padded batch: (logits [B, T, V], pi [B, L, H, T] or None, pads).

    With a config, the state traces every query (trace_prefill) so pi can be compared too.
    """
    ids, mask, pads, rendered = left_padded(backend, convs)
    T = ids.shape[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    extra, state = {}, None
    cfg = iv.attention() if iv is not None else None
    if cfg is not None:
        state = AttentionState(
            cfg.model_copy(update={"trace_prefill": cfg.trace}),
            [{"system": [r.system_span]} for r in rendered],
            *_dims(backend),
            backend.device,
        )
        state.on_layout(pads, T, T)
        extra = state.forward_kwargs(T)
    with implementation(backend, impl), torch.inference_mode():
        out = backend.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra)
    pi = None
    if state is not None and cfg.trace:
        pi = torch.stack([torch.stack([r[0] for r in recs]) for recs in state.records], dim=1)  # [L, B, H, T]
        pi = pi.permute(1, 0, 2, 3)
    return out.logits.float(), pi, pads


_PLAIN_PREFILLS: dict[int, tuple[torch.Tensor, None, list[int]]] = {}


def plain_prefill(backend: HFChatBackend) -> tuple[torch.Tensor, None, list[int]]:
    """`prefill(backend, None)`, computed once per backend: without a state the engine is plain SDPA
    whatever the kernel setting, and every prefill case compares against it."""
    if id(backend) not in _PLAIN_PREFILLS:
        _PLAIN_PREFILLS[id(backend)] = prefill(backend, None)
    return _PLAIN_PREFILLS[id(backend)]


def real_positions(x: torch.Tensor, pads: list[int], dim: int) -> list[torch.Tensor]:
    """Per row, the slice of `x` at non-padding positions (padding queries are undefined)."""
    return [x[b].narrow(dim - 1, pads[b], x.shape[dim] - pads[b]) for b in range(len(pads))]


def engine_and_reference(backend: HFChatBackend, sampling: Sampling, iv: Interventions) -> tuple[list, list]:
    """The same chat through the engine and through the slow reference implementation."""
    got = chat(backend, CONVERSATIONS, sampling, iv)
    with implementation(backend, REFERENCE):
        want = chat(backend, CONVERSATIONS, sampling, iv)
    return got, want


def assert_same_decode(got: list, want: list) -> None:
    """Identical greedy tokens and decode-time pi within PI_TOL, row by row."""
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for g, w in zip(got, want):
        assert (g.trace["decode"] - w.trace["decode"]).abs().max() <= tol(PI_TOL)


def max_diff(a: torch.Tensor, b: torch.Tensor, pads: list[int], dim: int) -> float:
    return max(
        (x - y).abs().max().item() for x, y in zip(real_positions(a, pads, dim), real_positions(b, pads, dim))
    )


# -- parse_heads / head_mask / config ------------------------------------------------------------
def test_parse_heads_forms() -> None:
    for spec in (None, "", "all", "ALL", "*", "  "):
        assert parse_heads(spec) is None
    assert parse_heads("3") == ((3, None),)
    assert parse_heads("0-2") == ((0, None), (1, None), (2, None))
    assert parse_heads("3.1,7.0") == ((3, 1), (7, 0))
    assert parse_heads("1-2.3") == ((1, 3), (2, 3))
    # '+' is the joiner documented for --steer (driftlab.steering), where ',' separates keys.
    assert parse_heads("0-1+7.2") == ((0, None), (1, None), (7, 2))
    assert parse_heads("2.0; 5") == ((2, 0), (5, None))


@pytest.mark.parametrize("spec", ["x", "3.", ".1", "3.1.2", "-2", "1--3", "3:1"])
def test_parse_heads_rejects_malformed(spec: str) -> None:
    with pytest.raises(DriftlabError, match="Cannot read head selection"):
        parse_heads(spec)


def test_parse_heads_rejects_empty_range() -> None:
    with pytest.raises(DriftlabError, match="is empty"):
        parse_heads("5-3")


def test_head_mask_layout_and_range_checks() -> None:
    mask = head_mask(parse_heads("0+2.1+2.3"), n_layers=3, n_heads=4)
    expected = torch.zeros(3, 4, dtype=torch.bool)
    expected[0] = True
    expected[2, 1] = expected[2, 3] = True
    assert torch.equal(mask, expected)
    assert bool(head_mask(None, 2, 3).all()) and head_mask(None, 2, 3).shape == (2, 3)
    for heads in (((3, None),), ((0, 4),)):
        with pytest.raises(DriftlabError, match="outside this model"):
            head_mask(heads, n_layers=3, n_heads=4)


def test_config_parses_and_validates_heads() -> None:
    cfg = AttentionConfig(split_k=0.5, split_heads="1-2", biases=[BiasTerm(value=1.0, heads=[[0, 1]])])
    assert cfg.split_heads == ((1, None), (2, None)) and cfg.biases[0].heads == ((0, 1),)
    assert cfg.changes_outputs and not AttentionConfig(trace=True).changes_outputs
    assert not AttentionConfig(biases=[BiasTerm(value=0.0)]).changes_outputs  # a zero bias is no bias
    with pytest.raises(ValueError):
        BiasTerm(value=float("inf"))
    with pytest.raises(ValueError):
        BiasTerm(value=1.0, span="sytem")
    with pytest.raises(ValueError):
        AttentionConfig(split_k=1.5)
    with pytest.raises(DriftlabError):
        AttentionConfig(split_heads="layer3")
    # A model-dependent range error surfaces when the state meets the model.
    with pytest.raises(DriftlabError, match="outside this model"):
        AttentionState(AttentionConfig(split_k=0.5, split_heads="9"), [{}], 3, 4, current())


# -- AttentionState layout ----------------------------------------------------------------------
def test_on_layout_places_spans_in_padded_slots() -> None:
    cfg = AttentionConfig(biases=[BiasTerm(value=2.0, span="emphasis")], trace=True)
    spans = [
        {"system": [(0, 2)], "emphasis": [(3, 4)]},
        {"system": [(1, 3), (4, 5)]},  # no emphasis span: no bias on this row
    ]
    state = AttentionState(cfg, spans, n_layers=2, n_heads=3, device=current())
    state.on_layout(pads=[2, 0], prompt_len=6, max_len=9)
    assert state.kv_len == 6
    assert state.system_keys.tolist() == [
        [False, False, True, True, False, False, False, False, False],
        [False, True, True, False, True, False, False, False, False],
    ]
    assert state.bias_keys.tolist() == [[[0.0] * 5 + [2.0] + [0.0] * 3, [0.0] * 9]]  # [terms, rows, slots]
    bias = state.layer_bias(layer=1, lo=4, hi=7)  # a layer that keeps only slots 4..6
    assert bias.shape == (2, 3, 1, 3)
    assert bias[0, :, 0].tolist() == [[0.0, 2.0, 0.0]] * 3


def test_on_layout_inverted_bias_covers_every_other_key_after_padding() -> None:
    cfg = AttentionConfig(biases=[BiasTerm(value=-1.0, invert=True, heads="1.2")])
    state = AttentionState(cfg, [{"system": [(0, 2)]}, {}], n_layers=2, n_heads=3, device=current())
    state.on_layout(pads=[1, 0], prompt_len=4, max_len=6)
    # Row 0: pad slot 0 untouched, system slots 1-2 untouched, the rest (prompt + future tokens)
    # biased. Row 1 has no system span: nothing to steer towards, so it is left alone.
    assert state.bias_keys.tolist() == [[[0, 0, 0, -1, -1, -1], [0] * 6]]
    assert state.layer_bias(0, 0, 6) is None  # layer 0 has no selected head
    assert state.layer_bias(1, 0, 6)[:, :2].abs().sum() == 0 and state.layer_bias(1, 0, 6)[:, 2].abs().sum() > 0
    assert not state.acts_on(0) and state.acts_on(1)


def test_bias_terms_add_up_and_rows_may_differ_in_them() -> None:
    boost = BiasTerm(value=1.5, span="system")  # InstABoost's kind of term, every head
    pasta = BiasTerm(value=-4.0, span="emphasis", invert=True, heads="1.0", scope="prompt")
    rows = [AttentionConfig(biases=[boost, pasta]), AttentionConfig(biases=[pasta]), AttentionConfig()]
    spans = [{"system": [(0, 1)], "emphasis": [(2, 3)]}] * 3
    state = AttentionState(rows, spans, n_layers=2, n_heads=2, device=current())
    state.on_layout(pads=[0, 0, 0], prompt_len=4, max_len=5)  # slot 4 is a generated token
    layer1 = state.layer_bias(1, 0, 5)[:, :, 0]  # [B, H, K]
    # row 0 head 0: boost on slot 0 plus pasta on every prompt slot but the emphasis one; head 1: boost only
    assert layer1[0].tolist() == [[1.5 - 4.0, -4.0, 0.0, -4.0, 0.0], [1.5, 0.0, 0.0, 0.0, 0.0]]
    assert layer1[1].tolist() == [[-4.0, -4.0, 0.0, -4.0, 0.0], [0.0] * 5]  # its own term only
    assert layer1[2].abs().sum() == 0  # no term at all
    assert state.layer_bias(0, 0, 5)[:, 1, 0, 0].tolist() == [1.5, 0.0, 0.0]  # layer 0: boost alone
    mixed = AttentionState([AttentionConfig(trace=True), AttentionConfig()], [{}, {}], 2, 2, current())
    assert mixed.trace  # decode-step tracing is per row: pi is computed for both, kept for row 0
    with pytest.raises(DriftlabError, match="different prefill tracing settings"):  # prompts: per batch position
        AttentionState([AttentionConfig(trace=True, trace_prefill=True), AttentionConfig()], [{}, {}], 2, 2, current())


def test_a_bias_on_the_system_keys_applied_after_attention_equals_it_in_the_logits() -> None:
    """`kernels.boost_keys` (vLLM's path for InstABoost and PASTA: its kernel takes no key bias) against the
    biased softmax itself, computed in float64: the output, and pi as the biased call sees it. Rows: one that
    sees no system key (unchanged), one inside the system span (no rest key), and biases that lift and that
    lower. `AttentionState.lifted` gives each row's set of keys and the bias on them, per layer and head:
    InstABoost's on the system keys, PASTA's as minus its value on the keys it spares."""
    torch.manual_seed(0)
    B, H, K, d = 4, 3, 12, 8
    logits, values = torch.randn(B, H, 1, K, dtype=torch.float64) * 2, torch.randn(B, 1, K, d, dtype=torch.float64)
    system = torch.zeros(B, K, dtype=torch.bool)
    system[0, :5], system[2, :], system[3, 2:4] = True, True, True  # row 1: no system key; row 2: no rest key
    bias = torch.tensor([0.0, 1.5, -2.0])[None, :, None, None].expand(B, H, 1, 1)  # per head (log m)
    sys_mask = system[:, None, None, :]

    def attend(extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = torch.softmax(logits + torch.where(sys_mask, extra, 0.0), dim=-1)
        return weights @ values, (weights * sys_mask).sum(-1, keepdim=True)

    out, pi = attend(torch.zeros(B, H, 1, 1, dtype=torch.float64))
    o_sys = torch.softmax(logits.masked_fill(~sys_mask, float("-inf")), dim=-1).nan_to_num() @ values
    expected, expected_pi = attend(bias.double())
    got, t, rest_t = kernels.boost_keys(out, o_sys, pi, 1 - pi, bias)
    # It computes in float32, as every epilogue here does.
    assert (got - expected).abs().max() < 1e-6 and (t - expected_pi).abs().max() < 1e-6
    assert (t + rest_t - 1).abs().max() < 1e-6
    assert torch.equal(got[1], out[1]) and torch.equal(got[:, 0], out[:, 0])  # no system key; bias 0
    cfg = AttentionConfig(biases=[BiasTerm(value=1.5, span="system"), BiasTerm(value=-1.0, span="system", heads="1.2")])
    pasta = AttentionConfig(biases=[BiasTerm(value=-3.0, span="system", invert=True, heads="1.0", scope="prompt")])
    state = AttentionState([cfg, cfg, pasta], [{"system": [(1, 3)]}, {}, {"system": [(0, 2)]}], n_layers=2, n_heads=3,
                           device=current())
    state.on_layout(pads=[0, 0, 0], prompt_len=4, max_len=6)  # slots 4-5: the reply's keys
    keys, lift = state.lifted()
    assert keys.tolist() == [[False, True, True, False, False, False], [False] * 6,
                             [True, True, False, False, True, True]]  # PASTA spares its span and the reply
    assert lift.tolist() == [[[1.5, 1.5, 1.5], [1.5, 1.5, 0.5]], [[0.0] * 3] * 2, [[0.0] * 3, [3.0, 0.0, 0.0]]]
    assert cfg.boosts_system and not cfg.spares_one_span and pasta.spares_one_span and not pasta.boosts_system
    # The same softmax, bit for bit in the logits' differences: -3 on the keys PASTA lowers, or +3 on those it spares.
    biased = state.layer_bias(1, 0, 6)[2, 0, 0]
    assert torch.equal(biased - biased.max(), torch.where(keys[2], 0.0, -3.0))


def test_on_layout_rejects_wrong_span_count() -> None:
    state = AttentionState(AttentionConfig(trace=True), [{}], 2, 3, current())
    with pytest.raises(DriftlabError, match="span sets"):
        state.on_layout(pads=[0, 0], prompt_len=3, max_len=4)


# -- prefill logits and traces against the reference ---------------------------------------------
@on_models(list(CASES))
def test_prefill_matches_reference(backend: HFChatBackend, case: str) -> None:
    cfg = CASES[case]
    plain, _, pads = plain_prefill(backend)
    assert min(pads) == 0 and max(pads) > 0  # the batch really is left-padded
    got, pi, _ = prefill(backend, cfg)
    want, pi_ref, _ = prefill(backend, cfg, impl=REFERENCE)
    assert max_diff(got, want, pads, dim=1) <= tol(LOGIT_TOL)
    if cfg.fingerprint():
        assert max_diff(got, plain, pads, dim=1) > 100 * LOGIT_TOL  # the intervention did something
    elif exact():
        # Tracing alone must not move any logit: on CPU pi comes from the kernel's log-sum-exp,
        # so the main attention call is the very same computation as the plain model's.
        assert max_diff(got, plain, pads, dim=1) == 0.0
    else:
        # Elsewhere pi comes from another kernel (extra V channels, FlexAttention's LSE), whose
        # output differs from plain SDPA's in the last bits.
        assert max_diff(got, plain, pads, dim=1) <= tol(LOGIT_TOL)
    if "trace" in cfg.kinds:
        assert max_diff(pi, pi_ref, pads, dim=3) <= tol(PI_TOL)
        real = torch.cat([p.flatten() for p in real_positions(pi, pads, 3)])
        assert real.min() >= 0 and real.max() <= 1 and 0.05 < real.mean() < 0.999


@on_tiny_models
def test_noop_interventions_equal_plain_model_exactly(backend: HFChatBackend) -> None:
    """k = 1, bias = 0 and m = 1 (with head selections) must leave every logit bit-identical."""
    plain, _, _ = plain_prefill(backend)
    for specs in (
        ["split-softmax:k=1,heads=0-1"],
        ["bias:value=0,heads=2.1,invert=true"],
        ["split-softmax:k=1", "bias:value=0"],
        ["instaboost:m=1"],
    ):
        got, _, _ = prefill(backend, Interventions.parse(specs))
        assert torch.equal(got, plain), specs
    sampling = Sampling(greedy=True, max_new_tokens=4)
    replies = chat(backend, CONVERSATIONS, sampling, Interventions.parse(["split-softmax:k=1", "instaboost:m=1"]))
    assert [r.token_ids for r in replies] == [r.token_ids for r in chat(backend, CONVERSATIONS, sampling)]


@on_tiny_models
def test_chunked_bias_path_matches_unchunked(backend: HFChatBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = CASES["composed"]
    whole, pi_whole, pads = prefill(backend, cfg)
    calls: list[int] = []
    real_attend = engine_module.attend_sdpa

    def counting_attend(query, *args, **kwargs):
        calls.append(query.shape[2])
        return real_attend(query, *args, **kwargs)

    _, H = _dims(backend)
    T = whole.shape[1]
    monkeypatch.setattr(engine_module, "_CHUNK_ELEMS", 2 * H * T * 5)  # 5 queries per chunk (B = 2)
    # A causal-plus-padding mask takes the key-mask path (no chunks); hide that to chunk.
    monkeypatch.setattr(engine_module, "_padding_keys", lambda *args: None)
    monkeypatch.setattr(engine_module, "attend_sdpa", counting_attend)
    chunked, pi_chunked, _ = prefill(backend, cfg)
    # The biased layers really ran in chunks of 5 queries (layer 0 has no bias: one call).
    assert calls.count(5) >= T // 5 and max(c for c in calls if c != T) == 5
    assert max_diff(chunked, whole, pads, dim=1) <= tol(LOGIT_TOL)
    assert max_diff(pi_chunked, pi_whole, pads, dim=3) <= tol(PI_TOL)


@cpu_only("the key-mask path is the CPU flash kernel's")
@on_tiny_models
@pytest.mark.parametrize("case", ["composed", "biases_summed"])
def test_biased_prefill_builds_no_per_query_mask(backend: HFChatBackend, case: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A key bias on a causal, left-padded prefill, with pi and split-softmax too ("composed"),
    calls the kernel with [B, H, 1, K] key masks only: all queries at once, nothing q x K.
    (Gemma3's sliding-window layers need a per-query mask; its global layers do not.)"""
    masks: list[tuple[int, int]] = []
    real_attend = engine_module.attend_sdpa

    def recording_attend(query, key, value, mask, *args, **kwargs):
        masks.append((query.shape[2], 1 if mask is None else mask.shape[2]))
        return real_attend(query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(engine_module, "attend_sdpa", recording_attend)
    logits, _, pads = prefill(backend, traced(CASES[case]) if case == "composed" else CASES[case])
    T = logits.shape[1]
    whole = [m for q, m in masks if q > 1]
    assert whole, "no prefill call reached the kernel"
    if "gemma" not in type(backend.model).__name__.lower():
        assert all(m == 1 for m in whole), masks  # every mask a key mask
        assert not [q for q, _ in masks if 1 < q < T // 2], masks  # no query chunks
        if case == "composed":  # the system-only call: the queries from the span's first slot on
            assert any(T // 2 <= q < T for q, _ in masks), masks
    else:
        assert any(m == 1 for m in whole) and any(m > 1 for m in whole), masks


@cpu_only("forces the extra-V-channel path on the CPU by hiding the CPU flash kernel")
@on_models(["trace", "bias_pairs", "composed"])
def test_channel_path_matches_reference(backend: HFChatBackend, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The extra-V-channel path (used where no kernel reports log-sum-exps, e.g. CUDA), run on CPU."""
    monkeypatch.setattr(kernels, "CPU_FLASH", None)
    cfg = CASES[case]
    got, pi, pads = prefill(backend, cfg)
    want, pi_ref, _ = prefill(backend, cfg, impl=REFERENCE)
    assert max_diff(got, want, pads, dim=1) <= LOGIT_TOL
    if "trace" in cfg.kinds:
        assert max_diff(pi, pi_ref, pads, dim=3) <= PI_TOL
    sampling = Sampling(greedy=True, max_new_tokens=6, ignore_eos=True)
    assert_same_decode(*engine_and_reference(backend, sampling, traced(cfg)))


def test_plain_path_matches_transformers_sdpa(backend: HFChatBackend) -> None:
    """Without state the engine is SDPA; on CPU it folds GQA heads itself for one query (faster).

    On every device the greedy tokens must equal transformers' own SDPA's.
    """
    sampling = Sampling(greedy=True, max_new_tokens=8, ignore_eos=True)
    for convs in (CONVERSATIONS, CONVERSATIONS[:1]):  # padded batch; single row (mask-free decode)
        ours = chat(backend, convs, sampling)
        with implementation(backend, "sdpa"):
            theirs = chat(backend, convs, sampling)
        assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]
    ours, _, pads = plain_prefill(backend)
    theirs, _, _ = prefill(backend, None, impl="sdpa")
    assert max_diff(ours, theirs, pads, dim=1) <= tol(LOGIT_TOL)


# -- the full decode loop -------------------------------------------------------------------------
_ENGINE_RUNS: dict[tuple, list] = {}


def engine_run(backend: HFChatBackend, sampling: Sampling, iv: Interventions) -> list:
    """The engine's replies to CONVERSATIONS, computed once per backend, engine path (the kernel setting,
    and whether the CPU flash kernel is there: flex, SDPA or its extra-V-channel path), sampling and
    interventions: the decode tests, the plain runs and the batch test share them (a traced plain run is
    the "trace" case's own run)."""
    key = (id(backend), engine_module.kernel_for(backend.device), kernels.CPU_FLASH is None, sampling,
           tuple(iv.specs()))
    if key not in _ENGINE_RUNS:
        _ENGINE_RUNS[key] = chat(backend, CONVERSATIONS, sampling, iv)
    return _ENGINE_RUNS[key]


def plain_runs(backend: HFChatBackend, sampling: Sampling) -> tuple[list, list]:
    """The unmodified model's replies, traced and untraced (computed once per backend and engine path)."""
    with_trace, untraced = engine_run(backend, sampling, TRACE), engine_run(backend, sampling, Interventions())
    assert [r.token_ids for r in with_trace] == [r.token_ids for r in untraced]  # tracing never changes text
    return with_trace, untraced


@on_models(DECODE_CASES)
def test_greedy_decode_matches_reference(backend: HFChatBackend, case: str, new_tokens: int = 12) -> None:
    """`new_tokens`: test_attention_flex decodes fewer (each eager flex step on a CPU costs ~0.5 s on SmolLM2)."""
    cfg = traced(CASES[case])
    sampling = Sampling(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    got = engine_run(backend, sampling, cfg)
    with implementation(backend, REFERENCE):
        want = chat(backend, CONVERSATIONS, sampling, cfg)
    plain, untraced = plain_runs(backend, sampling)
    assert_same_decode(got, want)
    assert [r.text for r in got] == [r.text for r in want]
    L, H = _dims(backend)
    for g in got:
        assert g.trace["decode"].shape == (new_tokens, L, H)
    moved = max((g.trace["decode"] - p.trace["decode"]).abs().max().item() for g, p in zip(got, plain))
    if cfg.fingerprint():
        assert moved > 1e-3  # the intervention changed the computation (not always the greedy text)
    else:
        assert [r.token_ids for r in got] == [r.token_ids for r in untraced]


@on_tiny_models
def test_batch_rows_match_solo_runs(backend: HFChatBackend, new_tokens: int = 12) -> None:
    """Left padding must not leak into a row: batched = each conversation alone. The batched run is
    the "composed" decode test's (`engine_run`, the same sampling)."""
    cfg = CASES["composed"]
    sampling = Sampling(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    batched = engine_run(backend, sampling, cfg)
    for conv, row in zip(CONVERSATIONS, batched):
        (solo,) = chat(backend, [conv], sampling, cfg)
        assert solo.token_ids == row.token_ids  # greedy tokens: equal on every device
        assert (solo.trace["decode"] - row.trace["decode"]).abs().max() <= tol(PI_TOL)


@pytest.mark.model
def test_smollm2_long_greedy_decode_and_prefill_trace(smol: HFChatBackend) -> None:
    """The real model over 24 tokens, with the prefill trace, under split-softmax + bias."""
    cfg = Interventions.parse(["trace:prefill=true", "split-softmax:k=0.6", "bias:value=2.0,heads=0-10"])
    sampling = Sampling(greedy=True, max_new_tokens=24)
    got, want = engine_and_reference(smol, sampling, cfg)
    assert_same_decode(got, want)
    for g, w, conv in zip(got, want, CONVERSATIONS):
        assert g.text == w.text
        assert g.trace["prefill"].shape[0] == len(smol.render(conv).ids)
        assert (g.trace["prefill"] - w.trace["prefill"]).abs().max() <= tol(PI_TOL)


@pytest.mark.model  # ~1 s: out of the fast suite, as on SmolLM2
@pytest.mark.parametrize("backend", ["qwen2"], indirect=True)
def test_span_modes_prefix_and_content(backend: HFChatBackend) -> None:
    """`content` spans are inside `prefix` spans, so pi(content) <= pi(prefix); both match the reference.
    On tiny Qwen2 (SmolLM2's tokenizer and template): the spans are the renderer's, the rest is math;
    tests/test_backend.py checks the two modes' spans on SmolLM2."""
    sampling = Sampling(greedy=True, max_new_tokens=8, ignore_eos=True)
    prefix_renderer = backend.renderer
    try:
        results = {}
        for mode in ("prefix", "content"):
            backend.renderer = Renderer(backend.tokenizer, mode)
            spans = [backend.render(c).system_span for c in CONVERSATIONS]
            trace = chat(backend, CONVERSATIONS, sampling, TRACE)
            split_cfg = Interventions.parse(["trace", "split-softmax:k=0.7"])
            split, ref = engine_and_reference(backend, sampling, split_cfg)
            assert_same_decode(split, ref)
            results[mode] = (spans, trace, split)
    finally:
        backend.renderer = prefix_renderer
    (p_spans, p_trace, p_split), (c_spans, c_trace, c_split) = results["prefix"], results["content"]
    for (ps, pe), (cs, ce) in zip(p_spans, c_spans):
        assert ps == 0 and 0 < cs < ce <= pe  # content skips the template header and BOS
    for p, c in zip(p_trace, c_trace):
        assert p.token_ids == c.token_ids  # tracing alone never changes the text
        assert bool((c.trace["decode"] <= p.trace["decode"] + tol(PI_TOL)).all())
        assert (p.trace["decode"] - c.trace["decode"]).mean() > 0.01
    assert [r.token_ids for r in p_split] != [r.token_ids for r in c_split]  # the span matters


# -- sliding-window layers (Gemma3) --------------------------------------------------------------
@pytest.mark.parametrize("case", ["trace", "bias_all", "split_all", "composed"])
def test_sliding_window_decode_equals_full_recompute(gemma: HFChatBackend, case: str) -> None:
    """KV-cached decode (sliding layers keep only the last `window` keys) = recomputing all.

    The engine maps a layer's K keys onto the last K absolute slots (`state.kv_len`); if that
    mapping were wrong for layers that keep fewer keys than the absolute length, the cached
    decode would disagree with a no-cache forward over prompt + generated tokens, where every
    layer sees all T keys and the mask alone applies the window.
    """
    cfg = traced(CASES[case])
    conv = CONVERSATIONS[0]
    rendered = gemma.render(conv)
    T0 = len(rendered.ids)
    assert T0 > rendered.system_span[1] + SLIDING_WINDOW  # the window has slid past the system prompt
    (reply,) = chat(gemma, [conv], Sampling(greedy=True, max_new_tokens=10, ignore_eos=True), cfg)
    ids = rendered.ids + reply.token_ids[:-1]
    L, H = _dims(gemma)
    state = AttentionState(cfg.attention().model_copy(update={"trace_prefill": True}), [{"system": [rendered.system_span]}],
                           L, H, gemma.device)
    state.on_layout([0], len(ids), len(ids))
    x = torch.tensor([ids], device=gemma.device)
    with torch.inference_mode():
        out = gemma.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False,
                          **state.forward_kwargs(len(ids)))
    full_pi = state.row_traces([1], [0])[0]["prefill"][T0 - 1 :]  # pi of the queries that predicted each token
    assert out.logits[0, T0 - 1 :].argmax(-1).tolist() == reply.token_ids
    assert (full_pi - reply.trace["decode"]).abs().max() <= tol(PI_TOL)
    sliding = [i for i, t in enumerate(gemma.model.config.layer_types) if t == "sliding_attention"]
    full = [i for i in range(L) if i not in sliding]
    assert sliding and full
    # Physically: the sliding layers no longer see any system key, the full layer does.
    assert bool((reply.trace["decode"][:, sliding] == 0).all())
    assert bool((reply.trace["decode"][:, full] > 0.01).all())


# -- what the engine refuses ---------------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, layer_idx: int | None) -> None:
        super().__init__()
        if layer_idx is not None:
            self.layer_idx = layer_idx


def _state(n_layers: int = 2, heads: int = 4) -> AttentionState:
    state = AttentionState(CASES["split_all"].attention(), [{"system": [(0, 3)]}], n_layers, heads, current())
    state.on_layout([0], 6, 6)
    state.forward_kwargs(6)
    return state


@pytest.mark.parametrize("kwarg", ["sinks", "s_aux", "position_bias", "softcap"])
def test_engine_refuses_attention_kwargs_it_does_not_implement(kwarg: str) -> None:
    q = k = v = torch.randn(1, 4, 6, 8, device=current())
    value = torch.zeros(4, device=current()) if kwarg != "softcap" else 30.0
    with pytest.raises(DriftlabError, match=f"uses {kwarg}"):
        engine_module.driftlab_attention(_Layer(1), q, k, v, None, driftlab=_state(), **{kwarg: value})
    # Without an intervention the model's own SDPA path handles them (nothing is refused).
    out, _ = engine_module.driftlab_attention(_Layer(1), q, k, v, None)
    assert out.shape == (1, 6, 4, 8)


def test_engine_refuses_a_module_without_layer_idx() -> None:
    q = k = v = torch.randn(1, 4, 6, 8, device=current())
    with pytest.raises(DriftlabError, match="no layer_idx"):
        engine_module.driftlab_attention(_Layer(None), q, k, v, None, driftlab=_state())


@cpu_only("the CPU flash kernel reports the LSEs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rep", [1, 3])
def test_one_decode_call_attends_over_all_keys_and_over_the_system_keys(dtype: torch.dtype, n_rep: int) -> None:
    """`attend_both` against a float64 softmax: row 0 left-padded with its system prompt at slots
    2-5, row 1 without a system prompt (pi = 0)."""
    gen = torch.Generator().manual_seed(0)
    B, G, K, d = 2, 2, 11, 16
    q = torch.randn(B, G * n_rep, 1, d, generator=gen).to(dtype)
    k, v = (torch.randn(B, G, K, d, generator=gen).to(dtype) for _ in range(2))
    visible = torch.ones(B, K, dtype=torch.bool)
    visible[0, :2] = False
    system = torch.zeros(B, K, dtype=torch.bool)
    system[0, 2:6] = True
    all_keys = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]
    out, o_sys, lse_all, lse_sys = kernels.attend_both(q, k, v, kernels.both_masks(all_keys, system, n_rep, dtype),
                                                       0.25, n_rep)
    kk, vv = (x.double().repeat_interleave(n_rep, dim=1) for x in (k, v))
    logits = 0.25 * q.double() @ kk.transpose(-1, -2)  # [B, H, 1, K]
    weights = logits.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
    pi = (weights * system[:, None, None, :]).sum(-1)[..., 0]  # [B, H]
    sys_weights = logits.masked_fill(~system[:, None, None, :], float("-inf")).softmax(-1)[0]
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.reshape(B, -1, d).double(), (weights @ vv)[:, :, 0], atol=atol, rtol=0)
    torch.testing.assert_close(o_sys[0].reshape(-1, d).double(), (sys_weights @ vv[0])[:, 0], atol=atol, rtol=0)
    got_pi = kernels.system_pi(lse_all, lse_sys).reshape(B, -1).double()
    torch.testing.assert_close(got_pi, pi, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)
    assert (got_pi[1] == 0).all() and (got_pi[0] > 0.05).all()
