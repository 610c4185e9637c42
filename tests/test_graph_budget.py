"""Every knob is data: a compiled decode compiles one graph per (batch bucket, plain | steered),
whatever the steer, its strength, spans or head sets, and however long the prompts grow.

A scripted mini self-chat on a tiny model whose query-head group (7) is not a power of two (on
CUDA also a tiny Llama, group 2), decoded by the compiled static loop on the FlexAttention path (CUDA's kernel;
dynamo with the aot_eager backend on this CPU): warm-up compiles the plain and one steered graph
per batch bucket (on this CPU the buckets of 2 rows or more share theirs), then under
`torch.compiler.set_stance("fail_on_recompile")` (any compile is an error) new strengths, spans,
head sets, every intervention kind, CFG rows and SPR run at batch 1, 3 and 8, and plain and
composed steers on prompts past the warm-up's cache length, with the same greedy tokens and pi as
the dynamic loop on the SDPA path.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
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

SYSTEMS = ["You are a pirate. Always talk like a pirate.", "Answer in French, in one sentence.",
           "You are a careful science journalist who loves tennis.", "Never say the word blue."]
EXCHANGES = [("Hello, how are you today?", "Arr, fine as a calm sea."),
             ("Tell me about your ship and its crew.", "She be fast, and the crew be loyal."),
             ("Where do you sail next, and why?", "To the islands in the south, for the gold.")]
QUESTION = "What should I do in London? *Answer as a list.*"
GREEDY = Sampling(greedy=True, max_new_tokens=6, ignore_eos=True)
WARM = ["split-softmax:k=0.5", "trace"]
# Steers the warm-up never saw: each must run on the warmed graphs without compiling.
NEW = {
    "strength": ["split-softmax:k=0.2", "trace"],
    "head set": ["split-softmax:k=0.7,heads=0.1+2", "trace"],
    "instaboost": ["instaboost:m=7"],
    "bias on the marked span, inverted": ["bias:value=-1.5,span=marked,invert=true,heads=1"],
    "pasta": ["pasta:heads=0.0+2.1,alpha=0.05"],
    "composed": ["split-softmax:k=0.6", "instaboost:m=3", "pasta:heads=1.1,alpha=0.1", "trace"],
    "cfg": ["cfg:alpha=1.5", "split-softmax:k=0.8"],
    "spr": ["spr:p=1", "instaboost:m=2", "trace"],
}


def _dialogs(n: int, rounds: int) -> list[list[dict]]:
    """n conversations of `rounds` exchanges then the question: prompts grow with `rounds`."""
    out = []
    for i in range(n):
        conv = [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}]
        for user, agent in EXCHANGES[:rounds]:
            conv += [{"role": "user", "content": user}, {"role": "assistant", "content": agent}]
        out.append(conv + [{"role": "user", "content": QUESTION if i % 2 == 0 else QUESTION.lower()}])
    return out


def _long_dialogs(n: int) -> list[list[dict]]:
    """_dialogs(n, 3) with the question asked 12 times: ~268 tokens, past the 256 slots of the
    warm-up's cache (384), so the cache length itself changes."""
    return [conv[:-1] + [{**conv[-1], "content": " ".join([conv[-1]["content"]] * 12)}] for conv in _dialogs(n, 3)]


@contextmanager
def _kernel(name: str):
    from driftlab.attention import engine

    old = os.environ.get(engine.KERNEL_ENV)
    os.environ[engine.KERNEL_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(engine.KERNEL_ENV)
        else:
            os.environ[engine.KERNEL_ENV] = old


@pytest.fixture(autouse=True)
def _cheap_compile_and_strict_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU, dynamo with aot_eager (no code generation: seconds per graph here) and the
    production options otherwise; on a GPU the production compile itself (CUDA graphs). And a call
    the flex path hands back to SDPA is an error."""
    import driftlab.chat.static_decode as sd
    from driftlab.attention import engine

    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {**sd.COMPILE_OPTIONS["cpu"], "backend": "aot_eager"})

    def declined(reason: str) -> None:
        raise AssertionError(f"the flex path fell back to SDPA: {reason}")

    monkeypatch.setattr(engine, "_flex_declined", declined)


@pytest.fixture(scope="module", params=["llama", "qwen2-gqa7"])
def pair(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[HFChatBackend, HFChatBackend]:
    """(the compiled static loop, the dynamic loop) of one tiny model. On a CPU only the group of 7:
    the budget rests on the layout's tensors, whatever the head group, and the group of 2 decodes
    on the compiled flex path in test_static_decode.py; on CUDA, where each group is its own
    kernel, both."""
    if request.param == "llama" and backend_device() == "cpu":
        pytest.skip("the group of 2 runs on CUDA here; on a CPU the group of 7 covers the budget")
    path = make_tiny_model(request.param, tmp_path_factory.mktemp("budget") / request.param)

    def make(decode: str) -> HFChatBackend:
        return HFChatBackend(str(path), dtype="float32", device=backend_device(), prefix_cache_bytes=0, decode=decode)

    return make("compiled"), make("dynamic")


def _generate(backend: HFChatBackend, convs, specs: list[str], kernel: str):
    with _kernel(kernel):
        return backend.generate(ChatRequest(convs, GREEDY, interventions=Interventions.parse(specs), logprobs=4))


def _logprobs(replies) -> np.ndarray:
    """[rows, steps, 5]: each generated token's log-probability and its 4 best alternatives'."""
    return np.array([[[t.logprob, *(lp for _, lp in t.top)] for t in r.logprobs] for r in replies])


def _assert_same(ref, got, what: str) -> None:
    """The same greedy tokens, log-probabilities (the step's whole output, numerically) and pi."""
    assert [r.token_ids for r in got] == [r.token_ids for r in ref], what
    np.testing.assert_allclose(_logprobs(got), _logprobs(ref), atol=tol(1e-4), rtol=0, err_msg=what)
    for a, b in zip(ref, got, strict=True):
        assert (a.trace is None) == (b.trace is None), what
        if a.trace is not None:
            np.testing.assert_allclose(b.trace.decode, a.trace.decode, atol=tol(1e-5), rtol=0, err_msg=what)


@pytest.mark.slow
@pytest.mark.compile
def test_every_steer_runs_on_the_warmed_graphs(pair) -> None:
    import driftlab.chat.static_decode as sd

    compiled, dynamic = pair
    # Warm-up: a plain and a steered call per batch bucket (CFG's twins make batch 1 a batch of 2).
    # With a concrete batch (CUDA's static_batch) each bucket has its own graph; without it (this
    # CPU) the buckets of 2 rows or more share one, so warming 1 and 2 leaves batch 3 and 8 to
    # show that sharing under fail_on_recompile.
    options = sd.COMPILE_OPTIONS.get(backend_device().split(":")[0], sd.COMPILE_OPTIONS["cpu"])
    static_batch = options.get("static_batch")
    for n in (1, 2, 3, 8) if static_batch else (1, 2):
        for specs in ([], WARM):
            _generate(compiled, _dialogs(n, 1), specs, "flex")
    warm = compiled.ran()["decode"]
    assert warm["loop"] == "compiled" and "over_budget" not in warm, warm
    assert {(k["batch"], k["steered"]) for k in warm["graph_keys"]} <= {(b, s) for b in (1, 2, 4, 8)
                                                                          for s in (False, True)}
    checked = 0
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (1, 3, 8):
            convs = _dialogs(n, 1)
            plain = _check(compiled, dynamic, convs, f"plain at batch {n}")
            for name, specs in NEW.items():
                if name == "cfg" and n == 8:
                    continue  # 16 rows: a batch bucket the warm-up did not compile
                _check(compiled, dynamic, convs, f"{name} at batch {n}", specs, plain)
                checked += 1
            # a longer prompt, past the warm-up's cache length (256 slots, 384 now): the same graphs,
            # plain and steered (every steer runs on the one steered graph, whose inputs are the
            # layout's tensors: what a longer prompt changes for one steer it changes for all)
            convs = _long_dialogs(n)
            plain = _check(compiled, dynamic, convs, f"plain at batch {n}, longer prompt")
            _check(compiled, dynamic, convs, f"composed at batch {n}, longer prompt", NEW["composed"], plain)
            checked += 1
    ran = compiled.ran()["decode"]
    assert ran["graphs"] == warm["graphs"] and ran["graph_keys"] == warm["graph_keys"], (warm, ran)
    assert checked == 3 * len(NEW) - 1 + 3
    assert {length for _, length in compiled._static.shapes} == {256, 384}  # both cache lengths decoded


def _check(compiled: HFChatBackend, dynamic: HFChatBackend, convs, what: str, specs: tuple | list = (),
           plain: np.ndarray | None = None) -> np.ndarray:
    """The compiled loop on the flex path gives the dynamic loop's replies on SDPA; a steer (given
    `plain`, the unsteered log-probabilities) must change them, so the comparison can fail.
    Returns the reference's log-probabilities."""
    ref = _generate(dynamic, convs, list(specs), "sdpa")
    if plain is not None:
        assert np.abs(_logprobs(ref) - plain).max() > 1e-3, what  # the steer acts: the test can fail
    # plain: the lean plain step, one flex pass over the filled key blocks
    _assert_same(ref, _generate(compiled, convs, list(specs), "flex"), what)
    return _logprobs(ref)


@pytest.mark.slow
@pytest.mark.compile
def test_a_graph_past_the_budget_is_said_once_naming_the_guard(tmp_path: Path, monkeypatch, capsys) -> None:
    """With the cache length static (dynamic=False: what the budget rests on, taken away), a
    longer prompt compiles a second graph of one key: said once, with the guard that failed, and
    recorded; the tokens stay those of the dynamic loop."""
    import driftlab.chat.static_decode as sd

    device_type = backend_device().split(":")[0]
    monkeypatch.setitem(sd.COMPILE_OPTIONS, device_type, {"backend": "aot_eager", "fullgraph": True, "dynamic": False})
    path = make_tiny_model("llama", tmp_path / "llama")
    compiled = HFChatBackend(str(path), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                             decode="compiled")
    dynamic = HFChatBackend(str(path), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                            decode="dynamic")
    capsys.readouterr()
    long = [[*_dialogs(1, 3)[0][:-1]] + [{"role": "user", "content": " ".join([QUESTION] * 12)}]]
    for convs in (_dialogs(2, 1), long * 2, _dialogs(2, 1), long * 2):
        _assert_same(_generate(dynamic, convs, WARM, "sdpa"), _generate(compiled, convs, WARM, "flex"), "over budget")
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("past the budget") == 1 and "size mismatch" in err, err
    ran = compiled.ran()["decode"]
    assert ran["graphs"] == 2 and ran["graph_keys"] == [{"batch": 2, "steered": True, "bias_slots": 4,
                                                         "attention": "driftlab", "residual": False, "graphs": 2}]
    assert len(ran["over_budget"]) == 1 and "batch 2 steered" in ran["over_budget"][0], ran


def test_the_guard_named_is_the_shape_that_changed_not_another_graphs() -> None:
    from driftlab.chat.static_decode import failed_guard

    reasons = ["0/0: len(kwargs) == 6                                         # output = func(self, *args, **kwargs)\n"
               "- 0/1: ___check_obj_id(L['self'], 1400)\n"
               "- 0/2: tensor 'kwargs['past_key_values'].layers[0].keys' size mismatch at index 2. expected 256, "
               "actual 384"]
    assert failed_guard(reasons) == ("tensor 'kwargs['past_key_values'].layers[0].keys' size mismatch at index 2. "
                                     "expected 256, actual 384")
    assert failed_guard(["0/0: kwargs['driftlab'].prefilling == False  # x"]) == "kwargs['driftlab'].prefilling == False"
    assert failed_guard([]) == "a guard dynamo did not report"


def test_warming_a_model_that_does_not_compile_is_a_one_line_error(tmp_path: Path) -> None:
    import driftlab as dl
    from driftlab.errors import DriftlabError

    path = make_tiny_model("llama", tmp_path / "llama")
    backend = HFChatBackend(str(path), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                            decode="dynamic")
    with pytest.raises(DriftlabError, match="does not decode with the compiled loop") as err:
        backend.warm()
    assert "decode='compiled'" in err.value.hint
    with pytest.raises(DriftlabError, match="decode='dynamic' has none to compile"):
        dl.warm(str(path), decode="dynamic")
    with pytest.raises(DriftlabError, match="is not a local model"):
        dl.warm("openai:some-model", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(DriftlabError, match="whole numbers of at least 1"):
        dl.warm("no/such-model", batches=[2, 0])  # the sizes are checked before a model is looked up
    compiled = HFChatBackend(str(path), dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                             decode="compiled")
    with pytest.raises(DriftlabError, match="whole numbers of at least 1"):
        compiled.warm([0, 2])
