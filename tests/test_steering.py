"""The `--steer` grammar and the Interventions model: composition, normalisation, one-line errors."""

from __future__ import annotations

import math

import pytest

from driftlab.chat.base import Capabilities
from driftlab.errors import DriftlabError
from driftlab.steering import InstABoost, Interventions, KeyBias


def test_several_kinds_compose_into_one_attention_config():
    iv = Interventions.parse(["split-softmax:k=0.8,heads=0-1", "bias:value=-3,invert=true,heads=2.1", "trace"])
    cfg = iv.attention()
    assert (cfg.split_k, cfg.split_heads) == (0.8, ((0, None), (1, None)))
    (bias,) = cfg.biases
    assert (bias.value, bias.invert, bias.heads, bias.span) == (-3.0, True, ((2, 1),), "system")
    assert cfg.trace and iv.kinds == {"split-softmax", "bias", "trace"}


def test_key_biases_compose_as_terms_and_code_builds_what_specs_parse():
    iv = Interventions.parse(["bias:value=1", "instaboost:m=2"])
    assert [t.value for t in iv.attention().biases] == [1.0, pytest.approx(math.log(2))]
    built = Interventions.of(InstABoost(m=2.0), KeyBias(value=1.0))
    assert built == iv and built.specs() == iv.specs() == ["bias:value=1.0,span=system,invert=false,heads=all",
                                                            "instaboost:m=2.0"]


def test_the_same_kind_twice_is_an_error_not_an_overwrite():
    with pytest.raises(DriftlabError, match="split-softmax is given 2 times"):
        Interventions.parse(["split-softmax:k=0.9", "split-softmax:k=0.5"])
    with pytest.raises(DriftlabError, match="instaboost is given 2 times"):
        Interventions.of(InstABoost(m=2), InstABoost(m=3))


def test_specs_are_normalised_and_round_trip():
    iv = Interventions.parse(["trace", " Split-Softmax : k = 0.90 , heads = 3+1.2 "])
    assert iv.specs() == ["split-softmax:k=0.9,heads=3+1.2", "trace:prefill=false"]
    assert Interventions.parse(iv.specs()) == iv
    # Order does not matter for identity (the prefix-cache key) ...
    assert Interventions.parse(["trace", "bias:value=1"]) == Interventions.parse(["bias:value=1", "trace"])
    # ... and tracing, which changes no output, is not part of it.
    assert Interventions.parse(["split-softmax:k=0.9", "trace"]).fingerprint() == \
        Interventions.parse(["split-softmax:k=0.9"]).fingerprint() != ""
    assert Interventions.parse(["trace"]).fingerprint() == ""


def test_instaboost_is_a_log_m_bias_on_the_system_keys():
    (term,) = Interventions.parse(["instaboost:m=5"]).attention().biases
    assert term.value == pytest.approx(math.log(5)) and term.span == "system" and term.heads is None
    assert Interventions.parse(["instaboost:m=1"]).attention().biases == ()  # log 1 = 0: the plain model


@pytest.mark.parametrize(
    "specs, message",
    [
        (["foo:x=1"], "Unknown intervention 'foo'"),
        (["split-softmax:k=2"], "k=2: input should be less than or equal to 1"),
        (["split-softmax"], "'k' is required"),
        (["split-softmax:k=0.5,q=1"], "unknown setting 'q'"),
        (["split-softmax:k=0.5,k=0.6"], "sets 'k' twice"),
        (["split-softmax:k"], "Cannot read 'k'"),
        (["split-softmax:k=nan"], "k=nan: input should be a finite number"),
        (["bias:value=nan"], "value=nan: input should be a finite number"),
        (["bias:value=inf"], "value=inf: input should be a finite number"),
        (["bias:value=1,invert=ture"], "invert=ture: input should be a valid boolean"),
        (["bias:heads=3"], "'value' is required"),
        (["instaboost:m=0"], "m=0: input should be greater than 0"),
        (["split-softmax:k=0.5,heads=layer3"], "Cannot read head selection 'layer3'"),
        (["trace:prefill=maybe"], "prefill=maybe"),
        (["bias:value=2,span=sytem"], "span=sytem: not one of system, marked (did you mean 'system'?)"),
        (["pasta:heads=all,scope=prmpt"], "not one of prompt, all (did you mean 'prompt'?)"),
        (["split-sofmax:k=0.5"], "Unknown intervention 'split-sofmax'"),
        (["split-sofmax:k=0.5"], "(did you mean 'split-softmax'?)"),
        (["split-softmax:kk=0.5"], "unknown setting 'kk' (did you mean 'k'?)"),
    ],
)
def test_bad_specs_are_one_line_errors(specs, message):
    with pytest.raises(DriftlabError) as err:
        Interventions.parse(specs)
    assert message in str(err.value) and "\n" not in err.value.message


def test_capabilities_refuse_what_a_backend_cannot_apply():
    remote = Capabilities(interventions=frozenset({"trace"}))
    remote.require("server", Interventions.parse(["trace"]))
    with pytest.raises(DriftlabError, match="server cannot apply --steer bias, split-softmax") as err:
        remote.require("server", Interventions.parse(["split-softmax:k=0.9", "bias:value=1", "trace"]))
    assert "supports: trace" in err.value.hint


# -- system-prompt repetition (a conversation edit) ------------------------------------------------
def _dialog(n_users: int) -> list[dict]:
    conv = [{"role": "system", "content": "Always reply in French."}]
    for i in range(n_users):
        conv += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return conv[:-1]


def test_spr_p0_is_the_identity_and_p1_repeats_before_every_later_user_turn():
    conv = _dialog(4)
    assert Interventions.parse(["spr:p=0"]).model_view(conv) == conv
    view = Interventions.parse(["spr:p=1"]).model_view(conv)
    roles = [m["role"] for m in view]
    assert roles == ["system", "user", "assistant"] + ["system", "user", "assistant"] * 2 + ["system", "user"]
    assert all(m["content"] == conv[0]["content"] for m in view if m["role"] == "system")
    assert [m for m in view if m["role"] != "system"] == conv[1:]  # nothing else changes
    no_system = conv[1:]
    assert Interventions.parse(["spr:p=1"]).model_view(no_system) == no_system


def test_spr_draws_are_seeded_stable_across_turns_and_about_p():
    spr = Interventions.parse(["spr:p=0.3,seed=4"])
    long = _dialog(400)
    view = spr.model_view(long)
    repeats = sum(m["role"] == "system" for m in view) - 1
    assert 0.3 * 399 - 4 * (399 * 0.21) ** 0.5 < repeats < 0.3 * 399 + 4 * (399 * 0.21) ** 0.5
    # A dialog's prefix gets the same copies at every later turn (so its KV cache stays valid) ...
    short = spr.model_view(_dialog(37))
    assert view[: len(short) - 1] == short[:-1]
    # ... and another seed draws other ones.
    assert Interventions.parse(["spr:p=0.3,seed=5"]).model_view(long) != view


def test_cfg_alpha_is_at_least_one():
    with pytest.raises(DriftlabError, match="alpha=0.5: input should be greater than or equal to 1"):
        Interventions.parse(["cfg:alpha=0.5"])
    assert Interventions.parse(["cfg:alpha=1"]).guidance() is None
    assert Interventions.parse(["cfg:alpha=2.5", "spr:p=0.5"]).guidance() == 2.5
