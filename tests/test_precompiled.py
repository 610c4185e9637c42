"""Precompiled decode steps (driftlab.chat.precompiled): an aot-compiled step stored with checks
for every guard saving drops, so a later process loads it only where its trace holds.

The toy module's test compiles with inductor (a few seconds); the real model's flow (`driftlab
models warm`, then a new process that loads what it saved) is test_benchmarks_gpu.py's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import PretrainedConfig

from driftlab.chat import precompiled
from driftlab.chat.precompiled import (
    Artifacts,
    check_of,
    checkable,
    checks_hold,
    classify,
    fingerprint,
    resolve,
)
from driftlab.errors import DriftlabError


@dataclasses.dataclass
class Knobs:
    """A stand-in for driftlab's attention state: a Python flag the trace reads, and a tensor."""

    double: bool
    shift: torch.Tensor


class Toy(torch.nn.Module):
    """A module with what the store reads of a model (config, device, dtype) and a forward whose
    trace depends on a Python value of its arguments (`knobs.double`), as a steered step's does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.config = PretrainedConfig()

    @property
    def device(self) -> torch.device:
        return self.lin.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lin.weight.dtype

    def forward(self, x: torch.Tensor, knobs: Knobs) -> torch.Tensor:
        y = self.lin(x)
        if knobs.double:
            y = y * 2
        return y + knobs.shift


def test_fingerprints_resolve_and_checks() -> None:
    state = SimpleNamespace(lean=False, layers=[SimpleNamespace(n=3)], table={"a": 1}, t=torch.ones(2))
    kwargs = {"driftlab": state, "use_cache": True}
    assert resolve("kwargs['driftlab'].layers[0].n", kwargs) == 3
    assert resolve("kwargs['driftlab'].table['a']", kwargs) == 1
    assert fingerprint(False) != fingerprint(0) and fingerprint(1) != fingerprint(2)
    assert fingerprint(torch.ones(3)) == fingerprint(torch.zeros(5))  # tensors: the artifact's own guards
    assert fingerprint([1, None]) == "list[int:1,NoneType:None]"
    assert check_of("TYPE_MATCH", "kwargs['x']").startswith("type ") and check_of("SEQUENCE_LENGTH", "k").startswith("len ")
    checks = {check_of("CONSTANT_MATCH", "kwargs['driftlab'].lean"): "bool:False",
              check_of("TYPE_MATCH", "kwargs['driftlab'].layers[0].n"): "builtins.int",
              check_of("SEQUENCE_LENGTH", "kwargs['driftlab'].layers"): "len:1"}
    assert checks_hold(checks, kwargs)
    state.layers[0].n = 7  # a value whose type alone was guarded: still holds
    assert checks_hold(checks, kwargs)
    state.lean = True
    assert not checks_hold(checks, kwargs)
    assert checkable("value kwargs['driftlab'].missing", kwargs) is None
    assert checkable("value len(kwargs['driftlab'])", kwargs) is None  # a source it cannot read: no check


def test_guards_are_kept_checked_covered_or_refused() -> None:
    """Each dropped guard is a check, covered by the store's key, or keeps the graph out (teeth:
    an unreadable source on an argument is `uncovered`, not silently dropped)."""
    def entry(kind: str, name: str, is_global: bool = False) -> SimpleNamespace:
        return SimpleNamespace(guard_type=kind, name=name, is_global=is_global)

    kwargs = {"driftlab": SimpleNamespace(lean=False)}
    entries = [entry("TENSOR_MATCH", "kwargs['input_ids']"), entry("SHAPE_ENV", ""),
               entry("CONSTANT_MATCH", "kwargs['driftlab'].lean"), entry("TYPE_MATCH", "model.config"),
               entry("CONSTANT_MATCH", "list(dict.keys(G['__import_transformers'].REG))[0]"),
               entry("TENSOR_MATCH", "G['weights']", is_global=True),
               entry("EQUALS_MATCH", "getattr(kwargs['driftlab'], 'x')")]
    keep, checks, uncovered = classify(entries, kwargs)
    assert keep == [True, True, False, False, False, False, False]
    assert checks == {"value kwargs['driftlab'].lean": "bool:False"}
    assert uncovered == ["EQUALS_MATCH on getattr(kwargs['driftlab'], 'x')"]


def test_the_key_holds_the_config_but_not_where_a_model_was_saved() -> None:
    """A model saved and loaded again is the same model to the store (its config gains a path, class
    names and a version, which no trace reads); any other config value makes another key."""
    saved = SimpleNamespace(config=PretrainedConfig(_name_or_path="/tmp/x", architectures=["LlamaForCausalLM"]))
    fresh = SimpleNamespace(config=PretrainedConfig())
    assert precompiled._config(saved) == precompiled._config(fresh)
    assert precompiled._config(SimpleNamespace(config=PretrainedConfig(tie_word_embeddings=False))) != precompiled._config(fresh)


def test_a_bad_precompiled_setting_is_one_line(monkeypatch) -> None:
    monkeypatch.setenv(precompiled.ENV, "yes please")
    with pytest.raises(DriftlabError, match="DRIFTLAB_PRECOMPILED='yes please' is not 1 or 0"):
        precompiled.wanted(torch.device("cpu"), {})
    monkeypatch.setenv(precompiled.ENV, "1")
    assert precompiled.wanted(torch.device("cuda"), {}) and not precompiled.wanted(torch.device("cpu"), {"backend": "aot_eager"})
    monkeypatch.delenv(precompiled.ENV)
    assert precompiled.wanted(torch.device("cpu"), {}) and not precompiled.wanted(torch.device("cuda"), {})


@pytest.mark.compile
def test_a_stored_step_runs_only_where_its_trace_holds(tmp_path) -> None:
    """A step traced with the flag on is stored with that flag as a check: the flag off compiles a
    second artifact instead of running the first (whose guard on the flag saving dropped), and a
    new store over the same directory (a new process's) loads both and compiles nothing. Teeth:
    without the checks the second call would run the first artifact and double its output."""
    model = Toy()
    options = {"fullgraph": True, "dynamic": True}

    def fallback(*args, **kwargs):
        raise AssertionError("the store fell back to torch.compile")

    store = Artifacts(model, options, fallback, tmp_path)
    shift = torch.randn(8)
    for double in (True, False):
        x = torch.randn(3, 8)
        torch.testing.assert_close(store(x=x, knobs=Knobs(double, shift)), model(x, Knobs(double, shift)))
    assert (store.saved, store.loaded, store.refused) == (2, 0, None)
    assert len(list(tmp_path.glob("*.aot"))) == 2

    later = Artifacts(Toy(), options, fallback, tmp_path)
    for double in (False, True):
        x = torch.randn(3, 8)
        torch.testing.assert_close(later(x=x, knobs=Knobs(double, shift)), model(x, Knobs(double, shift)))
    assert (later.saved, later.loaded, later.refused) == (0, 2, None)
