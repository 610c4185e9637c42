"""The 100 built-in personas: data faithful to the persona-drift paper's Table 2, and every measure
separating replies that follow the persona from replies that drift.

fixtures/seed000_table2.txt is Appendix E, Table 2 of the persona-drift paper (Li et al. 2024; README,
"Papers") copied verbatim from the paper's text (shared/seeds/000_d70031a65968cb35.txt, from the
"Table 2:" caption to the end of the file; only a final newline added): the tab-separated rows,
with the text's blank page-break lines.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from bench_cases import CASES
from driftlab.bench import (
    CATEGORIES,
    MEASURES,
    STARTERS,
    Persona,
    get_persona,
    load_personas,
    load_user_personas,
)
from driftlab.bench.measures import validate_params
from driftlab.errors import DriftlabError

PERSONAS = load_personas()
TESTS = Path(__file__).resolve().parent
TABLE_2 = TESTS / "fixtures" / "seed000_table2.txt"
REPO = TESTS.parent


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


# PDF-extraction artefacts of the table's text that the data repairs, each listed in
# docs/personas.md ("Changes from the paper's Table 2"): id -> [(field, table text, data text)].
# The repaired text is that of the paper's code release (hundred_system_prompts.py), except
# that the JSON prompt keeps the table's quoted placeholders where the code has <Your thought>.
TABLE_2_REPAIRS = {
    "x-equals-13": [("probe", "2 times x ? A)", "2 times x? A)")],
    "x-plus-y-20": [("system_prompt", "$x+y=20$", "x+y=20"), ("probe", "2 times x ? A)", "2 times x? A)")],
    "json-thought-response": [
        (
            "system_prompt",
            'format: "thought": "Your thought", "response": "Your response to the user".',
            'format: {"thought": "Your thought", "response": "Your response to the user"}.',
        )
    ],
}


def _table_2_rows() -> list[list[str]]:
    lines = TABLE_2.read_text(encoding="utf-8").splitlines()
    header = lines.index("System Prompt s_B\tProbe Question p_B")
    rows = [line.split("\t") for line in lines[header + 1 :] if "\t" in line]
    # The table wraps one long prompt over two rows; the benchmark joins them.
    i = next(k for k, row in enumerate(rows) if row[0].startswith("You can pick how many sentences"))
    rows[i : i + 2] = [[rows[i][0] + " " + rows[i + 1][0], rows[i][1]]]
    return rows


def test_text_matches_table_2_of_seed_000() -> None:
    """Each system prompt and probe is the table's text, in the table's order, but for the listed repairs."""
    rows = _table_2_rows()
    assert len(rows) == len(PERSONAS)
    for p, (prompt, probe) in zip(PERSONAS, rows):
        table = {"system_prompt": prompt, "probe": probe}
        for field, old, new in TABLE_2_REPAIRS.get(p.id, []):
            assert table[field].count(old) == 1, (p.id, field)
            table[field] = table[field].replace(old, new)
        assert (p.system_prompt, p.probe) == (table["system_prompt"], table["probe"]), p.id


def test_table_2_extraction_artefacts_are_repaired_and_documented() -> None:
    for p in PERSONAS:  # LaTeX math and a space before '?' came from the PDF, not from the authors
        assert "$" not in p.system_prompt + p.probe and " ?" not in p.probe, p.id
    json_prompt = get_persona("json-thought-response").system_prompt
    example = json.loads(json_prompt[json_prompt.index("{") : json_prompt.rindex("}") + 1])
    assert list(example) == ["thought", "response"]
    text = (REPO / "docs" / "personas.md").read_text(encoding="utf-8")
    section = text[text.index("### Changes from the paper's Table 2") :].split("\n## ")[0]
    for pid in TABLE_2_REPAIRS:
        assert f"`{pid}`" in section, pid


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
        assert min(good) >= max(bad) + c.margin, (good, bad)
    else:
        assert min(good) >= 0.8, good
        assert max(bad) <= 0.2, bad


@pytest.mark.parametrize("persona", PERSONAS, ids=lambda p: p.id)
def test_scores_are_floats_in_range_for_odd_replies(persona: Persona) -> None:
    for text in ["", "   ", "?!", "42", "ok", "😀😀", "x" * 500, "Line one.\n\nLine two\n- item"]:
        s = persona.score(text)
        assert isinstance(s, float) and 0.0 <= s <= 1.0, (text, s)


def _score_all_cases() -> dict[str, float]:
    return {
        f"{p.id}/{i}": p.score(text)
        for p in PERSONAS
        for i, text in enumerate(CASES[p.id].compliant + CASES[p.id].violating)
    }


# Scores every case in a fresh interpreter, personas and replies in reverse order, the
# global `random` state disturbed first: no state left by earlier calls (caches, langdetect's
# factory, lazily loaded lexicons) and no set/dict order (PYTHONHASHSEED) may change a score.
_FRESH_SCORER = """
import json, random, sys
random.seed(12345); random.random()
from bench_cases import CASES
from driftlab.bench import load_personas
out = {}
for p in reversed(load_personas()):
    texts = CASES[p.id].compliant + CASES[p.id].violating
    for i in reversed(range(len(texts))):
        out[f"{p.id}/{i}"] = p.score(texts[i])
json.dump(out, sys.stdout)
"""


@pytest.mark.process
def test_scores_are_reproducible_in_fresh_processes() -> None:
    """This process's scores against a fresh one's under another hash seed (one fresh interpreter:
    this process and it are already two seeds, and each interpreter is seconds of imports)."""
    here = _score_all_cases()  # this process has scored (and warmed up) everything before
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # never this process's own seed
    proc = subprocess.run([sys.executable, "-c", _FRESH_SCORER], env={**env, "PYTHONHASHSEED": seed},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fresh = json.loads(proc.stdout)
    assert fresh.keys() == here.keys()
    differ = {k: (here[k], fresh[k]) for k in here if fresh[k] != here[k]}  # exact: JSON keeps floats
    assert not differ, differ


def test_language_scores_ignore_langdetect_seed_set_elsewhere() -> None:
    from langdetect import DetectorFactory

    texts = [c for p in PERSONAS if p.category == "language" for c in CASES[p.id].compliant]
    texts += ["Bonjour !", "Hello les amis", "Merci beaucoup", "Il fait beau today"]  # short: seed-sensitive
    lang = get_persona("reply-in-french")
    before = [lang.score(t) for t in texts]
    saved = DetectorFactory.seed
    try:
        DetectorFactory.seed = 7  # e.g. another library seeding langdetect its own way
        after = [lang.score(t) for t in texts]
    finally:
        DetectorFactory.seed = saved
    assert after == before


def _measure_signature(name: str) -> dict[str, inspect.Parameter]:
    params = list(inspect.signature(MEASURES[name]).parameters.values())
    assert params[0].name == "text" and params[0].kind is params[0].POSITIONAL_OR_KEYWORD, name
    return {p.name: p for p in params[1:]}


@pytest.mark.parametrize("name", sorted(MEASURES))
def test_measure_params_are_validated_against_the_function_signature(name: str) -> None:
    """validate_params accepts what the function takes, and nothing else.

    The reference is the function's own signature: a required parameter left out, an unknown
    one added, or a default that differs would let a data file pass validation and then fail
    (or silently score with other values) when the first reply is scored.
    """
    sig = _measure_signature(name)
    required = {k for k, p in sig.items() if p.default is p.empty}
    users = [p for p in PERSONAS if p.measure == name]
    for p in users:
        assert validate_params(name, p.params) == p.params, p.id  # canonical: coercion is a no-op
        inspect.signature(MEASURES[name]).bind("reply", **p.params)  # TypeError if it does not fit
        assert required <= set(p.params), p.id
    for k in required:  # each required parameter, alone, is reported missing
        base = next((dict(p.params) for p in users), None)
        if base is not None:
            del base[k]
            with pytest.raises(ValueError, match=re.escape(k)):
                validate_params(name, base)
    if not required:  # all defaults: no params is valid, and the function runs with them
        assert validate_params(name, {}) == {}
        assert 0.0 <= MEASURES[name]("A reply.") <= 1.0
    with pytest.raises(ValueError, match="not_a_param"):
        validate_params(name, {**(users[0].params if users else {}), "not_a_param": 1})


def test_every_measure_is_documented_and_every_documented_measure_exists() -> None:
    """docs/personas.md is where the unknown-measure error sends users for the list."""
    text = (REPO / "docs" / "personas.md").read_text(encoding="utf-8")
    section = text[text.index("## Measures") : text.index("## Your own personas")]
    documented = set()
    for line in section.splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            documented |= set(re.findall(r"`([a-z_]+)`", cells[1]))
    assert documented == set(MEASURES)
    for name in MEASURES:  # and each row names the parameters the function takes
        row = next(line for line in section.splitlines() if line.startswith("| ") and f"`{name}`" in line)
        for param in _measure_signature(name):
            assert f"`{param}`" in row.split("|")[2], (name, param)


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


def test_changing_a_returned_persona_does_not_change_the_builtins() -> None:
    p = get_persona("start-words-with-a")
    saved = dict(p.params)
    try:
        p.params["letter"] = "z"
    except TypeError:  # an immutable mapping: nothing can leak
        pass
    try:
        fresh = get_persona("start-words-with-a")
        assert fresh.params == saved
        assert fresh.score("Always answer as a tourist") > fresh.score("Zebras zoom zigzag")
    finally:
        if p.params != saved:  # undo the leak for the tests after this one
            p.params.update(saved)


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


@pytest.mark.parametrize("persona", PERSONAS, ids=lambda p: p.id)
def test_an_empty_or_blank_reply_scores_zero(persona: Persona) -> None:
    """No reply is no compliance, for every persona (before: 1.0 on no-letter-e, all-caps, ...)."""
    for text in ["", "   \n"]:
        assert persona.score(text) == 0.0
        assert persona.score(text, truncated=True) in (0.0, None)


def test_a_truncated_reply_is_not_scored_where_the_measure_needs_the_whole_reply() -> None:
    cut = '{"thought": "The user wants tips.", "response": "Visit the British Museum and'
    json_persona = get_persona("json-thought-response")
    assert json_persona.needs_complete
    assert json_persona.score(cut) == 0.0  # unchanged without the flag: callers that pass nothing
    assert json_persona.score(cut, truncated=False) == 0.0
    assert json_persona.score(cut, truncated=True) is None  # "truncated", not a violation
    assert json_persona.score('{"thought": "t", "response": "r"}', truncated=True) is None
    last_word = get_persona("last-word-equals-first")
    assert last_word.score("London is lovely, and I love London", truncated=True) is None
    for pid, reply in [  # measures that judge what there is score a cut-off reply as usual
        ("exactly-ten-words", "As a tourist in London I would visit the British Museum, then"),
        ("reply-in-french", "Je visite le British Museum, puis je me promène le long de"),
        ("mention-tokyo", "Unlike Tokyo, London has"),
    ]:
        p = get_persona(pid)
        assert not p.needs_complete
        assert p.score(reply, truncated=True) == p.score(reply)
    complete = {p.id for p in PERSONAS if p.needs_complete}
    assert {"json-thought-response", "bracketed-word-list", "last-word-equals-first", "one-sentence",
            "twelve-seven-word-sentences", "sentence-length-equals-position", "answer-as-questions",
            "extremely-long"} <= complete  # fmt: skip
    assert "exactly-ten-words" not in complete and "no-letter-e" not in complete


def test_a_language_code_langdetect_does_not_know_is_rejected_at_load(tmp_path: Path) -> None:
    entry = {"id": "my-french", "category": "language", "system_prompt": "Parle français.",
             "probe": "How are you?", "measure": "language", "params": {"lang": "french"}}  # fmt: skip
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(entry) + "\n", encoding="utf-8")
    with pytest.raises(DriftlabError, match=r"line 1, field 'params': persona 'my-french': lang 'french' is"):
        load_user_personas(path)
    with pytest.raises(ValueError, match="persona 'my-french'.*'fr-fr'.*Did you mean 'fr'"):
        Persona(**{**entry, "params": {"lang": "fr-fr"}})
    assert Persona(**{**entry, "params": {"lang": "fr"}}).score("Je vais très bien, merci beaucoup.") > 0.9
