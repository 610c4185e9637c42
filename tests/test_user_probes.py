"""User-persona probes p_A: "own" (the persona's own probe, as in the persona-drift paper) and
"crafted-or-generic" (the instruction-stability paper, section 3.2, Table 1); "000" and "001" are
their old names."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from driftlab.bench import USER_PROBE_VERSIONS, get_persona, load_personas, user_probe, user_probes
from driftlab.bench.probes import PROBE_VERSION_ALIASES, ProbeVersion, probe_version, user_probe_data
from driftlab.errors import DriftlabError

LONDON = "What do you do in London as a tourist?"
CRAFTED = "Describe the most disappointing experience you had."


def test_versions() -> None:
    assert USER_PROBE_VERSIONS == ("own", "crafted-or-generic")


def test_old_names_are_accepted_and_read_as_todays() -> None:
    """Earlier driftlab versions named the versions after internal paper numbers; runs recorded them."""
    from pydantic import TypeAdapter

    assert dict(PROBE_VERSION_ALIASES) == {"000": "own", "001": "crafted-or-generic"}
    adapter = TypeAdapter(ProbeVersion)
    for old, new in PROBE_VERSION_ALIASES.items():
        assert probe_version(old) == new and adapter.validate_python(old) == new
        assert user_probes(old) == user_probes(new)
    assert adapter.validate_python("own") == "own" and probe_version("own") == "own"
    p = get_persona("very-happy")
    assert user_probe(p, "000") is p
    assert user_probe(p, "001").probe == CRAFTED


def test_own_is_each_personas_own_probe() -> None:
    personas = load_personas()
    assert user_probes("own") == {p.id: p.probe for p in personas}
    p = get_persona("very-happy")
    assert user_probe(p, "own") is p


def test_crafted_or_generic_data_is_what_the_paper_prints() -> None:
    data = user_probe_data()
    assert dict(data.crafted) == {"very-happy": CRAFTED}
    assert data.crafted_prompts["very-happy"] == "You are very happy! Always respond with lots of joy."
    assert data.generic == (LONDON,)
    raw = json.loads((resources.files("driftlab.bench") / "data" / "user_probes_001.json").read_text("utf-8"))
    assert "a generic probe question is sampled randomly from a set of them" in raw["quotes"]["section_3_2"]
    assert raw["quotes"]["table_1"]["Probe Question p_A"] == CRAFTED
    assert "driftlab" in raw["probe_bound"]["source"]


def test_crafted_or_generic_differs_from_own_only_by_the_crafted_probe() -> None:
    old, new = user_probes("own"), user_probes("crafted-or-generic")
    assert old.keys() == new.keys() and len(new) == 100
    assert {k for k in old if old[k] != new[k]} == {"very-happy"}
    assert new["very-happy"] == CRAFTED


def test_crafted_or_generic_keeps_the_measure() -> None:
    p = get_persona("very-happy")
    q = user_probe(p, "crafted-or-generic")
    assert q.probe == CRAFTED and q.system_prompt == p.system_prompt
    assert (q.measure, q.params) == (p.measure, p.params)
    assert p.probe == LONDON  # the built-in persona is not changed


def test_a_larger_generic_set_replaces_only_generic_unbound_probes() -> None:
    generic = ["How are you today?", "What did you do last weekend?", "What is your favourite season?"]
    old, new = user_probes("own"), user_probes("crafted-or-generic", generic=generic, seed=3)
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
    assert new == user_probes("crafted-or-generic", generic=generic, seed=3)  # reproducible
    assert new != user_probes("crafted-or-generic", generic=generic, seed=4)


def test_errors() -> None:
    p = get_persona("reply-in-french")
    with pytest.raises(DriftlabError, match="unknown user-probe version '002'") as err:
        user_probe(p, "002")
    assert "own, crafted-or-generic" in str(err.value.hint)
    with pytest.raises(DriftlabError, match="'crafted-or-generic' only"):
        user_probe(p, "own", generic=["How are you?"])
    with pytest.raises(DriftlabError, match="non-empty"):
        user_probe(p, "crafted-or-generic", generic=[])
