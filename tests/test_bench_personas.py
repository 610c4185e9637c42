"""The 100 built-in personas: data faithful to seed 000's Table 2, and every measure separating
replies that follow the persona from replies that drift."""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from bench_cases import CASES
from driftlab.bench import CATEGORIES, MEASURES, STARTERS, Persona, get_persona, load_personas
from driftlab.errors import DriftlabError

PERSONAS = load_personas()
SEED = next(iter(sorted((Path(__file__).resolve().parents[2] / "shared" / "seeds").glob("000_*.txt"))), None)


def test_one_hundred_unique_personas() -> None:
    assert len(PERSONAS) == 100
    assert len({p.id for p in PERSONAS}) == 100
    assert len({(p.system_prompt, p.probe) for p in PERSONAS}) == 100


def test_categories_as_assigned() -> None:
    counts = Counter(p.category for p in PERSONAS)
    assert set(counts) == set(CATEGORIES)
    assert counts == {"pattern": 35, "memorization": 27, "multiple_choice": 21, "persona": 14, "language": 3}


def test_personas_that_share_a_prompt_differ_in_probe() -> None:
    by_prompt: dict[str, list[Persona]] = {}
    for p in PERSONAS:
        by_prompt.setdefault(p.system_prompt, []).append(p)
    shared = {prompt: ps for prompt, ps in by_prompt.items() if len(ps) > 1}
    assert "You are very sad. Always respond with depressing answers." in shared
    for ps in shared.values():
        assert len({p.probe for p in ps}) == len(ps)


@pytest.mark.skipif(SEED is None, reason="seed 000 text not found beside the repository")
def test_text_matches_table_2_of_seed_000() -> None:
    """Each system prompt and probe is the table's text, in the table's order."""
    assert SEED is not None
    lines = SEED.read_text(encoding="utf-8").splitlines()
    header = lines.index("System Prompt s_B\tProbe Question p_B")
    rows = [line.split("\t") for line in lines[header + 1 :] if "\t" in line]
    # The table wraps one long prompt over two rows; the benchmark joins them.
    i = next(k for k, row in enumerate(rows) if row[0].startswith("You can pick how many sentences"))
    rows[i : i + 2] = [[rows[i][0] + " " + rows[i + 1][0], rows[i][1]]]
    assert [(p.system_prompt, p.probe) for p in PERSONAS] == [tuple(r) for r in rows]


def test_every_persona_has_test_replies() -> None:
    assert set(CASES) == {p.id for p in PERSONAS}
    for pid, c in CASES.items():
        assert c.compliant and c.violating, pid


@pytest.mark.parametrize("persona", PERSONAS, ids=lambda p: p.id)
def test_measure_separates_compliant_from_drifted_replies(persona: Persona) -> None:
    c = CASES[persona.id]
    good = [persona.score(t) for t in c.compliant]
    bad = [persona.score(t) for t in c.violating]
    assert all(0.0 <= s <= 1.0 for s in good + bad)
    if c.graded:
        assert min(good) >= max(bad) + 0.2, (good, bad)
    else:
        assert min(good) >= 0.8, good
        assert max(bad) <= 0.2, bad


@pytest.mark.parametrize("persona", PERSONAS, ids=lambda p: p.id)
def test_scores_are_floats_in_range_for_odd_replies(persona: Persona) -> None:
    for text in ["", "   ", "?!", "42", "ok", "😀😀", "x" * 500, "Line one.\n\nLine two\n- item"]:
        s = persona.score(text)
        assert isinstance(s, float) and 0.0 <= s <= 1.0, (text, s)


def test_scores_are_deterministic() -> None:
    for p in PERSONAS:
        for text in CASES[p.id].compliant[:1] + CASES[p.id].violating[:1]:
            assert p.score(text) == p.score(text)


def test_every_builtin_measure_id_is_registered() -> None:
    assert {p.measure for p in PERSONAS} <= set(MEASURES)


def test_get_persona_by_id_and_unknown_id() -> None:
    assert get_persona("reply-in-french").system_prompt.startswith("Vous parlez toujours en français")
    with pytest.raises(DriftlabError) as err:
        get_persona("reply-in-frnch")
    assert "reply-in-french" in (err.value.hint or "")


def test_category_filter() -> None:
    mc = load_personas(category="multiple_choice")
    assert len(mc) == 21 and all(p.category == "multiple_choice" for p in mc)
    with pytest.raises(DriftlabError):
        load_personas(category="choices")


def test_personas_are_frozen() -> None:
    p = get_persona("reply-in-french")
    with pytest.raises(ValueError):
        p.probe = "changed"  # type: ignore[misc]


def test_starters() -> None:
    assert 40 <= len(STARTERS) <= 50
    assert len(set(STARTERS)) == len(STARTERS)
    probes = {p.probe for p in PERSONAS}
    for s in STARTERS:
        assert s.endswith("?") and s not in probes and not s.startswith("#")


def test_data_file_is_canonical() -> None:
    """Validation neither adds defaults nor coerces anything in the shipped data."""
    text = (resources.files("driftlab.bench") / "data" / "personas.jsonl").read_text(encoding="utf-8")
    raw = [json.loads(line) for line in text.splitlines()]
    assert [p.model_dump() for p in PERSONAS] == raw
