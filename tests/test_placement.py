"""Models spread by a device map, and quantised loading: what runs where, and clean refusals.

Why: a model larger than one device runs with accelerate's hooks, which move each layer's
weights (from the CPU or from disk) and inputs to where the layer runs, and the attention
engine's per-call state (system keys, head masks, biases, pi records) must meet each layer
on its device. On this CPU-only machine the map offloads layers to "disk" (their weights
sit on the meta device and are loaded per forward); every intervention must give the plain
model's tokens and traces exactly. On a GPU machine the same tests also run with a map
that puts a layer on cuda:0 and the rest on the CPU and disk.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.errors import DriftlabError
from driftlab.steering import Interventions
from tiny_models import make_tiny_model

CONVERSATIONS = [
    [{"role": "system", "content": "You are a pirate. Always answer like a pirate, arr."},
     {"role": "user", "content": "Hello! How do I bake a loaf of bread at home?"}],
    [{"role": "system", "content": "Réponds toujours en français."},
     {"role": "user", "content": "What is the capital of Italy?"}],
]
INTERVENTIONS = {
    "none": [],
    "trace": ["trace"],
    "split": ["trace", "split-softmax:k=0.5,heads=1+2.0"],
    "bias": ["trace", "bias:value=-3.0,invert=true,heads=1.2+2"],
    "instaboost": ["instaboost:m=8"],
    "pasta": ["pasta:heads=0.1+2,alpha=0.05,span=system"],
    "cfg": ["cfg:alpha=1.5"],
    "composed": ["trace", "split-softmax:k=0.8,heads=0-1", "instaboost:m=4", "cfg:alpha=1.5"],
}
OFFLOAD = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
           "model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "cpu"}
MAPS = {"cpu+disk": OFFLOAD}
if torch.cuda.is_available():
    MAPS["cuda+cpu+disk"] = {**OFFLOAD, "model.embed_tokens": 0, "model.layers.0": 0, "lm_head": 0}
SAMPLING = Sampling(greedy=True, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("placement") / "qwen2")


@pytest.fixture(scope="module")
def plain(tiny: Path) -> HFChatBackend:
    return HFChatBackend(str(tiny), dtype="float32", device="cpu", prefix_cache_bytes=0)


@pytest.fixture(scope="module", params=list(MAPS))
def mapped(request: pytest.FixtureRequest, tiny: Path) -> HFChatBackend:
    return HFChatBackend(str(tiny), dtype="float32", device="cpu", prefix_cache_bytes=0,
                         device_map=json.dumps(MAPS[request.param]))


def _run(backend: HFChatBackend, specs: list[str]):
    return backend.generate(ChatRequest(CONVERSATIONS, SAMPLING, interventions=Interventions.parse(specs)))


def test_the_map_really_offloads(mapped: HFChatBackend) -> None:
    devices = {p.device.type for p in mapped.model.model.layers[1].parameters()}
    assert devices == {"meta"}  # weights on disk, loaded by accelerate's hook at each forward
    assert mapped.describe()["device_map"]["model.layers.1"] == "disk"
    assert mapped.device == (torch.device("cuda", 0) if mapped.model.hf_device_map["model.embed_tokens"] == 0
                             else torch.device("cpu"))


@pytest.mark.parametrize("case", list(INTERVENTIONS))
def test_every_intervention_equals_the_plain_model(plain: HFChatBackend, mapped: HFChatBackend, case: str) -> None:
    want, got = _run(plain, INTERVENTIONS[case]), _run(mapped, INTERVENTIONS[case])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for g, w in zip(got, want, strict=True):
        assert (g.trace is None) == (w.trace is None)
        if w.trace:
            assert g.trace["decode"].device.type == "cpu"
            torch.testing.assert_close(g.trace["decode"], w.trace["decode"], atol=1e-5, rtol=1e-4)
    if case not in ("none", "trace"):  # the intervention does something here, so agreement is not a no-op
        base = _run(plain, ["trace"] if "trace" in INTERVENTIONS[case] else [])
        assert [r.token_ids for r in want] != [r.token_ids for r in base] or any(
            (w.trace["decode"] - b.trace["decode"]).abs().max() > 1e-3 for w, b in zip(want, base, strict=True))


def test_loglikelihood_equals_the_plain_model(plain: HFChatBackend, mapped: HFChatBackend) -> None:
    iv = Interventions.parse(["split-softmax:k=0.6", "instaboost:m=4"])
    contexts = [c for c in CONVERSATIONS for _ in range(2)]
    conts = ["Arr", "Hello", "Rome", "Paris"]
    want = plain.loglikelihood(contexts, conts, iv)
    got = mapped.loglikelihood(contexts, conts, iv)
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)


def test_quantize_names_what_is_missing(tiny: Path) -> None:
    have = {"a CUDA GPU": torch.cuda.is_available(),
            "the bitsandbytes package": importlib.util.find_spec("bitsandbytes") is not None}
    if all(have.values()):
        pytest.skip("this machine can quantise")
    for bits in ("8bit", "4bit"):
        with pytest.raises(DriftlabError, match=f"--quantize {bits} needs") as err:
            HFChatBackend(str(tiny), device="cpu", quantize=bits)
        assert all((what in err.value.message) != ok for what, ok in have.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_a_map_naming_a_gpu_is_refused_without_one(tiny: Path) -> None:
    with pytest.raises(DriftlabError, match="places modules on GPU 0, but this torch build sees no CUDA GPU"):
        HFChatBackend(str(tiny), device="cpu", device_map=json.dumps({**OFFLOAD, "model.layers.0": 0}))


def test_strategies_fall_back_to_the_cpu_without_a_gpu(tiny: Path, plain: HFChatBackend) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is there: auto spreads over it")
    auto = HFChatBackend(str(tiny), dtype="float32", device="cpu", prefix_cache_bytes=0, device_map="auto")
    assert auto.device == torch.device("cpu")
    assert [r.token_ids for r in _run(auto, ["split-softmax:k=0.5"])] == \
        [r.token_ids for r in _run(plain, ["split-softmax:k=0.5"])]


def test_prefix_reuse_on_a_mapped_model_equals_a_fresh_prefill(tiny: Path, plain: HFChatBackend) -> None:
    """The KV of a shared dialog prefix, stored from each layer and restored to it, gives the
    same tokens as the plain model computing everything."""
    mapped = HFChatBackend(str(tiny), dtype="float32", device="cpu", device_map=json.dumps(OFFLOAD))
    iv = Interventions.parse(["split-softmax:k=0.7"])
    first = mapped.generate(ChatRequest(CONVERSATIONS, SAMPLING, interventions=iv, cache_store=[True, True]))
    longer = [c + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Go on."}]
              for c, r in zip(CONVERSATIONS, first, strict=True)]
    reused = mapped.generate(ChatRequest(longer, SAMPLING, interventions=iv))
    assert mapped.prefix_cache.hits_tokens > 0
    fresh = plain.generate(ChatRequest(longer, SAMPLING, interventions=iv))
    assert [r.token_ids for r in reused] == [r.token_ids for r in fresh]


def test_the_cli_options_reach_the_loaded_model(tiny: Path) -> None:
    """--device-map and --quantize travel in the BackendSpec, through make_backend, to the load."""
    from driftlab.chat import make_backend
    from driftlab.cli.options import backend_spec

    spec = backend_spec(str(tiny), "float32", "cpu", device_map=json.dumps(OFFLOAD))
    backend = make_backend(spec)
    assert backend.model.hf_device_map["model.layers.2"] == "disk"
    assert spec.model_dump()["device_map"] == json.dumps(OFFLOAD) and spec.quantize is None
