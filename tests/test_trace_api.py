"""The typed pi trace (`driftlab.chat.trace.Trace`) and tracing a conversation without generating.

Model-free tests check the object itself (validation, immutability, views, JSON); the model
tests check `HFChatBackend.trace` against the prefill of a traced 1-token generate and against
an independent eager reference: transformers' own eager attention with `output_attentions=True`,
its weights summed over the system-prompt key columns.
"""

from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest

from devices import tol
from driftlab.chat import Sampling, Trace, chat
from driftlab.chat.trace import trace
from driftlab.errors import DriftlabError

matplotlib.use("Agg")

CONV = [{"role": "system", "content": "Always reply in French, whatever the user writes."},
        {"role": "user", "content": "What do you do in London as a tourist?"}]


def _toy(prefill: bool = True, tokens: bool = True) -> Trace:
    rng = np.random.default_rng(0)
    return Trace(decode=rng.random((3, 2, 4)), prefill=rng.random((5, 2, 4)) if prefill else None, prompt_length=5,
                 system_spans=[(1, 3)], prompt_tokens=list("abcde") if tokens else None,
                 generated_tokens=["x", "y", "z"] if tokens else None)


# -- the object (no model) ----------------------------------------------------------------------------
def test_trace_is_immutable_and_checks_its_shapes():
    t = _toy()
    assert t.decode.dtype == np.float32 and t.prefill.shape == (5, 2, 4) and (t.n_layers, t.n_heads) == (2, 4)
    with pytest.raises(ValueError):  # read-only arrays
        t.decode[0, 0, 0] = 1.0
    with pytest.raises(AttributeError):  # frozen
        t.prompt_length = 3
    with pytest.raises(DriftlabError, match="prefill rows"):
        Trace(decode=np.zeros((1, 2, 4)), prefill=np.zeros((4, 2, 4)), prompt_length=5)
    with pytest.raises(DriftlabError, match="layers, heads"):
        Trace(decode=np.zeros((1, 2, 4)), prefill=np.zeros((5, 3, 4)), prompt_length=5)
    with pytest.raises(DriftlabError, match="system span"):
        Trace(decode=np.zeros((1, 2, 4)), prompt_length=5, system_spans=[(4, 9)])
    with pytest.raises(DriftlabError, match="generated_tokens"):
        Trace(decode=np.zeros((2, 2, 4)), prompt_length=5, generated_tokens=["a"])
    assert "prompt_length=5" in repr(t) and len(repr(t)) < 200


def test_mean_views_and_the_earlier_dict_form():
    t = _toy()
    np.testing.assert_allclose(t.mean(), t.decode.mean(axis=(1, 2)), rtol=1e-6)
    assert t.mean("head").shape == (3, 2) and t.mean("token", phase="prefill").shape == (2, 4)
    assert t.mean(()).shape == (3, 2, 4)
    with pytest.raises(DriftlabError, match="unknown axis 'layers'"):
        t.mean(("layers",))
    with pytest.raises(DriftlabError, match="no prefill"):
        _toy(prefill=False).mean(phase="prefill")
    # `reply.trace["decode"]` as before the type: a torch tensor (benchmarks and scripts use it)
    import torch

    assert isinstance(t["decode"], torch.Tensor) and t["prefill"].shape == (5, 2, 4)
    with pytest.raises(KeyError):
        _toy(prefill=False)["prefill"]


def test_to_pandas_is_long_format():
    t = _toy()
    df = t.to_pandas()
    assert list(df.columns) == ["phase", "position", "token", "layer", "head", "pi"]
    assert len(df) == (5 + 3) * 2 * 4
    pre = df[df.phase == "prefill"]
    row = pre[(pre.position == 2) & (pre.layer == 1) & (pre["head"] == 3)]  # (pre.head is DataFrame.head)
    assert row.token.item() == "c" and row.pi.item() == pytest.approx(float(t.prefill[2, 1, 3]))
    dec = df[df.phase == "decode"]
    assert sorted(set(dec.position)) == [5, 6, 7] and dec[dec.position == 6].token.unique().tolist() == ["y"]
    no_tokens = _toy(prefill=False, tokens=False).to_pandas()
    assert len(no_tokens) == 3 * 2 * 4 and no_tokens.token.isna().all()


def test_json_round_trip():
    for t in (_toy(), _toy(prefill=False, tokens=False)):
        back = Trace.from_dict(json.loads(json.dumps(t.to_dict())))
        assert back == t and back is not t
    empty = Trace(decode=np.zeros((0, 2, 4)), prefill=np.ones((5, 2, 4)), prompt_length=5)
    assert Trace.from_dict(json.loads(json.dumps(empty.to_dict()))).decode.shape == (0, 2, 4)
    with pytest.raises(DriftlabError, match="Not a driftlab trace"):
        Trace.from_dict({"decode": []})
    with pytest.raises(DriftlabError, match="version 9"):
        Trace.from_dict({**_toy().to_dict(), "version": 9})
    with pytest.raises(DriftlabError, match="malformed"):
        Trace.from_dict({**_toy().to_dict(), "n_heads": 3})


def test_plot_draws_one_line_per_layer():
    from matplotlib.axes import Axes

    t = _toy()
    ax = t.plot()
    assert isinstance(ax, Axes) and len(ax.lines) == 1
    assert len(t.plot(layers=[0, 1]).lines) == 2
    prompt = Trace(decode=np.zeros((0, 2, 4)), prefill=t.prefill, prompt_length=5, system_spans=[(1, 3)])
    assert prompt.plot().get_xlabel() == "prompt token"  # nothing generated: the prompt is drawn
    with pytest.raises(DriftlabError, match="layers are 0..1"):
        t.plot(layers=[2])


def test_trace_refuses_a_backend_without_a_local_model():
    from fakes import ScriptedBackend

    with pytest.raises(DriftlabError, match="not a local model"):
        trace(ScriptedBackend(), CONV)


# -- on SmolLM2-135M (float32) -------------------------------------------------------------------------
@pytest.mark.model
def test_backend_trace_equals_the_prefill_of_a_traced_generate(smol32):
    got = smol32.trace(CONV)
    rendered = smol32.render(CONV)
    T = len(rendered.ids)
    assert got.prefill.shape == (T, smol32.shape.layers, smol32.shape.heads) and got.decode.shape[0] == 0
    assert got.system_spans == (rendered.system_span,) and len(got.prompt_tokens) == T
    assert "".join(got.prompt_tokens) == smol32.decode(rendered.ids, skip_special=False)
    assert ((got.prefill >= 0) & (got.prefill <= 1 + 1e-6)).all()
    s, e = rendered.system_span
    assert s > 0 and (got.prefill[:s] == 0).all()  # queries before the system span cannot see it (causality)
    assert (got.prefill[s:] > 0).all()

    reply = chat(smol32, [CONV], Sampling(greedy=True, max_new_tokens=1), steer=["trace:prefill=true"])[0]
    assert isinstance(reply.trace, Trace)
    np.testing.assert_allclose(reply.trace.prefill, got.prefill, atol=tol(1e-6), rtol=0)
    np.testing.assert_allclose(reply.trace.decode[0], got.prefill[-1], atol=tol(1e-6), rtol=0)
    assert len(reply.trace.generated_tokens) == reply.trace.decode.shape[0] == 1

    # The module-level verb is the same call; a dialog ending with the assistant is traced as it stands.
    assert trace(smol32, CONV) == got
    dialog = [*CONV, {"role": "assistant", "content": "Je visite le British Museum."}]
    ids = smol32.render(dialog, add_generation_prompt=False).ids
    assert ids[:T] == rendered.ids  # this template renders the generation prompt as the turn's start
    replay = trace(smol32, dialog)
    assert replay.prompt_length == len(ids)
    np.testing.assert_allclose(replay.prefill[:T], got.prefill, atol=tol(1e-5), rtol=0)  # causality
    steered = trace(smol32, dialog, steer="split-softmax:k=0.8")  # pi is read before each layer's reweighting
    np.testing.assert_allclose(steered.prefill[:, 0], replay.prefill[:, 0], atol=tol(1e-5), rtol=0)
    assert np.abs(steered.prefill[e:, 1:] - replay.prefill[e:, 1:]).max() > 1e-3  # later layers see its effect


@pytest.mark.model
def test_backend_trace_matches_eager_attention_weights(smol32, smol_dir, device):
    """pi = the sum of the eager softmax weights over the system-prompt key columns."""
    import torch
    from transformers import AutoModelForCausalLM

    got = smol32.trace(CONV)
    rendered = smol32.render(CONV)
    s, e = rendered.system_span
    eager = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32, attn_implementation="eager")
    eager = eager.to(device).eval()
    with torch.inference_mode():
        out = eager(input_ids=torch.tensor([rendered.ids], device=device), output_attentions=True)
    for layer in (0, 7, 15, 29):
        weights = out.attentions[layer][0].float()  # [H, T, T]
        pi = weights[:, :, s:e].sum(-1).T.cpu().numpy()  # [T, H]
        np.testing.assert_allclose(got.prefill[:, layer], pi, atol=tol(1e-4), rtol=0)
    assert got.prefill[e:].mean() < 0.9  # after the system prompt, pi is not trivially 1


@pytest.mark.model
def test_a_traced_reply_carries_typed_views(smol32):
    reply = chat(smol32, [CONV], Sampling(greedy=True, max_new_tokens=6), steer=["trace"])[0]
    t = reply.trace
    assert isinstance(t, Trace) and t.prefill is None and t.prompt_length == reply.n_prompt_tokens
    n = t.decode.shape[0]
    assert n >= reply.n_tokens and len(t.generated_tokens) == n
    assert t.mean().shape == (n,) and ((t.decode >= 0) & (t.decode <= 1 + 1e-6)).all()
    assert len(t.to_pandas()) == n * smol32.shape.layers * smol32.shape.heads
    assert len(t.plot(layers=[0, 10, 29]).lines) == 3
    assert Trace.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert chat(smol32, [CONV], Sampling(greedy=True, max_new_tokens=2))[0].trace is None
