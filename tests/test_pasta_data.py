"""PASTA data: the bundled BiasBios/CounterFact sets and the loaders for the real file formats."""

from __future__ import annotations

import json
import pickle
import re
from collections import Counter

import pytest

from driftlab.errors import DriftlabError
from driftlab.pasta.datasets import (
    OCCUPATIONS,
    Bio,
    Fact,
    load_bios,
    load_facts,
    occupation_label,
    split_sentences,
)

_SHE = re.compile(r"\b(she|her|hers|herself)\b", re.IGNORECASE)
_HE = re.compile(r"\b(he|him|his|himself)\b", re.IGNORECASE)


# ---------------------------------------------------------------- bundled bios


def test_bundled_bios_sizes_and_splits():
    bios = load_bios()
    assert len(bios) == 140 and all(isinstance(b, Bio) for b in bios)
    train, valid, test = (load_bios(split=s) for s in ("train", "valid", "test"))
    assert len(train) == 28 and len(valid) == 28 and len(test) == 84
    for rows in (train, valid):
        assert sorted(b.occupation for b in rows) == sorted(OCCUPATIONS)
        assert Counter(b.gender for b in rows) == {"F": 14, "M": 14}


def test_bundled_bios_balanced_per_occupation():
    bios = load_bios(split="train") + load_bios(split="test")
    per = Counter((b.occupation, b.gender) for b in bios)
    assert per == {(o, g): 2 for o in OCCUPATIONS for g in "FM"}


def test_bundled_bios_are_well_formed():
    bios = load_bios()
    assert len({b.id for b in bios}) == len({b.name for b in bios}) == 140
    for b in bios:
        assert b.bio.startswith(b.first_sentence) and b.first_sentence.startswith(b.name)
        assert split_sentences(b.bio)[0] == b.first_sentence
        assert 3 <= len(split_sentences(b.bio)) <= 5 and 50 <= len(b.bio.split()) <= 110
        label = occupation_label(b.occupation)
        assert label.lower() in b.first_sentence.lower(), b.id
        later = b.bio[len(b.first_sentence) :]
        assert not re.search(rf"\b{re.escape(label)}s?\b", later, re.IGNORECASE), b.id
        own, other = (_SHE, _HE) if b.gender == "F" else (_HE, _SHE)
        assert len(own.findall(b.bio)) >= 3 and not other.findall(b.bio), b.id


def test_occupation_label():
    assert occupation_label("software_engineer") == "software engineer"
    assert occupation_label("dj") == "DJ"
    assert occupation_label("Yoga Teacher") == "yoga teacher"
    with pytest.raises(DriftlabError, match="lawyer"):
        occupation_label("lawyer")


def test_split_sentences_keeps_abbreviations():
    text = "Dr. Ana Ruiz, Ph.D., is a nurse in St. Louis. She met John F. Kennedy once! Why? Nobody knows."
    assert split_sentences(text) == [
        "Dr. Ana Ruiz, Ph.D., is a nurse in St. Louis.",
        "She met John F. Kennedy once!",
        "Why?",
        "Nobody knows.",
    ]


def test_unknown_split_is_an_error():
    with pytest.raises(DriftlabError, match="split"):
        load_bios(split="validation")


# ---------------------------------------------------------------- bundled facts


def test_bundled_facts():
    facts = load_facts()
    assert len(facts) == 80 and all(isinstance(f, Fact) for f in facts)
    assert [f.id for f in load_facts(split="train")] == list(range(20))
    assert [f.id for f in load_facts(split="valid")] == list(range(60, 80))
    assert [f.id for f in load_facts(split="test")] == list(range(20, 60))
    assert len({f.subject for f in facts}) == 80
    for f in facts:
        assert f.prompt.count("{}") == 1
        assert f.target_true != f.target_new and len(f.target_true.split()) <= 2
        assert len(f.paraphrases) == 2 and all(f.subject in p for p in f.paraphrases)
        assert f.question == f.prompt.replace("{}", f.subject) and f.subject in f.question
        assert f.new_fact.endswith(" " + f.target_new) and re.fullmatch(r"P\d+", f.relation_id)
    assert len({f.relation_id for f in facts}) >= 10


# ---------------------------------------------------------------- real formats

_RAW = (
    "Dr. Nora Quill is a registered nurse at St. Mary's hospital. She has worked nights for ten years. "
    "Her patients like her. Yes."
)


def _bios_pickle_rows() -> list[dict]:
    """Two rows shaped like BIOS.pkl (De-Arteaga et al. 2019), plus one too short to keep."""
    nora = {
        "path": "crawl/1.wet", "URI": "http://example.org/nora", "title": "nurse", "raw_title": "registered nurse",
        "gender": "F", "name": ("Nora", "", "Quill"), "raw": _RAW, "start_pos": 57,
        "bio": "_ has worked nights for ten years. Her patients like her. Yes.",
    }  # fmt: skip
    omar = {
        "title": "software_engineer", "gender": "M", "name": ("Omar", None, "Said"),
        "raw": "Omar Said is a software engineer in Leeds.\nHe writes compilers, and his tests run fast.",
        "bio": "_ writes compilers.", "start_pos": 43,
    }  # fmt: skip
    short = {"title": "poet", "gender": "F", "name": ("Ada", "", "Vale"), "raw": "Ada Vale is a poet."}
    return [nora, omar, short]


def test_bios_pickle(tmp_path):
    path = tmp_path / "BIOS.pkl"
    path.write_bytes(pickle.dumps(_bios_pickle_rows()))
    bios = load_bios(path)
    assert [b.id for b in bios] == ["bios-0", "bios-1"]  # the 3-word bio is skipped, as pastalib does
    nora, omar = bios
    assert (nora.name, nora.gender, nora.occupation, nora.split) == ("Nora Quill", "F", "nurse", "test")
    assert nora.first_sentence == "Dr. Nora Quill is a registered nurse at St. Mary's hospital."
    assert nora.bio.endswith("Her patients like her.")  # "Yes." is under 3 words: dropped
    assert omar.name == "Omar Said" and omar.occupation == "software_engineer"
    assert (
        omar.bio == "Omar Said is a software engineer in Leeds. He writes compilers, and his tests run fast."
    )
    assert {b.split for b in load_bios(path, split="train")} == {"train"}


def test_bios_pickle_refuses_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps([Evil()]))
    with pytest.raises(DriftlabError, match="builtins.print"):
        load_bios(path)


def test_bios_pastalib_reformatted(tmp_path):
    """pastalib writes json.dump per row with no newline: a stream of objects on one line."""
    rows = [
        {
            "id": "Nora_Quill", "entity": "Nora", "prompt": "Nora has the occupation of",
            "context": "Nora is a registered nurse at a clinic. She works nights, and her patients like her.",
            "attribute": "is a registered nurse at a clinic", "target_mediated": "nurse", "target_unmediated": None,
            "source": {"gender": "F", "title": "nurse"},
        },
        {
            "id": "Omar_Said", "entity": "Omar", "prompt": "Omar has the occupation of",
            "context": "About Omar: he is a software engineer. He writes compilers for his team.",
            "attribute": "About Omar: he is a software engineer.", "target_mediated": "software engineer",
        },
    ]  # fmt: skip
    path = tmp_path / "biosbias.json"
    path.write_text("".join(json.dumps(r) for r in rows))
    nora, omar = load_bios(path)
    assert nora.first_sentence == "Nora is a registered nurse at a clinic." and nora.gender == "F"
    assert omar.occupation == "software_engineer" and omar.gender == "M"  # from the pronouns
    assert omar.first_sentence == "About Omar: he is a software engineer."


def test_bios_driftlab_jsonl_roundtrip(tmp_path):
    path = tmp_path / "bios.jsonl"
    path.write_text("\n".join(json.dumps(b.__dict__) for b in load_bios()[:8]) + "\n")
    assert load_bios(path) == load_bios()[:8]
    assert [b.id for b in load_bios(path, split="train")] == ["bb-000", "bb-004"]


def _rome_record(case_id: int, **rewrite) -> dict:
    base = {
        "prompt": "{} is a native speaker of", "relation_id": "P103", "subject": "Danielle Darrieux",
        "target_new": {"str": "English", "id": "Q1860"}, "target_true": {"str": "French", "id": "Q150"},
    }  # fmt: skip
    return {
        "case_id": case_id,
        "pararel_idx": 2796,
        "requested_rewrite": {**base, **rewrite},
        "paraphrase_prompts": [
            "Shayna does this and Yossel Goldschmidt is Danielle Darrieux's mother tongue is",
            "An album was released.\nDanielle Darrieux, a native",
        ],
        "neighborhood_prompts": ["Michel Rocard's mother tongue is"],
        "attribute_prompts": ["J. R. R. Tolkien is a native speaker of"],
        "generation_prompts": ["Danielle Darrieux's mother tongue is"],
    }


def test_facts_rome_json(tmp_path):
    path = tmp_path / "counterfact.json"
    path.write_text(json.dumps([_rome_record(0), _rome_record(1, subject="Edwin of Northumbria")]))
    first, second = load_facts(path)
    assert (first.id, first.subject, first.target_true, first.target_new) == (
        0,
        "Danielle Darrieux",
        "French",
        "English",
    )
    assert first.question == "Danielle Darrieux is a native speaker of" and first.split == "test"
    assert first.paraphrases[1] == "Danielle Darrieux, a native"  # text after the last newline
    assert second.subject == "Edwin of Northumbria" and first.relation_id == "P103"
    assert {f.split for f in load_facts(path, split="train")} == {"train"}


def test_facts_pastalib_jsonl(tmp_path):
    flat = {
        "id": "7", "entity": "Danielle Darrieux", "prompt": "Danielle Darrieux, a native",
        "context": "The mother tongue of Danielle Darrieux is English", "attribute": "is English",
        "target_mediated": "English", "target_unmediated": "French",
    }  # fmt: skip
    with_source = {**flat, "id": "3", "source": _rome_record(3)}
    path = tmp_path / "counterfact.jsonl"
    path.write_text(json.dumps(flat) + json.dumps(with_source))
    flat_fact, source_fact = load_facts(path)
    assert flat_fact.id == 7 and flat_fact.prompt == "The mother tongue of {} is"
    assert (flat_fact.target_true, flat_fact.target_new) == ("French", "English")
    assert source_fact.id == 3 and source_fact.prompt == "{} is a native speaker of"


# ---------------------------------------------------------------- malformed files


def _bio_row(**change) -> dict:
    row = {
        "id": "x-1", "name": "Ann Lee", "gender": "F", "occupation": "poet", "split": "test",
        "first_sentence": "Ann Lee is a poet.", "bio": "Ann Lee is a poet. She writes at night.",
    }  # fmt: skip
    row.update(change)
    return {k: v for k, v in row.items() if v is not None}


def _bios_text(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


_BAD_BIOS = {
    "not-json": (_bios_text(_bio_row()) + "{not json\n", r"row 2: not valid JSON"),
    "missing-key": (_bios_text(_bio_row(), _bio_row(id="x-2", bio=None)), r"row 2: missing key 'bio'"),
    "wrong-type": (_bios_text(_bio_row(name=42)), r"row 1: 'name' must be a string, got an integer"),
    "unknown-occupation": (_bios_text(_bio_row(occupation="lawyer")), r"row 1: unknown occupation 'lawyer'; allowed: accountant"),
    "first-sentence": (_bios_text(_bio_row(first_sentence="Ann is a poet.")), r"row 1: 'first_sentence' is not the start"),
    "duplicate-id": (_bios_text(_bio_row(), _bio_row()), r"row 2: duplicate id 'x-1'"),
    "empty": ("\n\n", r"no rows"),
    "empty-list": ("[]", r"no rows \(the JSON list is empty\)"),
    "not-object": ("[1, 2]", r"row 1: expected a JSON object, got an integer"),
}  # fmt: skip


@pytest.mark.parametrize("text, pattern", _BAD_BIOS.values(), ids=_BAD_BIOS.keys())
def test_malformed_bios(tmp_path, text, pattern):
    path = tmp_path / "bios.jsonl"
    path.write_text(text)
    with pytest.raises(DriftlabError, match=pattern) as info:
        load_bios(path)
    assert str(path) in info.value.message and info.value.hint


def _facts_text(*records: dict) -> str:
    return json.dumps(list(records))


_BAD_FACTS = {
    "no-placeholder": (_facts_text(_rome_record(0, prompt="Paris is in")), r"row 1: prompt 'Paris is in' must contain exactly one"),
    "same-target": (_facts_text(_rome_record(0, target_new={"str": "French"})), r"row 1: target_true and target_new are both 'French'"),
    "missing-nested": (_facts_text(_rome_record(0), _rome_record(1, target_true={"id": "Q1"})), r"row 2: missing key 'requested_rewrite.target_true.str'"),
    "missing-rewrite": (_facts_text({"case_id": 0}), r"row 1: missing key 'requested_rewrite'"),
    "case-id-type": (_facts_text({**_rome_record(0), "case_id": "zero"}), r"row 1: 'case_id' must be an integer, got a string"),
    "empty-paraphrases": (_facts_text({**_rome_record(0), "paraphrase_prompts": []}), r"row 1: 'paraphrase_prompts' is an empty list"),
    "truncated": (_facts_text(_rome_record(0))[:-20], r"row 1: not valid JSON"),
    "duplicate": (_facts_text(_rome_record(4), _rome_record(4)), r"row 2: duplicate case_id 4"),
}  # fmt: skip


@pytest.mark.parametrize("text, pattern", _BAD_FACTS.values(), ids=_BAD_FACTS.keys())
def test_malformed_facts(tmp_path, text, pattern):
    path = tmp_path / "counterfact.json"
    path.write_text(text)
    with pytest.raises(DriftlabError, match=pattern) as info:
        load_facts(path)
    assert str(path) in info.value.message and "counterfact.json" in info.value.hint


def test_malformed_pickle_and_missing_file(tmp_path):
    path = tmp_path / "BIOS.pkl"
    path.write_bytes(pickle.dumps([{"title": "nurse", "gender": "F", "name": ("A", "", "B")}]))
    with pytest.raises(DriftlabError, match=r"row 1: missing key 'raw'"):
        load_bios(path)
    path.write_bytes(pickle.dumps({"not": "a list"}))
    with pytest.raises(DriftlabError, match="expected a list of dicts"):
        load_bios(path)
    path.write_bytes(b"garbage")
    with pytest.raises(DriftlabError, match="not a BiasBios pickle"):
        load_bios(path)
    with pytest.raises(DriftlabError, match="file not found"):
        load_facts(tmp_path / "nope.json")
    latin = tmp_path / "bios.jsonl"
    latin.write_bytes(b'{"name": "Ren\xe9e"}\n')
    with pytest.raises(DriftlabError, match="not UTF-8"):
        load_bios(latin)
