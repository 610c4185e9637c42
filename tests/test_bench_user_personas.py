"""User-defined personas from JSONL and TOML files, and the errors for invalid entries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driftlab.bench import get_persona, load_personas, load_user_personas
from driftlab.errors import DriftlabError

PIRATE = {
    "id": "pirate",
    "category": "persona",
    "system_prompt": "You are a pirate. Talk like one.",
    "probe": "How are you today?",
    "measure": "mentions_any",
    "params": {"terms": ["arr", "matey", "ahoy"]},
}
TOML = """
# my personas
[[persona]]
id = "pirate"
category = "persona"
system_prompt = "You are a pirate. Talk like one."
probe = "How are you today?"
measure = "mentions_any"
params = { terms = ["arr", "matey", "ahoy"] }

[[persona]]
id = "haiku"
category = "pattern"
system_prompt = "Always answer in three lines."
probe = "What do you do in London as a tourist?"
measure = "sentence_count"
params = { n = 3 }
"""


def write_jsonl(tmp_path: Path, entries: list[object], blank_first: bool = False) -> Path:
    path = tmp_path / "mine.jsonl"
    lines = [json.dumps(e) if not isinstance(e, str) else e for e in entries]
    path.write_text(("\n" if blank_first else "") + "\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_entries_load_and_score(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [PIRATE, {**PIRATE, "id": "polite-pirate", "params": {"terms": ["please"]}}])
    mine = load_user_personas(path)
    assert [p.id for p in mine] == ["pirate", "polite-pirate"]
    assert mine[0].score("Arr, I be fine, matey!") == 1.0
    assert mine[0].score("I'm fine, thank you.") == 0.0
    assert len(load_personas(extra=path)) == 102
    assert [p.id for p in load_personas(category="persona", extra=path)][-2:] == ["pirate", "polite-pirate"]
    assert get_persona("pirate", extra=path).probe == "How are you today?"


def test_toml_entries_load(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(TOML, encoding="utf-8")
    mine = load_user_personas(path)
    assert [p.id for p in mine] == ["pirate", "haiku"]
    assert mine[1].score("One. Two. Three.") == 1.0


@pytest.mark.parametrize(
    ("entry", "field", "words"),
    [
        ({k: v for k, v in PIRATE.items() if k != "probe"}, "probe", "Field required"),
        ({**PIRATE, "measure": "mentions_anyy"}, "measure", "did you mean 'mentions_any'"),
        ({**PIRATE, "params": {"term": ["arr"]}}, "params", "term"),
        ({**PIRATE, "params": {"terms": "arr"}}, "params", "terms"),
        ({**PIRATE, "category": "Pirate Stories"}, "category", "pattern"),  # open, but a slug
        ({**PIRATE, "id": "Pirate Persona"}, "id", "pattern"),
        ({**PIRATE, "colour": "red"}, "colour", "Extra inputs"),
        ({**PIRATE, "id": "reply-in-french"}, "id", "built-in"),
    ],
)
def test_invalid_jsonl_entry_names_line_and_field(
    tmp_path: Path, entry: dict, field: str, words: str
) -> None:
    path = write_jsonl(tmp_path, [{**PIRATE, "id": "fine"}, entry], blank_first=True)
    with pytest.raises(DriftlabError) as err:
        load_user_personas(path)
    assert f"line 3, field '{field}'" in err.value.message
    assert words in err.value.message
    assert err.value.hint


def test_a_category_of_your_own_is_a_category(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{**PIRATE, "category": "pirates"}])
    assert [p.id for p in load_personas(category="pirates", extra=path)] == ["pirate"]
    with pytest.raises(DriftlabError) as err:
        load_personas(category="pirate", extra=path)
    assert err.value.hint.endswith("language, ifbench, ifeval, pirates")  # the built-ins (the paper's order, the constraint suites'), then yours


def test_duplicate_ids_and_broken_json(tmp_path: Path) -> None:
    with pytest.raises(DriftlabError, match=r"line 2, field 'id': 'pirate' already used on line 1"):
        load_user_personas(write_jsonl(tmp_path, [PIRATE, PIRATE]))
    with pytest.raises(DriftlabError, match=r"line 2: not valid JSON"):
        load_user_personas(write_jsonl(tmp_path, [PIRATE, '{"id": "x",']))
    with pytest.raises(DriftlabError, match=r"line 1: expected an object"):
        load_user_personas(write_jsonl(tmp_path, [[1, 2]]))


def test_invalid_toml_entry_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(TOML.replace("n = 3", "n = 0"), encoding="utf-8")
    with pytest.raises(DriftlabError, match=r"line 11, field 'params'.*greater than or equal to 1"):
        load_user_personas(path)
    path.write_text(TOML.replace('id = "haiku"', "id = haiku"), encoding="utf-8")
    with pytest.raises(DriftlabError, match="not valid TOML"):
        load_user_personas(path)
    path.write_text("[[personas]]\nid = 'x'\n", encoding="utf-8")
    with pytest.raises(DriftlabError, match="unexpected top-level key"):
        load_user_personas(path)


def test_missing_or_unsupported_file(tmp_path: Path) -> None:
    with pytest.raises(DriftlabError, match="not found"):
        load_user_personas(tmp_path / "nope.jsonl")
    (tmp_path / "mine.yaml").write_text("id: x\n", encoding="utf-8")
    with pytest.raises(DriftlabError, match="unsupported"):
        load_user_personas(tmp_path / "mine.yaml")


def test_params_are_coerced_to_the_measures_types(tmp_path: Path) -> None:
    entry = {**PIRATE, "measure": "sentence_count", "params": {"n": "2"}}
    (persona,) = load_user_personas(write_jsonl(tmp_path, [entry]))
    assert persona.params == {"n": 2}
    assert persona.score("Arr. Matey.") == 1.0
