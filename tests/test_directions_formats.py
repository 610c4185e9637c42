"""Directions from other tools' files (`activation.formats`, `driftlab directions --from-file`,
`driftlab export-directions`): each format read into driftlab's layers and written back; the
Assistant Axis's capping config capping as its own steerer does, and a persona vector adding as
its own steerer does, on SmolLM2 against plain forward hooks written from the upstream code;
bad files refused in one line before a model loads.

The upstream conventions (safety-research/assistant-axis, safety-research/persona_vectors,
steering-vectors 0.12) are quoted where the references below use them.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import driftlab as dl
from driftlab.activation import formats
from driftlab.activation.directions import Directions, PersonaDirection
from driftlab.bench import get_persona
from driftlab.chat import ChatRequest
from driftlab.chat.base import Sampling
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

L, D = 4, 8
GREEDY = Sampling(greedy=True, max_new_tokens=6)
KEY = "layer_{}/contrast_role_pos3_default1".format  # the Assistant Axis's key of a capping vector


def _axis_files(tmp_path, axis: torch.Tensor, experiments: dict[str, dict[int, float]]) -> tuple:
    """assistant_axis.pt (a bare tensor, as the pipeline writes it) and capping_config.pt (vectors
    pointing towards role-play, i.e. minus the axis, with per-experiment caps), as published."""
    torch.save(axis, tmp_path / "assistant_axis.pt")
    config = {"vectors": {KEY(layer): {"vector": (-axis[layer]).clone(), "layer": layer} for layer in range(len(axis))},
              "experiments": [{"id": name, "interventions": [{"vector": KEY(layer), "cap": cap}
                                                             for layer, cap in caps.items()]}
                              for name, caps in experiments.items()]}
    torch.save(config, tmp_path / "capping_config.pt")
    return tmp_path / "assistant_axis.pt", tmp_path / "capping_config.pt"


def _direction(gen: torch.Generator) -> PersonaDirection:
    unit = torch.nn.functional.normalize(torch.randn(L, D, generator=gen), dim=-1)
    return PersonaDirection(id="axis", system_prompt=None, unit=unit, norm=torch.rand(L, generator=gen) + 1,
                            with_proj=torch.randn(9, L, generator=gen) + 2, without_proj=torch.randn(9, L, generator=gen),
                            auroc=torch.ones(3, L), band=(1, 2))


# -- reading and writing, no model ------------------------------------------------------------------
def test_each_format_reads_into_driftlabs_layers_and_round_trips(tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(L, D, generator=gen)
    torch.save({"axis": raw.to(torch.bfloat16), "metadata": {"model": "tiny"}}, tmp_path / "saved.pt")  # save_axis()
    got = formats.read(tmp_path / "saved.pt", "assistant-axis")
    torch.testing.assert_close(got.vectors, raw.to(torch.bfloat16).float(), rtol=0, atol=0)
    # persona vectors: row 0 the embeddings', row l + 1 decoder layer l
    torch.save(torch.cat([torch.full((1, D), 9.0), raw]), tmp_path / "evil_response_avg_diff.pt")
    got = formats.read(tmp_path / "evil_response_avg_diff.pt", "persona-vectors")
    torch.testing.assert_close(got.vectors, raw, rtol=0, atol=0)
    assert got.layers == tuple(range(L))
    # steering-vectors: any subset of layers, as a dict or its layer_activations alone
    torch.save({"layer_activations": {1: raw[1], 3: raw[3]}, "layer_type": "decoder_block"}, tmp_path / "sv.pt")
    torch.save({1: raw[1], 3: raw[3]}, tmp_path / "bare.pt")
    for name in ("sv.pt", "bare.pt"):
        got = formats.read(tmp_path / name, "steering-vectors").fit("tiny", 6, D)
        assert got.layers == (1, 3) and got.vectors.shape == (6, D)
        torch.testing.assert_close(got.vectors[[1, 3]], raw[[1, 3]], rtol=0, atol=0)
        assert not got.vectors[[0, 2, 4, 5]].any()

    # driftlab's own direction, out and back in, in every format
    found = Directions({"model": "tiny", "n_layers": L, "d_model": D}, [_direction(gen)])
    p = found.axis
    for fmt in formats.FORMATS:
        (path,) = found.export(fmt, tmp_path / fmt / "out.pt")
        back = formats.read(path, fmt).fit("tiny", L, D)
        unit, norm = back.unit_norm()
        torch.testing.assert_close(unit, p.unit, atol=1e-6, rtol=0)
        torch.testing.assert_close(norm, p.norm, atol=1e-6, rtol=1e-6)


def test_a_capping_config_is_a_floor_along_the_axis_and_exports_back(tmp_path) -> None:
    """The published vectors point towards role-play with negative caps; along the axis, cap c is
    driftlab's floor tau = -c. Written back with --cap-q, it reads again as the same floors."""
    axis = torch.randn(L, D, generator=torch.Generator().manual_seed(1))
    axis_path, config = _axis_files(tmp_path, axis, {"layers_1:3-p0.25": {1: -1.5, 2: -2.5}, "layers_0:1-p0.5": {0: 0.5}})
    got = formats.read(axis_path, "assistant-axis", capping=config, experiment="layers_1:3-p0.25")
    assert got.cap_layers == (1, 2) and got.caps[[1, 2]].tolist() == [1.5, 2.5] and got.caps[[0, 3]].isnan().all()
    assert got.source["experiment"] == "layers_1:3-p0.25"

    found = Directions({"model": "tiny", "n_layers": L, "d_model": D}, [_direction(torch.Generator().manual_seed(2))])
    written = found.export("assistant-axis", tmp_path / "out" / "assistant_axis.pt", cap_q=0.25)
    assert [w.name for w in written] == ["assistant_axis.pt", "capping_config.pt"]
    back = formats.read(written[0], "assistant-axis", capping=written[1])
    assert back.source["experiment"] == "layers_1:3-p0.25" and back.cap_layers == (1, 2)
    torch.testing.assert_close(back.caps[[1, 2]], found.axis.quantile(0.25)[[1, 2]])


@pytest.mark.parametrize(("write", "fmt", "kwargs", "says"), [
    (lambda p: None, "assistant-axis", {}, "No file at"),
    (lambda p: torch.save(torch.randn(3), p), "assistant-axis", {}, "holds a tensor of shape [3]"),
    (lambda p: torch.save(torch.full((L, D), float("nan")), p), "assistant-axis", {}, "NaN"),
    (lambda p: torch.save(torch.randn(L, D), p), "persona-vectors", {"capping": "x.pt"}, "comes with an Assistant Axis"),
    (lambda p: torch.save({"layer_activations": {0: torch.randn(D)}, "layer_type": "mlp"}, p), "steering-vectors", {},
     "steers mlp outputs"),
    (lambda p: torch.save({"a": torch.randn(D)}, p), "steering-vectors", {}, "keyed by layer number"),
    (lambda p: p.write_text("not a torch file"), "persona-vectors", {}, "cannot be read as tensors"),
])
def test_a_bad_file_is_one_line(tmp_path, write, fmt, kwargs, says) -> None:
    path = tmp_path / "file.pt"
    write(path)
    with pytest.raises(DriftlabError, match=re.escape(says)) as err:
        formats.read(path, fmt, **kwargs)
    assert "\n" not in err.value.message


def test_a_capping_config_that_does_not_match_its_axis_is_one_line(tmp_path) -> None:
    axis = torch.randn(L, D, generator=torch.Generator().manual_seed(3))
    axis_path, config = _axis_files(tmp_path, axis, {"a": {1: -1.0}, "b": {2: -1.0}})
    with pytest.raises(DriftlabError, match="holds 2 capping experiments; name one"):
        formats.read(axis_path, "assistant-axis", capping=config)
    with pytest.raises(DriftlabError, match="No capping experiment 'c'"):
        formats.read(axis_path, "assistant-axis", capping=config, experiment="c")
    torch.save(torch.randn(L, D), axis_path)  # another axis: the config's vectors no longer lie along it
    with pytest.raises(DriftlabError, match="is not minus the axis there"):
        formats.read(axis_path, "assistant-axis", capping=config, experiment="a")
    with pytest.raises(DriftlabError, match=r"holds 4 layers x 8, and tiny has 6 layers x 8"):
        formats.read(axis_path, "assistant-axis").fit("tiny", 6, D)
    torch.save(torch.randn(L + 1, D), tmp_path / "pv.pt")
    with pytest.raises(DriftlabError, match=r"holds 5 rows \(4 layers after the embeddings'\) x 8, and tiny has 3"):
        formats.read(tmp_path / "pv.pt", "persona-vectors").fit("tiny", 3, D)


def test_cap_file_without_imported_thresholds_is_one_line() -> None:
    p = _direction(torch.Generator().manual_seed(4))
    with pytest.raises(DriftlabError, match="cap:q=file takes the thresholds imported with axis's direction, "
                                            "and it has none"):
        p.row(Interventions.parse(["cap:q=file"]).residual())


def test_an_import_that_cannot_work_stops_before_a_model_loads(tmp_path) -> None:
    """One-line errors before any run directory exists (the model named does not even exist)."""
    torch.save(torch.randn(L, D), tmp_path / "pv.pt")
    pv = {"from_file": str(tmp_path / "pv.pt"), "format": "persona-vectors"}
    cases = [({**pv, "personas": ["reply-in-french", "all-caps"]}, "give exactly one persona or system prompt"),
             ({"from_file": str(tmp_path / "missing.pt"), "format": "assistant-axis", "system": ["A.", "B."]},
              "No file at"),
             ({"from_file": str(tmp_path / "pv.pt"), "system": "A."}, "needs both its file"),
             ({**pv, "system": "A.", "capping": "c.pt"}, "comes with an Assistant Axis file"),
             ({"from_file": str(tmp_path / "pv.pt"), "format": "assistant-axis", "system": "A."},
              "judged on the default assistant against roles: give at least 2"),
             ({"format": "steering-vectors", "system": "A.", "experiment": "x"}, "needs both its file")]
    for options, says in cases:
        with pytest.raises(DriftlabError, match=re.escape(says)) as err:
            dl.directions("no-such-model", out=tmp_path / "never", progress=False, **options)
        assert "\n" not in err.value.message
        assert not (tmp_path / "never").exists()


# -- on SmolLM2: the imported directions steer as their own tools do -----------------------------------
def _greedy_with_hooks(backend, conv, hooks: dict[int, callable]) -> tuple[list[int], list[float]]:
    """transformers' own greedy generate with forward hooks on decoder layers (the upstream way)."""
    model, handles = backend.model, []
    for layer, fn in hooks.items():
        handles.append(model.model.layers[layer].register_forward_hook(lambda m, a, out, fn=fn: fn(out)))
    try:
        ids = torch.tensor([backend.render(conv).ids])
        ref = model.generate(ids, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=backend.pad_id)
    finally:
        for h in handles:
            h.remove()
    tokens = ref.sequences[0, ids.shape[1]:].tolist()
    return tokens, [float(torch.log_softmax(ref.logits[i][0].float(), -1)[t]) for i, t in enumerate(tokens)]


def _check_against(backend, conv, spec: str, hooks: dict) -> None:
    (steered,) = backend.generate(ChatRequest([conv], GREEDY, interventions=Interventions.parse([spec]), logprobs=1))
    (plain,) = backend.generate(ChatRequest([conv], GREEDY, logprobs=1))
    # The steer acts, so the comparison below can fail.
    assert max(abs(a.logprob - b.logprob) for a, b in zip(steered.logprobs, plain.logprobs, strict=False)) > 0.05
    tokens, logprobs = _greedy_with_hooks(backend, conv, hooks)
    n = len(steered.token_ids)
    assert tokens[:n] == steered.token_ids
    np.testing.assert_allclose([t.logprob for t in steered.logprobs], logprobs[:n], atol=2e-4)


def test_the_assistant_axis_caps_as_its_own_steerer(smol32, tmp_path) -> None:
    """SmolLM2-135M, float32. An Assistant Axis (bf16, as published) with a capping experiment on
    layers 10-13, imported and calibrated on two roles' replies: `cap:q=file` on a conversation
    without a system prompt (the axis's row) gives the tokens and log-probs of upstream's
    `_apply_cap` (`v = vector / (norm + 1e-8); h -= relu(<h, v> - cap) v`) hooked on those layers.
    The persona vector's import is the tiny model's test below."""
    n_layers, d = smol32.shape.layers, smol32.d_model
    gen = torch.Generator().manual_seed(0)
    axis = (torch.randn(n_layers, d, generator=gen) * 0.5).to(torch.bfloat16)
    capped = {layer: -3.0 for layer in range(10, 14)}  # a floor of 3 along the axis: it bites
    axis_path, config = _axis_files(tmp_path, axis, {"layers_10:14-p0.25": capped, "layers_0:2-p0.5": {0: -1.0}})
    run = dl.directions(smol32, personas=["reply-in-french", "all-caps"], starters=2, max_new_tokens=6,
                        from_file=str(axis_path), format="assistant-axis", capping=str(config),
                        experiment="layers_10:14-p0.25", out=tmp_path / "axis", progress=False)
    imported = run.summary.axis
    assert imported.band == (10, 11, 12, 13) and imported.info["imported"]["experiment"] == "layers_10:14-p0.25"
    assert imported.info["control_auroc"] is None and imported.with_proj.shape == (4, n_layers)

    def cap(layer: int):
        v = -axis[layer].float()  # the config's vector: towards role-play
        v = v / (v.norm() + 1e-8)
        return lambda h: h - torch.einsum("bl,d->bld", (torch.einsum("bld,d->bl", h, v) - capped[layer]).clamp(min=0), v)

    conv = [{"role": "user", "content": "What do you do in London as a tourist?"}]
    smol32.use_directions(Directions.load(tmp_path / "axis"))
    try:
        _check_against(smol32, conv, "cap:q=file", {layer: cap(layer) for layer in capped})
    finally:
        smol32.use_directions(None)


@pytest.mark.model
def test_a_persona_vector_adds_as_its_own_steerer_on_a_tiny_model(tmp_path) -> None:
    """A persona vector (float32, [L + 1, d]) imported for reply-in-french into a tiny random Llama (3 layers):
    `vector:alpha=2,layers=1` gives the tokens and log-probs of upstream's `ActivationSteerer(layer_idx=layer - 1)`
    adding 2 * v[2] at block 1. (Split from the Assistant Axis's SmolLM2 test: the import is bookkeeping.)"""
    from driftlab.chat.hf import HFChatBackend
    from tiny_models import make_tiny_model

    tiny = HFChatBackend(str(make_tiny_model("llama", tmp_path / "llama")), dtype="float32", device="cpu",
                         prefix_cache_bytes=0)
    vectors = torch.randn(tiny.shape.layers + 1, tiny.d_model, generator=torch.Generator().manual_seed(0))
    torch.save(vectors, tmp_path / "french_response_avg_diff.pt")
    dl.directions(tiny, personas=["reply-in-french"], starters=2, max_new_tokens=6, out=tmp_path / "pv",
                  from_file=str(tmp_path / "french_response_avg_diff.pt"), format="persona-vectors", progress=False)
    french = get_persona("reply-in-french").system_prompt
    tiny.use_directions(Directions.load(tmp_path / "pv"))
    conv = [{"role": "system", "content": french}, {"role": "user", "content": "What do you do in London as a tourist?"}]
    _check_against(tiny, conv, "vector:alpha=2,layers=1", {1: lambda h: h + 2.0 * vectors[2]})
