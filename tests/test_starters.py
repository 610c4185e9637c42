"""Conversation starters: the reference code's 45 topics (default) and driftlab's own list."""

from __future__ import annotations

import pytest

import driftlab.bench as bench
from driftlab.bench import STARTER_SETS, STARTERS, load_personas, starters
from driftlab.bench.starters import DEFAULT_STARTER_SET, STARTER_SET_NAMES
from driftlab.errors import DriftlabError

# First and last entries of `topics` in likenneth/persona_drift utils.py, verbatim.
REFERENCE_FIRST = "Celebrity culture seems to be a topic of discussion these days. What's your take?"
REFERENCE_LAST = "The internet has changed human interaction in various ways. What's your opinion?"


def test_the_default_is_the_reference_list() -> None:
    assert DEFAULT_STARTER_SET == "reference" == STARTER_SET_NAMES[0]
    assert STARTERS is STARTER_SETS["reference"] is bench.STARTERS
    assert starters() == list(STARTERS) == starters("reference")


def test_reference_list_is_the_reference_codes_topics() -> None:
    ref = STARTER_SETS["reference"]
    assert len(ref) == 45
    assert ref[0] == REFERENCE_FIRST and ref[-1] == REFERENCE_LAST
    # near-duplicates of the original are kept as they are, in order
    crypto = [s for s in ref if s.startswith("Cryptocurrency is being discussed")]
    assert [s.rsplit(". ", 1)[1] for s in crypto] == ["What's your opinion?", "What's your take?"]


def test_own_list_is_still_available() -> None:
    own = starters("driftlab")
    assert len(own) == 45 and own[0] == "What's your take on celebrity culture?"
    assert set(own).isdisjoint(STARTER_SETS["reference"])


@pytest.mark.parametrize("name", ["reference", "driftlab"])
def test_lists_are_clean(name: str) -> None:
    items = STARTER_SETS[name]
    assert isinstance(items, tuple) and len(set(items)) == len(items)
    probes = {p.probe for p in load_personas()}
    for s in items:
        assert s == s.strip() and s and "\n" not in s and not s.startswith("#")
        assert s.endswith("?") and s not in probes


def test_starters_returns_a_fresh_list() -> None:
    got = starters()
    got.append("mine?")
    assert len(starters()) == 45 and len(STARTERS) == 45


def test_unknown_set_names_the_choices() -> None:
    with pytest.raises(DriftlabError, match="unknown starter set 'referense'") as err:
        starters("referense")
    assert "did you mean 'reference'" in (err.value.hint or "") and "driftlab" in (err.value.hint or "")
