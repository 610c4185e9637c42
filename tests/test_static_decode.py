"""Static-cache decoding (`HFChatBackend(decode="static" | "compiled")`) against the dynamic loop.

Why: the static path exists to be captured in CUDA graphs on a GPU, which CI cannot run; what
a CPU can check is everything the capture depends on. The same greedy tokens as the dynamic
loop (and the same pi traces, within 1e-5) for every intervention the engine composes, with
batching and left padding, per-row limits and cancellation, and a prefix-cache hit; the
compiled step traced by dynamo as one graph (fullgraph) that is not recompiled from step to
step; and a model a static cache cannot serve falling back to the dynamic loop, said once.

Compile cost: dynamo with the `aot_eager` backend (functionalised graph, no code generation,
~5 s per intervention layout on a tiny model) checks capture, guards and in-place state for
every case; one test (`slow`) runs inductor, the backend of the real compiled path, which
costs 1-3 min on a cold 2-core CPU (seconds once inductor's cache under /tmp is warm). Every test
that compiles is marked `compile`, out of the fast part on the CPU (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from devices import backend_device, tol
from driftlab.chat import ChatRequest
from driftlab.chat.base import Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.steering.interventions import Interventions
from tiny_models import make_tiny_model

CONVS = [
    [{"role": "system", "content": "You are a pirate. Always talk like a pirate, and never admit it."},
     {"role": "user", "content": "Hello, how are you today? Tell me about your ship."}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Capital of Spain?"}],  # shorter: left padding in a batch
]
GREEDY = Sampling(greedy=True, max_new_tokens=10)
# The intervention layouts the engine composes; each compiles its own graph.
CASES = {
    "plain": [],
    "instaboost": ["instaboost:m=5"],
    "bias": ["bias:value=2.0"],
    "split": ["split-softmax:k=0.5"],
    "trace": ["trace:prefill=true"],
    "split+trace+bias": ["split-softmax:k=0.5", "trace", "bias:value=2.0"],
}


def _iv(specs: list[str]) -> Interventions:
    return Interventions.parse(specs) if specs else Interventions()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("static") / "qwen2")


@pytest.fixture(scope="module")
def backends(tiny_dir: Path) -> dict[str, HFChatBackend]:
    """The dynamic loop, eager static steps, and compiled static steps (aot_eager) of one tiny model."""
    def make(decode: str) -> HFChatBackend:
        return HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0, decode=decode)

    return {"dynamic": make("dynamic"), "static": make("static"), "compiled": make("compiled")}


@pytest.fixture(scope="module")
def dynamic_ref(backends: dict[str, HFChatBackend]):
    """The dynamic loop's replies to CONVS for a steer, per kernel family, computed once: the static
    and the compiled case (and the flex and mass-channel tests) compare with the same reference, and
    the greedy dynamic loop gives the same replies each time, so computing it again checked nothing."""
    from driftlab.attention.engine import kernel_for

    memo: dict[tuple, list] = {}

    def ref(specs: list[str]) -> list:
        key = (kernel_for(backends["dynamic"].device), tuple(specs))
        if key not in memo:
            memo[key] = _run(backends["dynamic"], specs)
        return memo[key]

    return ref


@pytest.fixture(autouse=True)
def _cheap_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    import driftlab.chat.static_decode as sd

    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {"backend": "aot_eager", "fullgraph": True, "dynamic": True})


def _run(backend: HFChatBackend, specs: list[str], convs=CONVS, sampling: Sampling = GREEDY, **kw):
    iv = _iv(specs)
    return backend.generate_tokens([backend.render(c, interventions=iv) for c in convs], sampling,
                                   interventions=iv, **kw)


def _assert_same(ref, got) -> None:
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    for a, b in zip(ref, got, strict=True):
        assert (a.trace is None) == (b.trace is None)
        if a.trace is None:
            continue
        assert (a.trace.prefill is None) == (b.trace.prefill is None)
        for part in ("decode", "prefill") if a.trace.prefill is not None else ("decode",):
            np.testing.assert_allclose(getattr(b.trace, part), getattr(a.trace, part), atol=tol(1e-5), rtol=0)


# -- helpers and refusals (no model) ----------------------------------------------------------------
def test_cache_length_buckets_lengths_and_respects_the_context_window() -> None:
    from driftlab.chat.static_decode import cache_length

    assert cache_length(1) == 256 and cache_length(256) == 256 and cache_length(257) == 384
    assert cache_length(2000) == 2048 and cache_length(2049) == 2304  # 1/8 of the octave
    # at most 12.5% more slots, or the next multiple of 128 (flex's key block) for short calls, two blocks at least
    assert all(n <= cache_length(n) <= max(-(-n // 128) * 128, n * 1.125, 256) for n in range(1, 5000, 37))
    assert all(cache_length(n) % 128 == 0 for n in range(1, 5000, 37))
    assert cache_length(1000, limit=1010) == 1010 and cache_length(1000, limit=900) == 1024


def test_batches_round_up_to_power_of_two_buckets_and_bias_slots_to_a_few() -> None:
    from driftlab.chat.static_decode import batch_bucket, bias_slots

    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]
    assert [bias_slots(n) for n in (0, 1, 2, 3, 4, 5)] == [4, 4, 4, 4, 4, 8]


def test_the_compile_cache_of_a_checkout_without_installed_metadata(monkeypatch) -> None:
    """driftlab run from a source tree on PYTHONPATH (as on the lent GPU machine) has no installed
    metadata: its compile cache is tagged `checkout` (the first H100 call died here)."""
    import importlib.metadata as md

    from driftlab.chat.static_decode import compile_cache_dir

    real = md.version

    def version(name: str) -> str:
        if name == "driftlab":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    assert compile_cache_dir().name.endswith("-driftlabcheckout")


def test_inductors_own_default_in_the_environment_is_not_the_users_choice(tmp_path) -> None:
    """Importing pastalib (or anything that asks inductor for its cache) writes inductor's /tmp
    default into TORCHINDUCTOR_CACHE_DIR; driftlab still uses its own compile cache then, and
    only a directory the user named replaces it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from driftlab.chat.static_decode import users_cache_dir

    assert users_cache_dir(None) is None
    assert users_cache_dir(default_cache_dir()) is None
    assert users_cache_dir(default_cache_dir() + "/") is None  # (the same directory)
    assert users_cache_dir(str(tmp_path)) == str(tmp_path)


@pytest.mark.process
def test_a_set_inductor_cache_is_judged_when_compiling_not_at_import(tmp_path) -> None:
    """A process whose parent compiled inherits TORCHINDUCTOR_CACHE_DIR (inductor wrote its default
    there). Importing the HF backend must not import inductor to judge it: a second of imports in
    every such child, a server's or a sweep's, that never compiles. The choice is still honoured."""
    code = ("import os, sys, driftlab.chat.hf; from driftlab.chat import static_decode as s; "
            "print('torch._inductor' in sys.modules, s.use_compile_cache())")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", str(tmp_path)]


def test_unknown_decode_mode_is_refused() -> None:
    from pydantic import ValidationError

    from driftlab.chat.spec import BackendSpec
    from driftlab.errors import DriftlabError

    with pytest.raises(ValidationError):
        BackendSpec(decode="fast")
    with pytest.raises(DriftlabError, match="decode mode"):
        HFChatBackend("no-such-model", decode="fast")


@pytest.fixture
def flex_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The intervention path on FlexAttention (as on CUDA), and a call it hands back to SDPA an error."""
    from driftlab.attention import engine

    monkeypatch.setenv(engine.KERNEL_ENV, "flex")

    def declined(reason: str) -> None:
        raise AssertionError(f"the flex path fell back to SDPA: {reason}")

    monkeypatch.setattr(engine, "_flex_declined", declined)


# A test that compiles (dynamo with aot_eager, or inductor) is marked `compile`: on the CPU that also
# marks it `model`, out of the fast part (tests/conftest.py).
COMPILED = pytest.param("compiled", marks=pytest.mark.compile)


# -- the same tokens as the dynamic loop ------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["static", COMPILED])
def test_static_decode_gives_the_dynamic_loops_tokens(backends, dynamic_ref, case: str, mode: str) -> None:
    specs = CASES[case]
    ref = dynamic_ref(specs)
    if specs and case != "trace":  # the intervention changes this model's greedy tokens: the test can fail
        assert [r.token_ids for r in ref] != [r.token_ids for r in dynamic_ref([])]
    _assert_same(ref, _run(backends[mode], specs))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["static", COMPILED])
def test_flex_static_decode_gives_the_dynamic_loops_tokens(backends, dynamic_ref, flex_kernel, case: str,
                                                          mode: str) -> None:
    """The FlexAttention path in the static layout (the CUDA kernel of `--decode compiled`): the
    prefill through block masks shifted to the prompt's slots, each decode step masked in the
    score from the state's slot tensors; `plain`: the lean step, one pass over the filled key
    blocks. The reference is the dynamic loop on the SDPA path."""
    import os

    from driftlab.attention import engine

    specs = CASES[case]
    os.environ[engine.KERNEL_ENV] = "sdpa"
    ref = dynamic_ref(specs)
    os.environ[engine.KERNEL_ENV] = "flex"
    _assert_same(ref, _run(backends[mode], specs))


def test_a_static_step_where_no_kernel_reports_lses_takes_pi_from_mass_channels(backends, dynamic_ref,
                                                                                monkeypatch) -> None:
    """The SDPA family without an LSE-reporting kernel (CUDA's, with DRIFTLAB_ATTENTION_KERNEL=sdpa):
    the steered step gets pi from indicator channels appended to V; same tokens and pi as the
    dynamic loop with the CPU's flash kernel."""
    from driftlab.attention import kernels

    specs = CASES["split+trace+bias"]
    ref = dynamic_ref(specs)  # with the flash kernel: before CPU_FLASH goes
    monkeypatch.setattr(kernels, "CPU_FLASH", None)
    _assert_same(ref, _run(backends["static"], specs))


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_the_mask_memo_holds_one_forward_pass_not_one_entry_per_step(backends, kernel: str, request,
                                                                     monkeypatch) -> None:
    """The dynamic loop's masks change every step (one more key): the engine's memo of them is
    per forward pass, so a long decode does not grow it step by step."""
    from driftlab.attention.state import AttentionState

    if kernel == "flex":
        request.getfixturevalue("flex_kernel")
    sizes: list[int] = []
    forward_kwargs = AttentionState.forward_kwargs

    def spy(self, kv_len: int) -> dict:
        sizes.append(len(self.mask_memo))  # what the previous pass left
        return forward_kwargs(self, kv_len)

    monkeypatch.setattr(AttentionState, "forward_kwargs", spy)
    _run(backends["dynamic"], ["split-softmax:k=0.5", "trace"], sampling=Sampling(greedy=True, max_new_tokens=24,
                                                                                  ignore_eos=True))
    assert len(sizes) == 24 and 0 < max(sizes) <= 2, sizes


def test_a_dynamic_decode_step_on_flex_builds_no_block_mask_and_checks_no_mask(backends, flex_kernel,
                                                                               monkeypatch) -> None:
    """The dynamic loop's decode steps mask from the rows' first slots (a tensor kept per
    layout), as the static loop's do: block masks and the mask check (a host sync) only at the
    prefill, however many steps follow; same tokens and pi as the SDPA path."""
    from driftlab.attention import engine

    flex = engine._flex_module()
    built, checked = [], []
    block_mask, matches = flex.block_mask, engine._mask_matches
    monkeypatch.setattr(flex, "block_mask", lambda mod, B, q, n, device: built.append(q) or block_mask(mod, B, q, n,
                                                                                                       device))
    monkeypatch.setattr(engine, "_mask_matches", lambda mask, *a: checked.append(mask.shape[2]) or matches(mask, *a))
    specs = ["split-softmax:k=0.5", "trace"]
    sampling = Sampling(greedy=True, max_new_tokens=12, ignore_eos=True)
    got = _run(backends["dynamic"], specs, sampling=sampling)
    assert built and all(q > 1 for q in built) and all(q > 1 for q in checked), (built, checked)
    monkeypatch.setenv(engine.KERNEL_ENV, "sdpa")
    _assert_same(_run(backends["dynamic"], specs, sampling=sampling), got)


def _flex_layout(mask) -> bool:
    """Whether a BlockMask's block tensors have the layout flex's Triton kernels assume: row b,
    head h at (b * heads + h) * stride(1) (flex.decode_block_mask), i.e. the batch stride equal to
    heads * stride(1), never a shared (expanded, stride 0) row."""
    tensors = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    return all(t.stride(0) == t.shape[1] * t.stride(1) for t in tensors if t is not None and t.shape[0] > 1)


def test_every_block_mask_flex_reads_gives_each_row_its_own_memory(backends, flex_kernel, monkeypatch) -> None:
    """On a GPU a block mask whose rows share memory (an `expand`ed block order, batch stride 0)
    sends every row past the first out of the tensor's storage: the illegal memory access an H200
    met (torch 2.11). A CPU's eager flex reads strides and computes the right answer anyway, so what
    is checked here is the layout of every block mask the decode loops hand flex, dynamic and static,
    all-key and system-only, in a batch of rows."""
    from driftlab.attention import engine
    from driftlab.attention.state import every_block

    flex = engine._flex_module()
    seen, call = [], flex._call

    def recording(query, key, value, **kwargs):
        seen.append(kwargs["block_mask"])
        return call(query, key, value, **kwargs)

    monkeypatch.setattr(flex, "_call", recording)
    sampling = Sampling(greedy=True, max_new_tokens=3, ignore_eos=True)
    for loop in ("dynamic", "static"):
        _run(backends[loop], ["split-softmax:k=0.5", "trace"], sampling=sampling)
    decode = [m for m in seen if m.shape[-2] == 1]
    assert len(decode) > 4 and all(_flex_layout(m) for m in seen)
    assert _flex_layout(flex.decode_block_mask(*every_block(3, 300, torch.device("cpu")), lambda *a: True, 300))


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_a_static_decode_step_never_waits_for_the_device(backends, kernel: str, request, monkeypatch) -> None:
    """Inside a static decode step (the part a CUDA graph captures) nothing reads a tensor's value
    on the host: no .item()/bool()/int() (aten._local_scalar_dense, is_nonzero), no torch.equal,
    no nonzero, no .tolist()/.numpy(), counted through a dispatch mode, with every engine mode on."""
    import torch

    from host_reads import HostReads

    if kernel == "flex":
        request.getfixturevalue("flex_kernel")
    backend, per_step = backends["static"], []
    step, current = backend._static_step, None

    def counted(*args, **kwargs):
        nonlocal current
        with HostReads() as syncs:
            current = syncs.seen
            out = step(*args, **kwargs)
        per_step.append(current)
        current = None
        return out

    def host_read(method: str):  # host reads that do not go through the dispatcher
        original = getattr(torch.Tensor, method)

        def read(self, *args, **kwargs):
            if current is not None:
                current.append(method)
            return original(self, *args, **kwargs)
        return read

    for method in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, host_read(method))
    monkeypatch.setattr(backend, "_static_step", counted)
    _run(backend, ["split-softmax:k=0.5", "trace", "instaboost:m=3"],
         sampling=Sampling(greedy=True, max_new_tokens=6, ignore_eos=True))
    assert len(per_step) == 5 and all(not seen for seen in per_step), per_step


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("specs", [[], ["split-softmax:k=0.5", "trace", "instaboost:m=3"]])
def test_a_dynamic_decode_step_reads_the_device_once(backends, kernel: str, specs, request, monkeypatch) -> None:
    """The dynamic loop's step (sample, take, compact, feed) copies one thing to the host, the
    sampled tokens: which rows are done is kept on the host, and a decode step's mask is built
    without reading the padding on the host (transformers' causal-skip check)."""
    import torch

    from driftlab.chat import decoding
    from host_reads import HOST_READS, HostReads

    if kernel == "flex":
        request.getfixturevalue("flex_kernel")
    per_step: list[list[str]] = []
    inside = []  # a step method is running

    def host_read(method: str):
        original = getattr(torch.Tensor, method)

        def read(self, *args, **kwargs):
            if inside:
                per_step[-1].append(method)
            return original(self, *args, **kwargs)
        return read

    for method in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, host_read(method))
    for name in ("sample", "take", "compact", "feed"):
        def counted(self, *args, _method=getattr(decoding.Decoding, name), _name=name, **kwargs):
            if _name == "sample":
                per_step.append([])
            inside.append(_name)
            try:
                with HostReads((*HOST_READS, "item"), record=lambda op: per_step[-1].append(op)):
                    return _method(self, *args, **kwargs)
            finally:
                inside.pop()
        monkeypatch.setattr(decoding.Decoding, name, counted)
    convs = CONVS + [[{"role": "user", "content": "Count to ten."}]]
    _run(backends["dynamic"], specs, convs=convs, sampling=Sampling(greedy=True, max_new_tokens=6, ignore_eos=True))
    assert len(per_step) == 6 and all(seen == ["tolist"] for seen in per_step), per_step


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_compiled_step_is_one_graph_not_recompiled_per_step_or_call(backends, kernel: str, request) -> None:
    """After the first call of a layout, later calls of that layout and shape compile nothing,
    whatever their prompts, strengths or step count: the state the step reads is static
    (with flex: the query's slot and the rows' padding are tensors, not Python values)."""
    if kernel == "flex":
        request.getfixturevalue("flex_kernel")
    compiled = backends["compiled"]
    _run(compiled, ["split-softmax:k=0.5", "trace"], sampling=Sampling(greedy=True, max_new_tokens=6))
    before = compiled.ran()["decode"]["graphs"]  # this backend's own graphs, whatever ran before
    other = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}],
             [{"role": "system", "content": "You speak only in questions."}, {"role": "user", "content": "Hi."}]]
    got = _run(compiled, ["split-softmax:k=0.7", "trace"], convs=other, sampling=Sampling(greedy=True, max_new_tokens=9))
    assert compiled.ran()["decode"]["graphs"] == before  # no recompile
    _assert_same(_run(backends["dynamic"], ["split-softmax:k=0.7", "trace"], convs=other,
                      sampling=Sampling(greedy=True, max_new_tokens=9)), got)


def test_cuda_graph_recordings_are_counted_inside_a_decoders_own_steps_only() -> None:
    """`StaticDecoder` counts the CUDA graphs recorded during its steps from the announcement
    inductor's CUDA-graph trees make for each recording (dynamo's compile callbacks; simulated here,
    since a CPU records none: the CUDA test below sees real ones). A dynamo compile's announcement
    and a recording outside the decoder's steps do not count."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    from driftlab.chat.static_decode import CudaGraphRecordings, StaticDecoder

    def announce(trigger: CallbackTrigger) -> None:
        with callback_handler.install_callbacks(trigger, "0/0"):
            pass

    decoder, key = StaticDecoder(model=None, compiled=True), (1, False, 0, "sdpa", False)
    assert CudaGraphRecordings.watch()  # a second watch below must not count twice
    callback_handler.remove_start_callback(CudaGraphRecordings._seen)  # what torch._dynamo.reset() does to it
    decoder.run(lambda: announce(CallbackTrigger.CUDAGRAPH_RECORDING), key, say=print)
    decoder.run(lambda: announce(CallbackTrigger.DYNAMO), key, say=print)
    announce(CallbackTrigger.CUDAGRAPH_RECORDING)
    assert decoder.cudagraph_recordings == 1 and decoder.recordings_watched


@pytest.mark.compile
def test_a_bucket_in_hand_replays_its_cuda_graphs_without_recording(backends, device) -> None:
    """A call of a batch bucket whose prompts fit the cache in hand replays the CUDA graphs its
    first calls recorded (StaticDecoder keeps the cache and the attention state's tensors for this):
    no new recording, whatever the steer's strength. On a CPU the compiled step records none."""
    compiled = backends["compiled"]
    specs, sampling = ["split-softmax:k=0.5", "trace"], Sampling(greedy=True, max_new_tokens=6)
    for _ in range(2):  # CUDA-graph trees warm a graph up on its first run and record it on a later one
        _run(compiled, specs, sampling=sampling)
    recorded = compiled.ran()["decode"].get("cudagraph_recordings")
    if recorded is None:  # torch's CallbackTrigger.CUDAGRAPH_RECORDING is newer than this torch
        pytest.skip("this torch does not announce CUDA-graph recordings")
    assert recorded > 0 if device.type == "cuda" else recorded == 0
    _run(compiled, ["split-softmax:k=0.8", "trace"], sampling=Sampling(greedy=True, max_new_tokens=9))
    assert compiled.ran()["decode"]["cudagraph_recordings"] == recorded


@pytest.mark.parametrize("mode", ["static", COMPILED])
def test_row_limits_cancellation_and_early_handover(backends, mode: str) -> None:
    convs = [[{"role": "user", "content": f"Count from {i} to one hundred."}] for i in (1, 5, 9)]
    sampling = Sampling(max_new_tokens=10, temperature=0, ignore_eos=True)

    def run(backend: HFChatBackend):
        streamed, finished = [0, 0, 0], []

        def on_token(row: int, token: int) -> None:
            streamed[row] += 1

        replies = backend.generate(ChatRequest(
            convs, sampling, row_max_tokens=[3, 10, 10], on_token=on_token,
            cancelled=lambda row: row == 2 and streamed[2] >= 5,
            on_finish=lambda row, reply: finished.append((row, streamed[1]))))
        return replies, finished

    ref, ref_finished = run(backends["dynamic"])
    got, finished = run(backends[mode])
    assert [r.n_tokens for r in got] == [3, 10, 5]
    assert [r.finish_reason for r in got] == ["length", "length", "cancelled"]
    assert [r.token_ids for r in got] == [r.token_ids for r in ref] and finished == ref_finished


@pytest.mark.parametrize("mode", ["static", COMPILED])
def test_prefix_cache_hit_fills_the_static_cache(tiny_dir: Path, backends, mode: str) -> None:
    """The second call reuses the first's KV (prompt and fed-back reply) from the prefix cache:
    `decoding.kv_from_hits` writes it into the static cache's first slots, `decoding.store_prefixes` reads
    the static cache's slots back; tokens equal the dynamic loop's without any cache."""
    cached = HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), decode=mode)
    specs = ["instaboost:m=5"]
    first = _run(cached, specs)
    follow = [c + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Tell me more."}]
              for c, r in zip(CONVS, first, strict=True)]
    before = cached.prefix_cache.hits_tokens
    warm = _run(cached, specs, convs=follow)
    assert cached.prefix_cache.hits_tokens - before >= sum(len(cached.render(c).ids) for c in CONVS)
    _assert_same(_run(backends["dynamic"], specs, convs=follow), warm)
    _assert_same(_run(backends["dynamic"], specs), first)


def test_cache_bytes_is_what_a_static_cache_allocates(backends) -> None:
    """`cache_bytes` (the memory budget's and the paper benchmark's estimate) against the bytes a
    real static cache of the model holds after a call: its keys and values, every layer."""
    from driftlab.chat.static_decode import cache_bytes

    backend = backends["static"]
    _run(backend, [], convs=CONVS * 2)  # bucket 4
    static = backend._static
    held = sum(t.nbytes for layer in static.cache.layers for t in (layer.keys, layer.values))
    assert held == cache_bytes(backend.model.config, 4, static.length, backend.model.dtype.itemsize) > 0


def test_alternating_batch_buckets_keep_their_caches(backends) -> None:
    """A self-chat with CFG cycles through three batch sizes (the user's turns, the agent's, and
    CFG's agent turns with twice the rows): each bucket keeps its own cache, so none is reallocated
    (nor its captured graphs recorded again); a fourth bucket lets the least recently used one go,
    counted in `ran`."""
    static = backends["static"]._static
    caches = {}
    evicted = static.evictions
    for convs in (CONVS, CONVS[:1], CONVS * 2, CONVS, CONVS[:1], CONVS * 2):
        _run(backends["static"], [], convs=convs)
        caches.setdefault(len(convs), set()).add(id(static.cache))
    assert {n: len(ids) for n, ids in caches.items()} == {2: 1, 1: 1, 4: 1}
    assert static.evictions == evicted
    _run(backends["static"], [], convs=CONVS * 4)  # bucket 8: bucket 2 (used before 1 and 4) goes
    assert list(static._held) == [1, 4, 8]
    assert backends["static"].ran()["decode"]["cache_evictions"] == evicted + 1


def test_guidance_rows_decode_statically(backends) -> None:
    """CFG decodes each conversation beside its unconditional twin, as extra batch rows."""
    request = ChatRequest(CONVS, GREEDY, interventions=_iv(["cfg:alpha=1.5"]))
    ref = backends["dynamic"].generate(request)
    assert [r.token_ids for r in backends["static"].generate(request)] == [r.token_ids for r in ref]


def test_the_log_says_which_loop_decodes_and_why(tiny_dir: Path, caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="driftlab.chat.hf"):
        for decode in ("auto", "static"):
            HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                          decode=decode).close()
    lines = [r.getMessage() for r in caplog.records if "decodes with" in r.getMessage()]
    kind = backend_device().split(":")[0]
    auto = "compiled" if kind == "cuda" else "dynamic"
    assert len(lines) == 2 and f"the {auto} loop (--decode auto: {auto} on {kind}, compiled on CUDA)" in lines[0], lines
    assert "the static loop (--decode static)" in lines[1], lines


# -- where a static cache cannot serve the model --------------------------------------------------
def test_sliding_window_model_falls_back_to_the_dynamic_loop_said_once(tmp_path: Path, capsys) -> None:
    gemma = make_tiny_model("gemma3", tmp_path / "gemma3", sliding_window=8)
    capsys.readouterr()
    backend = HFChatBackend(str(gemma), dtype="float32", device=backend_device(), prefix_cache_bytes=0, decode="compiled")
    dynamic = HFChatBackend(str(gemma), dtype="float32", device=backend_device(), prefix_cache_bytes=0, decode="dynamic")
    for specs in ([], ["split-softmax:k=0.5"]):
        assert [r.token_ids for r in _run(backend, specs)] == [r.token_ids for r in _run(dynamic, specs)]
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert err.count("--decode compiled is not available") == 1, err
    assert "sliding_attention" in err and "dynamic cache" in err
    ran = backend.ran()["decode"]
    assert (ran["asked"], ran["loop"]) == ("compiled", "dynamic") and "sliding_attention" in ran["refused"]
    assert dynamic.ran() == {"decode": {"asked": "dynamic", "loop": "dynamic"}}


def test_a_step_that_cannot_compile_runs_eagerly_said_once(tiny_dir: Path, backends, monkeypatch, capsys) -> None:
    """A dynamo refusal happens before the step runs: that step and the later ones run eagerly
    on the same static cache, with the same tokens."""
    from torch._dynamo.exc import Unsupported

    import driftlab.chat.static_decode as sd

    compile_ = sd.torch.compile

    def refuse(fn, **options):
        if getattr(fn, "__name__", "") != "forward":  # flex and its block masks compile as before on CUDA
            return compile_(fn, **options)

        def step(*args, **kwargs):
            raise Unsupported("no capture here")
        return step

    monkeypatch.setattr(sd.torch, "compile", refuse)
    backend = HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0, decode="compiled")
    capsys.readouterr()
    for specs in (["trace"], ["trace"]):
        _assert_same(_run(backends["dynamic"], specs), _run(backend, specs))
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert err.count("cannot be compiled") == 1 and "no capture here" in err, err
    ran = backend.ran()["decode"]
    assert ran["loop"] == "static" and "no capture here" in ran["eager_after"] and ran["graphs"] == 0


@pytest.mark.compile
def test_past_the_recompile_limit_steps_run_eagerly_said_once_and_recorded(tiny_dir: Path, backends, monkeypatch,
                                                                           capsys) -> None:
    """Past dynamo's recompile limit a fullgraph compile raises (FailOnRecompileLimitHit, not a
    TorchDynamoException): the run goes on eagerly on the static cache with the same tokens,
    says so once, and `ran()` (the manifest's `ran`) records the loop that really decoded."""
    import torch

    import driftlab.chat.static_decode as sd

    torch._dynamo.reset()  # the limit counts per code object: transformers' forward wrapper, shared by every model
    monkeypatch.setattr(sd, "RECOMPILE_LIMIT", 1)
    backend = HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                            decode="compiled")
    capsys.readouterr()
    # torch's own patch API, never monkeypatch: a config module serves its entries through
    # __getattr__, so monkeypatch's undo deletes (hides) the entry and every later compile fails.
    with torch._dynamo.config.patch(recompile_limit=1):
        for convs in (CONVS, CONVS[:1], CONVS):  # a second batch size needs a second graph: past the limit of 1
            _assert_same(_run(backends["dynamic"], ["trace"], convs=convs), _run(backend, ["trace"], convs=convs))
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("recompile limit") == 1, err
    ran = backend.ran()["decode"]
    assert (ran["loop"], ran["graphs"]) == ("static", 1) and "recompile limit" in ran["eager_after"]


@pytest.mark.compile
def test_a_compiled_selfchat_stays_within_the_graph_budget_and_records_it(tiny_dir: Path, tmp_path: Path) -> None:
    """A self-chat's prompts grow every round and its calls have two batch sizes (turns, and the
    agent's turns with their probes): the cache length is a dynamic dimension, so the whole run
    compiles one graph per (batch bucket, kind), fewer than the cache shapes it asks for, and its
    manifest says which loop ran with which graphs, how long compiling took and that nothing
    went past the budget."""
    import json

    from driftlab.chat.spec import BackendSpec
    from driftlab.protocol.runner import run_protocol
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig

    backend = HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                            decode="compiled")
    calls = []
    new_cache = backend._static.new_cache
    backend._static.new_cache = lambda b, n: calls.append((b, n)) or new_cache(b, n)
    config = SelfChatConfig(backend=BackendSpec(model=str(tiny_dir), dtype="float32"), pairs=2, rounds=4, seed=1,
                            sampling=Sampling(max_new_tokens=40, ignore_eos=True), probe_tokens=12)
    run_protocol(SelfChat(config, backend), tmp_path / "run", progress=False)
    ran = json.loads((tmp_path / "run" / "manifest.json").read_text())["ran"]["agent"]["decode"]
    assert (ran["asked"], ran["loop"]) == ("compiled", "compiled") and "eager_after" not in ran
    keys = ran["graph_keys"]
    assert all(k["graphs"] == 1 for k in keys) and "over_budget" not in ran, ran
    assert ran["graphs"] == len(keys) < len(set(calls)) < len(calls), (ran, calls)
    assert ran["compile_s"] > 0
    assert set(ran["compile_cache"]) == {"hits", "misses", "aot_hit", "aot_miss", "aot_bypass"}
    # (aot_eager here has no AOTAutograd cache: inductor's use of it is checked in test_benchmarks_gpu.py)


# -- inductor, the compiled path's real backend ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.compile
def test_inductor_compiled_step_gives_the_dynamic_loops_tokens(tiny_dir: Path, backends, monkeypatch,
                                                                tmp_path) -> None:
    """Generated code (inductor; on CUDA it would be captured in CUDA graphs), every engine mode
    at once: split-softmax with a tensor strength, pi written in place into the trace buffer, a
    key bias; batched with left padding; then a prompt long enough for a longer cache, on the same
    graph (the cache length is dynamic). The step is aot-compiled and stored (chat.precompiled, on
    by default on a CPU), one artifact for both cache lengths. Compile cost: see the module docstring."""
    import driftlab.chat.static_decode as sd

    # The production options (static_decode.COMPILE_OPTIONS["cpu"]), which the autouse fixture swapped,
    # and a compile cache of its own, so the step is compiled here, not loaded from an earlier run's.
    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {"fullgraph": True, "dynamic": True})
    monkeypatch.setenv("DRIFTLAB_CACHE", str(tmp_path))
    backend = HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0, decode="compiled")
    specs = CASES["split+trace+bias"]
    longer = [c[:-1] + [{"role": "user", "content": c[-1]["content"] + " Tell me everything." * 70}] for c in CONVS]
    for convs in (CONVS, longer):
        _assert_same(_run(backends["dynamic"], specs, convs=convs), _run(backend, specs, convs=convs))
    ran = backend.ran()["decode"]
    assert backend._static.compiled and ran["graphs"] == 1 and len(backend._static.shapes) == 2, ran
    assert (ran["precompiled"]["saved"], ran["precompiled"]["loaded"]) == (1, 0), ran


# -- the real model, eager static steps ----------------------------------------------------------
@pytest.mark.parametrize("case", ["plain", "split", "split-flex", "plain-flex"])
def test_smollm2_static_decode_gives_the_dynamic_loops_tokens(smol_dir, smol32, case: str, request) -> None:
    """Eager static steps on the real model; `split-flex`: on the FlexAttention path (as on CUDA),
    against the dynamic loop on the SDPA path."""
    static = _SMOL.get("static") or _SMOL.setdefault(
        "static", HFChatBackend(str(smol_dir), dtype="float32", prefix_cache_bytes=0, decode="static"))
    specs = {"plain": [], "split": ["split-softmax:k=0.6", "trace"], "split-flex": ["split-softmax:k=0.6", "trace"],
             "plain-flex": []}[case]
    # Eager flex on a CPU materialises every step's scores: fewer tokens keep it to seconds.
    sampling = Sampling(greedy=True, max_new_tokens=4 if case.endswith("flex") else 16)
    ref = _run(smol32, specs, sampling=sampling)
    if case.endswith("flex"):  # plain-flex: the lean step, SmolLM2's 9 query heads folded onto its 3 KV heads
        request.getfixturevalue("flex_kernel")
    _assert_same(ref, _run(static, specs, sampling=sampling))


_SMOL: dict[str, HFChatBackend] = {}


# -- the compiled graph and the op count of a steered step -------------------------------------------
@pytest.mark.compile
def test_the_compiled_steered_step_reads_its_block_counts_from_graph_inputs(tiny_dir: Path, flex_kernel,
                                                                             monkeypatch) -> None:
    """The graph dynamo compiles for a steered decode step on the flex path (CUDA's): two flex calls
    per layer (all keys; system keys), each with a block mask whose KV block count and indices are
    graph inputs (the state's static tensors, updated before each step), and no `.item()` (a float
    read as a graph input would keep the step out of CUDA graphs)."""
    import driftlab.chat.static_decode as sd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {"backend": capture, "fullgraph": True, "dynamic": True})
    backend = HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                            decode="compiled")
    _run(backend, ["split-softmax:k=0.5", "trace", "instaboost:m=3"], sampling=Sampling(greedy=True, max_new_tokens=4))
    (gm,) = graphs
    nodes = list(gm.graph.nodes)
    inputs = {n for n in nodes if n.op == "placeholder"}
    flex_calls = [n for n in nodes if n.op == "call_function" and "flex_attention" in str(n.target)]
    assert len(flex_calls) == 2 * backend.shape.layers, len(flex_calls)
    for call in flex_calls:
        block_mask = call.args[4]  # (q_len, kv_len, kv_num_blocks, kv_indices, ...)
        assert block_mask[2] in inputs and block_mask[3] in inputs, block_mask[:4]
    assert not [n for n in nodes if n.op == "call_method" and n.target == "item"]


@torch.inference_mode()
def _probe_step(decoder, model, batch: int, prompt: int, steered: bool) -> None:
    """Two compiled decode steps of `batch` rows on a fresh `prompt`-token layout, built as the
    GPU review's probe built them: the decoder's own cache and arena, a steered state laid out
    statically (split-softmax + trace), left padding on every row but the first."""
    import driftlab.chat.static_decode as sd
    from driftlab.attention.state import AttentionState

    cfg = model.config
    cache = decoder.new_cache(batch, sd.cache_length(prompt + 4))
    K = decoder.length
    pads = [0] + [3] * (batch - 1)
    shape = (cfg.num_hidden_layers, cfg.num_attention_heads, torch.device("cpu"))
    if steered:
        state = AttentionState([_iv(["split-softmax:k=0.5", "trace"]).attention()] * batch,
                               [{"system": [(0, 6)]}] * batch, *shape)
        state.on_layout(pads, prompt, K)
    else:  # the lean plain step's state (hf's layout on the flex path)
        state = AttentionState.lean_layout(pads, prompt, K, *shape)
    state.static_layout(decoder.arena, sd.bias_slots(0))
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt))
    mask = torch.ones(batch, K, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    positions = (mask[:, :prompt].cumsum(-1) - 1).clamp(min=0)

    def forward(fn, tokens, pos):
        return fn(input_ids=tokens, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                  logits_to_keep=1, **state.forward_kwargs(K)).logits

    logits = forward(model, ids, positions)
    pos = positions[:, -1:]
    for _ in range(2):
        pos = pos + 1
        nxt = logits[:, -1].argmax(-1)
        logits = decoder.run(lambda: forward(decoder.step(), nxt[:, None], pos),
                             (batch, steered, 4 if steered else 0, "driftlab", False), print)


def _gqa7_model():
    """A 2-layer model with Qwen2.5-7B's head counts (28 query, 4 KV heads: a group of 7)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from driftlab.attention import engine

    engine.register()
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16, num_hidden_layers=2,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="driftlab").eval()


@pytest.mark.compile
def test_a_cache_whose_block_count_equals_another_dimension_compiles_no_second_graph(flex_kernel,
                                                                                   monkeypatch) -> None:
    """The GPU review's probe, as a test. Dynamo's duck shaping gives input dimensions of equal size
    one symbol: a first compile on a cache of 512 slots has 4 key blocks, as many as the model's KV
    heads and the bias slots, which the graph specialises, so the block count was pinned to 4 and
    the next cache length (640: 5 blocks) compiled again. driftlab compiles without duck shaping:
    one graph serves every cache length, at 256 slots (2 blocks: the review's tie with 2 slots) too."""
    import driftlab.chat.static_decode as sd

    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {"backend": "aot_eager", "fullgraph": True, "dynamic": True})
    model = _gqa7_model()
    for first, then in ((500, 600), (200, 300)):  # 512 slots then 640; 256 then 384
        decoder = sd.StaticDecoder(model, compiled=True)
        torch._dynamo.reset()
        _probe_step(decoder, model, 1, first, steered=True)
        assert decoder.graphs == 1
        with torch.compiler.set_stance("fail_on_recompile"):
            _probe_step(decoder, model, 1, then, steered=True)
        assert decoder.graphs == 1 and len(decoder.shapes) == 2 and not decoder.over_budget, decoder.ran()


@pytest.mark.compile
def test_a_folded_query_group_reaches_the_bias_score_mod_as_a_constant(flex_kernel, monkeypatch) -> None:
    """Qwen2.5-7B's group of 7 query heads per KV head is folded into query rows, and the bias
    score_mod computes a head index from it. Under dynamic shapes the cache's KV-head count was
    symbolic, so the group reached the score_mod as a symbolic scalar input, which inductor's flex
    lowering cannot lower (an H100, torch 2.11: "'ShapeAsConstantBuffer' object has no attribute
    'dtype'"; the steered step fell back to eager steps). The compiled step marks the cache's head
    dimensions static: no scalar input of the score_mod is used in its arithmetic."""
    import driftlab.chat.static_decode as sd

    used: list[str] = []

    def capture(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "flex_attention" in str(node.target):
                score_mod = getattr(gm, node.args[3].target)
                inputs = [n for n in score_mod.graph.nodes if n.op == "placeholder"][5:]  # after score, b, h, q, kv
                used.extend(str(n.meta.get("example_value")) for n in inputs
                            if isinstance(n.meta.get("example_value"), torch.SymInt) and n.users)
        return gm.forward

    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {"backend": capture, "fullgraph": True, "dynamic": True})
    model = _gqa7_model()
    torch._dynamo.reset()
    _probe_step(sd.StaticDecoder(model, compiled=True), model, 2, 200, steered=True)
    assert not used, used


@pytest.mark.compile
def test_cuda_options_compile_one_graph_per_batch_bucket_with_a_concrete_batch(flex_kernel, monkeypatch) -> None:
    """CUDA's compile options (`static_batch`) on this CPU, dynamo's graphs captured: each batch
    bucket compiles its own graph, in which every flex call's query has a concrete batch (what
    inductor's split-KV decoding kernel needs, `flex_decoding._use_flex_decoding`), steered or
    plain (the lean step's one pass); a longer cache still compiles nothing. (CPU's options, one
    graph for every bucket of 2 rows or more, are test_graph_budget.py's: on the same model and
    flex path, batches 3 and 8 run on batch 2's graphs under fail_on_recompile.)"""
    import driftlab.chat.static_decode as sd

    batches: list[list] = []

    def capture(gm, example_inputs):
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and "flex_attention" in str(n.target)]
        batches.append([n.args[0].meta["example_value"].shape[0] for n in calls])
        return gm.forward

    cuda = {k: v for k, v in sd.COMPILE_OPTIONS["cuda"].items() if k != "mode"}
    model = _gqa7_model()
    # Batches 2 and 4 (dynamo makes a dimension of size 1 concrete whatever the options, so batch 1
    # would check nothing that they do not).
    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {**cuda, "backend": capture})
    decoder = sd.StaticDecoder(model, compiled=True)
    torch._dynamo.reset()
    for batch in (2, 4):
        for steered in (False, True):
            _probe_step(decoder, model, batch, 200 + batch, steered)
    assert decoder.graphs == 4, decoder.ran()
    assert sorted({b for call in batches for b in call}) == [2, 4], batches
    assert all(isinstance(b, int) for call in batches for b in call), batches
    assert sum(len(b) == 2 * model.config.num_hidden_layers for b in batches) == 2, batches  # the steered graphs
    with torch.compiler.set_stance("fail_on_recompile"):
        _probe_step(decoder, model, 4, 600, steered=True)


def test_flex_is_imported_before_the_first_step_is_traced(backends, monkeypatch) -> None:
    """flex.py is imported on first use: imported inside a compiled step's first trace, it left a
    guard on the engine's module global that the import itself then broke, so a process that had
    not run flex before compiled its first graph twice (found running the test above alone)."""
    import driftlab.chat.static_decode as sd
    from driftlab.attention import engine

    monkeypatch.setattr(engine, "_flex", None)
    monkeypatch.setattr(engine, "_flex_missing", None)
    sd.StaticDecoder(backends["compiled"].model, compiled=True).step()  # builds the compiled step; traces nothing
    assert engine._flex is not None or engine._flex_missing is not None


# Extra aten ops per layer of a steered decode step over a plain one (eager static steps), for every
# steer alike: the second attention call, pi from two LSEs, the split-softmax epilogue, pi into the
# trace buffer; on SDPA the bias and the key pattern are masks built per layer, on flex they are in
# the kernel. Measured when the steered step became one graph; fewer is fine, more fails.
OPS_PER_LAYER = {"sdpa": 74, "flex": 52}


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_every_steer_adds_the_same_few_ops_per_layer(backends, kernel: str, request) -> None:
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    if kernel == "flex":
        request.getfixturevalue("flex_kernel")

    class Ops(TorchDispatchMode):
        supports_higher_order_operators = True  # flex_attention counts as one op

        def __init__(self) -> None:
            super().__init__()
            self.count = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count[str(getattr(func, "overloadpacket", func))] += 1
            return func(*args, **(kwargs or {}))

    backend = backends["static"]
    step, last = backend._static_step, []

    def counted(*args, **kwargs):
        with Ops() as ops:
            out = step(*args, **kwargs)
        last[:] = [ops.count]
        return out

    backend._static_step = counted
    try:
        per_mode = {}
        for case, specs in CASES.items():
            _run(backend, specs, sampling=Sampling(greedy=True, max_new_tokens=3, ignore_eos=True))
            per_mode[case] = sum(last[0].values())
    finally:
        del backend._static_step
    extra = {case: (n - per_mode["plain"]) / backend.shape.layers for case, n in per_mode.items() if case != "plain"}
    assert len(set(extra.values())) == 1, extra  # one graph whatever the steer: the same ops
    assert 0 < next(iter(extra.values())) <= OPS_PER_LAYER[kernel], extra
