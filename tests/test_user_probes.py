"""User-persona probes p_A: seed 000 (the persona's own probe) and seed 001 (section 3.2, Table 1)."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from driftlab.bench import USER_PROBE_VERSIONS, get_persona, load_personas, user_probe, user_probes
from driftlab.bench.probes import user_probe_data
from driftlab.errors import DriftlabError

LONDON = "What do you do in London as a tourist?"
CRAFTED = "Describe the most disappointing experience you had."


def test_versions() -> None:
    assert USER_PROBE_VERSIONS == ("000", "001")


def test_000_is_each_personas_own_probe() -> None:
    personas = load_personas()
    assert user_probes("000") == {p.id: p.probe for p in personas}
    p = get_persona("very-happy")
    assert user_probe(p, "000") is p


def test_001_data_is_what_the_paper_prints() -> None:
    data = user_probe_data()
    assert dict(data.crafted) == {"very-happy": CRAFTED}
    assert data.crafted_prompts["very-happy"] == "You are very happy! Always respond with lots of joy."
    assert data.generic == (LONDON,)
    raw = json.loads((resources.files("driftlab.bench") / "data" / "user_probes_001.json").read_text("utf-8"))
    assert "a generic probe question is sampled randomly from a set of them" in raw["quotes"]["section_3_2"]
    assert raw["quotes"]["table_1"]["Probe Question p_A"] == CRAFTED
    assert "driftlab" in raw["probe_bound"]["source"]


def test_001_differs_from_000_only_by_the_crafted_probe() -> None:
    old, new = user_probes("000"), user_probes("001")
    assert old.keys() == new.keys() and len(new) == 100
    assert {k for k in old if old[k] != new[k]} == {"very-happy"}
    assert new["very-happy"] == CRAFTED


def test_001_keeps_the_measure() -> None:
    p = get_persona("very-happy")
    q = user_probe(p, "001")
    assert q.probe == CRAFTED and q.system_prompt == p.system_prompt
    assert (q.measure, q.params) == (p.measure, p.params)
    assert p.probe == LONDON  # the built-in persona is not changed


def test_a_larger_generic_set_replaces_only_generic_unbound_probes() -> None:
    generic = ["How are you today?", "What did you do last weekend?", "What is your favourite season?"]
    old, new = user_probes("000"), user_probes("001", generic=generic, seed=3)
    bound = user_probe_data().probe_bound
    for pid, probe in new.items():
        if pid == "very-happy":
            assert probe == CRAFTED
        elif old[pid] == LONDON and pid not in bound:
            assert probe in generic
        else:
            assert probe == old[pid], pid
    assert {"count-user-words", "apples-for-london", "london-to-new-york"} <= bound
    assert len(set(new.values()) & set(generic)) > 1  # the draw spreads over the set
    assert new == user_probes("001", generic=generic, seed=3)  # reproducible
    assert new != user_probes("001", generic=generic, seed=4)


def test_errors() -> None:
    p = get_persona("reply-in-french")
    with pytest.raises(DriftlabError, match="unknown user-probe version"):
        user_probe(p, "002")
    with pytest.raises(DriftlabError, match="'001' only"):
        user_probe(p, "000", generic=["How are you?"])
    with pytest.raises(DriftlabError, match="non-empty"):
        user_probe(p, "001", generic=[])
