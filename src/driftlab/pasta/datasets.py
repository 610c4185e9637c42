"""PASTA's data: BiasBios bios and CounterFact facts, bundled smoke sets and loaders for the real files.

PASTA (Zhang et al., ICLR 2024; section 4 and appendix A) evaluates four tasks on two data sets:

* **BiasBios** (De-Arteaga et al., 2019) feeds three tasks (BiasBios itself, JSON formatting and
  pronoun changing). A `Bio` is one professional biography: its first sentence names the
  occupation (the span PASTA emphasises), later sentences may distract, and the label is one of
  the 28 `OCCUPATIONS`.
* **CounterFact** (Meng et al., 2022, ROME) gives the knowledge-conflict task. A `Fact` is a
  rewrite (subject, prompt template, old target, new target) plus paraphrased questions.

`load_bios()` / `load_facts()` without a path read small sets written by hand for driftlab
(``data/biosbias.jsonl``, 140 bios of fictional people; ``data/counterfact.json``, 80 well-known
facts in ROME's format; see ``data/README.md``). They are smoke-scale, so that tests and a quick
`driftlab pasta` run need no download; the paper uses 1000/1000/5000 examples per task.

With a path they read the real files, in the formats the paper's reference code (pastalib 0.1.3,
``evaluation/data.py``) reads:

* the original BiasBios pickle (``BIOS.pkl``: a list of dicts with ``raw``, ``bio``, ``title``,
  ``gender``, ``name``, ...), reduced the way pastalib's ``scripts/reformat_dataset.py`` does it
  (sentences of fewer than 3 words dropped, the rest kept, the first one is the emphasised span);
* pastalib's reformatted ``biosbias.json`` (rows with ``entity``, ``context``, ``attribute``,
  ``target_mediated``), whose ``attribute`` is the emphasised span;
* ROME's ``counterfact.json`` (one JSON list of records) or pastalib's reformatted
  ``counterfact.jsonl``.

Every malformed file raises one `DriftlabError` naming the file, the row and what is wrong, with
a hint about the expected format: a user pointing driftlab at a download should never see a
``KeyError`` from deep inside a loader.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from driftlab.errors import DriftlabError

#: The 28 BiasBios occupations (De-Arteaga et al., 2019), as the ``title`` field spells them.
#: BiasBios accuracy asks whether the target gets the highest probability among these 28.
OCCUPATIONS: tuple[str, ...] = (
    "accountant", "architect", "attorney", "chiropractor", "comedian", "composer", "dentist",
    "dietitian", "dj", "filmmaker", "interior_designer", "journalist", "model", "nurse", "painter",
    "paralegal", "pastor", "personal_trainer", "photographer", "physician", "poet", "professor",
    "psychologist", "rapper", "software_engineer", "surgeon", "teacher", "yoga_teacher",
)  # fmt: skip

#: The split names rows may carry: "train" for head profiling and few-shot demonstrations,
#: "valid" for choosing the number of steered heads (`driftlab pasta tune`), "test" for results.
SPLITS: tuple[str, ...] = ("train", "valid", "test")

#: The bundled CounterFact set keeps ROME's format exactly, which has no split field, so the split
#: is a rule on ``case_id``: below 20 is "train", 60 to 79 (written later) "valid", the rest "test".
COUNTERFACT_TRAIN_BELOW = 20
COUNTERFACT_VALID = range(60, 80)

#: pastalib's reformatting: sentences shorter than this are dropped (``sent_min_words``) ...
SENT_MIN_WORDS = 3
#: ... and bios shorter than this are skipped (``bio_min_words``).
BIO_MIN_WORDS = 10
#: First names pastalib drops as scraping artifacts (``_BIOS_BIAS_BLACKLISTED_NAMES``).
_BLACKLISTED_FIRST_NAMES = frozenset({"Non-Residential"})

_DATA_PACKAGE = "driftlab.pasta"
_BUNDLED_BIOS = "biosbias.jsonl"
_BUNDLED_FACTS = "counterfact.json"

_BIO_KEYS = ("id", "name", "gender", "occupation", "first_sentence", "bio", "split")
_BIOS_HINT = (
    "expected driftlab's bios JSONL (one object a line with keys "
    + ", ".join(_BIO_KEYS)
    + "), pastalib's reformatted biosbias.json (entity, context, attribute, target_mediated), "
    "or the original BiasBios BIOS.pkl (a list of dicts with raw/bio, title, gender, name)"
)
_FACTS_HINT = (
    "expected ROME's counterfact.json: a JSON list of records "
    '{"case_id": 0, "requested_rewrite": {"prompt": "{} is located in", "subject": ..., '
    '"target_true": {"str": ...}, "target_new": {"str": ...}}, "paraphrase_prompts": [...]}, '
    "or pastalib's counterfact.jsonl (id, entity, context, prompt, target_mediated, target_unmediated)"
)
_PRONOUNS_F = re.compile(r"\b(she|her|hers|herself)\b", re.IGNORECASE)
_PRONOUNS_M = re.compile(r"\b(he|him|his|himself)\b", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Bio:
    """One biography. `first_sentence` is always a prefix of `bio`, so it can be emphasised in place."""

    id: str
    name: str
    gender: str  # "F" or "M"
    occupation: str  # one of OCCUPATIONS
    first_sentence: str
    bio: str
    split: str  # one of SPLITS

    @property
    def occupation_text(self) -> str:
        """The occupation as words ("software engineer", "DJ"), the form a model should answer."""
        return occupation_label(self.occupation)


@dataclass(frozen=True)
class Fact:
    """One CounterFact rewrite: `prompt` is ROME's template with one "{}" for `subject`."""

    id: int  # ROME's case_id
    subject: str
    prompt: str
    target_true: str
    target_new: str
    paraphrases: tuple[str, ...]
    split: str  # one of SPLITS
    relation_id: str = ""  # Wikidata property, e.g. "P131"; "" where the file has none

    @property
    def question(self) -> str:
        """The prompt with the subject filled in, e.g. "The Eiffel Tower is located in the city of"."""
        return self.prompt.replace("{}", self.subject)

    @property
    def old_fact(self) -> str:
        """`question` completed with the true target: PASTA's "{old fact}"."""
        return f"{self.question} {self.target_true}"

    @property
    def new_fact(self) -> str:
        """`question` completed with the new target: PASTA's "{new fact}", the emphasised span."""
        return f"{self.question} {self.target_new}"


def _normalize_occupation(text: str) -> str:
    return re.sub(r"[\s\-]+", "_", text.strip().lower())


def occupation_label(name: str) -> str:
    """The natural text of an occupation: "software_engineer" -> "software engineer", "dj" -> "DJ".

    Models are scored on words, not on the dataset's identifiers, so prompts and targets use this.
    """
    occupation = _normalize_occupation(name)
    if occupation not in OCCUPATIONS:
        raise DriftlabError(f"unknown occupation {name!r}", hint="use one of: " + ", ".join(OCCUPATIONS))
    return "DJ" if occupation == "dj" else occupation.replace("_", " ")


# --------------------------------------------------------------------------------------------
# Sentences (pastalib uses spaCy; NLTK's Punkt keeps driftlab free of that dependency)


def split_sentences(text: str) -> list[str]:
    """Sentences of English prose: NLTK's Punkt (driftlab's parameters, `metrics.sent_tokenize`),
    standing in for the spaCy pass of pastalib's reformatting script."""
    from driftlab.pasta.metrics import sent_tokenize

    return sent_tokenize(text)


# --------------------------------------------------------------------------------------------
# File reading and error reporting


class _Source:
    """Where rows come from, so that every error names the file, the row and the expected format."""

    def __init__(self, where: str, hint: str) -> None:
        self.where = where
        self.hint = hint

    def fail(self, row: int | None, message: str) -> NoReturn:
        at = f"{self.where}: row {row}: " if row is not None else f"{self.where}: "
        raise DriftlabError(at + message, hint=self.hint)

    def get(
        self, row: int, record: dict, key: str, kind: type | tuple[type, ...] = str, *, parent: str = ""
    ) -> Any:
        """`record[key]`, checked: present, of `kind`, and (strings) not blank."""
        name = f"{parent}.{key}" if parent else key
        if key not in record:
            self.fail(row, f"missing key {name!r}")
        value = record[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            self.fail(row, f"{name!r} must be {_json_type(expected)}, got {_json_type(type(value).__name__)}")
        if isinstance(value, str) and not value.strip():
            self.fail(row, f"{name!r} is empty")
        return value


def _json_type(python_name: str) -> str:
    return {"str": "a string", "int": "an integer", "dict": "an object", "list": "a list",
            "NoneType": "null", "float": "a number", "bool": "a boolean"}.get(python_name, python_name)  # fmt: skip


def _read_text(path: Path, source: _Source) -> str:
    if not path.exists():
        raise DriftlabError(f"{path}: file not found", hint=source.hint)
    if path.is_dir():
        raise DriftlabError(f"{path}: is a directory, not a data file", hint=source.hint)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        source.fail(
            None, f"not UTF-8 text (bad byte at offset {exc.start}); a pickle must end in .pkl or .pickle"
        )
    except OSError as exc:
        source.fail(None, f"cannot be read ({exc.strerror or exc})")


def _json_rows(text: str, source: _Source) -> list[tuple[int, Any]]:
    """(row number, value) for a JSON list, JSON lines, or concatenated JSON objects.

    pastalib writes its reformatted files with ``json.dump`` and no newline between records, so
    a stream of objects on one line must load as well as one object per line. Rows count from 1.
    """
    text = text.removeprefix("\ufeff")
    decoder = json.JSONDecoder()
    space = re.compile(r"\s*")
    values: list[Any] = []
    pos, line, counted = 0, 1, 0
    while True:
        pos = space.match(text, pos).end()
        if pos >= len(text):
            break
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            line += text.count("\n", counted, exc.pos)
            source.fail(len(values) + 1, f"not valid JSON ({exc.msg}, line {line} column {exc.colno})")
        line += text.count("\n", counted, end)
        counted = pos = end
        values.append(value)
    if not values:
        source.fail(None, "no rows (the file is empty)")
    if isinstance(values[0], list):
        if len(values) > 1:
            source.fail(2, "a JSON list must be the whole file; found more JSON after it")
        values = values[0]
        if not values:
            source.fail(None, "no rows (the JSON list is empty)")
    rows = list(enumerate(values, start=1))
    for number, value in rows:
        if not isinstance(value, dict):
            source.fail(number, f"expected a JSON object, got {_json_type(type(value).__name__)}")
    return rows


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise DriftlabError(f"unknown split {split!r}", hint="use 'train', 'valid', 'test', or None for all")


def _bundled(name: str) -> tuple[str, str]:
    """(text, display name) of a bundled data file, read through importlib.resources (works in wheels)."""
    resource = resources.files(_DATA_PACKAGE).joinpath("data", name)
    return resource.read_text(encoding="utf-8"), f"driftlab/pasta/data/{name}"


# --------------------------------------------------------------------------------------------
# BiasBios


def load_bios(path: str | Path | None = None, split: str | None = None) -> list[Bio]:
    """Biographies for the BiasBios, JSON-formatting and pronoun-changing tasks.

    `path` None reads the bundled set (140 hand-written bios, 5 per occupation; rows carry their
    split: 1 "train", 3 "test", 1 "valid" per occupation). Otherwise the format is told by the file:

    * ``.pkl``/``.pickle``: the original BiasBios pickle. **Unpickling can run code**, so a pickle
      is read only when you name it here, and through an unpickler that refuses every global
      except plain containers (a list of dicts of strings needs none); still, only load files
      you trust. Rows follow pastalib's reformatting: text from ``raw`` (``bio`` if there is no
      ``raw``; in the real file ``bio`` lacks the first sentence), sentences under 3 words
      dropped, the rest kept; bios under 10 words, and pastalib's blacklisted name, are skipped.
      `Bio.name` is the full name and the text is kept as written (pastalib would rewrite every
      name to the first name). Ids are ``bios-<index in the pickle>``.
    * anything else is JSON: driftlab's bios JSONL (as bundled), or pastalib's reformatted
      ``biosbias.json`` (``entity`` becomes the name, ``context`` the bio, ``target_mediated``
      the occupation; the first sentence runs up to the end of ``attribute``, pastalib's
      emphasised span; gender comes from ``source`` or, failing that, from the pronouns). Ids
      are ``biosbias-<row>``.

    Real files carry no split: their rows are labelled "test", or `split` when one is asked for
    (pass split="train" to use a file as training data). For driftlab's JSONL, `split` filters.
    """
    _check_split(split)
    if path is None:
        return [bio for bio in _bundled_bios() if split is None or bio.split == split]
    path = Path(path).expanduser()
    source = _Source(str(path), _BIOS_HINT)
    if path.suffix.lower() in {".pkl", ".pickle"}:
        return _bios_from_pickle(path, source, split or "test")
    rows = _json_rows(_read_text(path, source), source)
    if any(key in rows[0][1] for key in ("target_mediated", "context", "entity")):
        return [_bio_from_pastalib(n, row, source, split or "test") for n, row in rows]
    bios = _bios_from_driftlab(rows, source)
    return [bio for bio in bios if split is None or bio.split == split]


@cache
def _bundled_bios() -> tuple[Bio, ...]:
    text, where = _bundled(_BUNDLED_BIOS)
    source = _Source(where, _BIOS_HINT)
    return tuple(_bios_from_driftlab(_json_rows(text, source), source))


def _occupation(row: int, value: str, source: _Source) -> str:
    occupation = _normalize_occupation(value)
    if occupation not in OCCUPATIONS:
        source.fail(row, f"unknown occupation {value!r}; allowed: {', '.join(OCCUPATIONS)}")
    return occupation


def _bios_from_driftlab(rows: Iterable[tuple[int, dict]], source: _Source) -> list[Bio]:
    bios: list[Bio] = []
    seen: set[str] = set()
    for n, row in rows:
        values = {key: source.get(n, row, key) for key in _BIO_KEYS}
        if values["id"] in seen:
            source.fail(n, f"duplicate id {values['id']!r}")
        seen.add(values["id"])
        if values["gender"] not in ("F", "M"):
            source.fail(n, f'\'gender\' must be "F" or "M", got {values["gender"]!r}')
        if values["split"] not in SPLITS:
            source.fail(n, f"'split' must be one of {', '.join(map(repr, SPLITS))}, got {values['split']!r}")
        if not values["bio"].startswith(values["first_sentence"]):
            source.fail(n, "'first_sentence' is not the start of 'bio'")
        values["occupation"] = _occupation(n, values["occupation"], source)
        bios.append(Bio(**values))
    return bios


def _gender_from_pronouns(text: str) -> str | None:
    female, male = len(_PRONOUNS_F.findall(text)), len(_PRONOUNS_M.findall(text))
    return "F" if female > male else "M" if male > female else None


def _gender(row: int, value: Any, source: _Source) -> str:
    text = str(value).strip().lower()
    if text in ("f", "female", "woman"):
        return "F"
    if text in ("m", "male", "man"):
        return "M"
    source.fail(row, f'\'gender\' must be "F" or "M", got {value!r}')


def _bio_from_pastalib(n: int, row: dict, source: _Source, split: str) -> Bio:
    name = source.get(n, row, "entity").strip()
    context = " ".join(source.get(n, row, "context").split())
    attribute = " ".join(source.get(n, row, "attribute").split())
    occupation = _occupation(n, source.get(n, row, "target_mediated"), source)
    at = context.find(attribute)
    if at >= 0:
        end = at + len(attribute)
        while end < len(context) and context[end] in ".!?:;\"'\u201d\u2019)":
            end += 1
        first = context[:end].strip()
    else:
        first = split_sentences(context)[0]
    origin = row.get("source")
    if isinstance(origin, dict) and origin.get("gender") is not None:
        gender = _gender(n, origin["gender"], source)
    elif (guessed := _gender_from_pronouns(context)) is not None:
        gender = guessed
    else:
        source.fail(n, "no gender: 'source.gender' is missing and the text has no she/he pronouns")
    return Bio(f"biosbias-{n - 1}", name, gender, occupation, first, context, split)


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles lists, dicts, tuples, strings and numbers only: no global can be called."""

    _ALLOWED = frozenset({("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")})

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a plain data file never needs")


def _bios_from_pickle(path: Path, source: _Source, split: str) -> list[Bio]:
    if not path.exists():
        raise DriftlabError(f"{path}: file not found", hint=source.hint)
    try:
        with path.open("rb") as handle:
            data = _PlainDataUnpickler(handle, encoding="utf-8").load()
    except OSError as exc:
        source.fail(None, f"cannot be read ({exc.strerror or exc})")
    except Exception as exc:  # arbitrary bytes can fail in many ways; each is the file's fault
        source.fail(None, f"not a BiasBios pickle that driftlab will load ({type(exc).__name__}: {exc})")
    if not isinstance(data, list | tuple):
        source.fail(None, f"expected a list of dicts, got {type(data).__name__}")
    if not data:
        source.fail(None, "no rows (the list is empty)")
    bios: list[Bio] = []
    for index, sample in enumerate(data):
        n = index + 1
        if not isinstance(sample, dict):
            source.fail(n, f"expected a dict, got {type(sample).__name__}")
        # 'raw' holds the whole bio; the real file's 'bio' is raw[start_pos:], without the first sentence.
        if isinstance(sample.get("raw"), str) and sample["raw"].strip():
            text = sample["raw"]
        elif "bio" in sample:
            text = source.get(n, sample, "bio")
        else:
            source.fail(n, "missing key 'raw' (and no 'bio' either)")
        occupation = _occupation(n, source.get(n, sample, "title"), source)
        gender = _gender(n, source.get(n, sample, "gender"), source)
        raw_name = source.get(n, sample, "name", (str, list, tuple))
        parts = [raw_name] if isinstance(raw_name, str) else list(raw_name)
        if not all(part is None or isinstance(part, str) for part in parts):
            source.fail(n, "'name' must be a string or a list of strings (first, middle, last)")
        parts = [part.strip() for part in parts if part and part.strip()]
        if not parts:
            source.fail(n, "'name' is empty")
        if parts[0] in _BLACKLISTED_FIRST_NAMES:
            continue
        cleaned = " ".join(text.split()).strip("*\u2022 ")
        sentences = [s for s in split_sentences(cleaned) if len(s.split()) >= SENT_MIN_WORDS]
        bio = " ".join(sentences)
        if len(bio.split()) < BIO_MIN_WORDS:
            continue
        bios.append(Bio(f"bios-{index}", " ".join(parts), gender, occupation, sentences[0], bio, split))
    if not bios:
        source.fail(None, f"no usable bio (every one is shorter than {BIO_MIN_WORDS} words)")
    return bios


# --------------------------------------------------------------------------------------------
# CounterFact


def load_facts(path: str | Path | None = None, split: str | None = None) -> list[Fact]:
    """CounterFact rewrites for the knowledge-conflict task.

    `path` None reads the bundled set (80 well-known facts in ROME's format; case_id below
    `COUNTERFACT_TRAIN_BELOW` is "train", in `COUNTERFACT_VALID` "valid", the rest "test"). A path may hold ROME's
    ``counterfact.json`` (a JSON list; JSON lines of the same records also load) or pastalib's
    reformatted ``counterfact.jsonl``, whose ``source`` record is used when present. Paraphrase
    prompts keep only their text after the last newline, pastalib's first clean-up step (ROME's
    paraphrase generator sometimes emitted newlines before the question).

    Real files carry no split: their rows are labelled "test", or `split` when one is asked for.
    """
    _check_split(split)
    if path is None:
        return [fact for fact in _bundled_facts() if split is None or fact.split == split]
    path = Path(path).expanduser()
    source = _Source(str(path), _FACTS_HINT)
    facts = _facts_from_rows(_json_rows(_read_text(path, source), source), source, split or "test")
    return facts


@cache
def _bundled_facts() -> tuple[Fact, ...]:
    text, where = _bundled(_BUNDLED_FACTS)
    source = _Source(where, _FACTS_HINT)
    facts = _facts_from_rows(_json_rows(text, source), source, None)
    return tuple(facts)


def _facts_from_rows(rows: Iterable[tuple[int, dict]], source: _Source, split: str | None) -> list[Fact]:
    """`split` None assigns the bundled rule by case_id; a string labels every row."""
    facts: list[Fact] = []
    seen: set[int] = set()
    for n, row in rows:
        origin = row.get("source")
        if "requested_rewrite" in row:
            fact = _fact_from_rome(n, row, source)
        elif isinstance(origin, dict) and "requested_rewrite" in origin:
            fact = _fact_from_rome(n, origin, source)
        elif "entity" in row or "target_mediated" in row:
            fact = _fact_from_pastalib(n, row, source)
        else:
            source.fail(n, "missing key 'requested_rewrite'")
        if fact.id in seen:
            source.fail(n, f"duplicate case_id {fact.id}")
        seen.add(fact.id)
        label = split if split is not None else _bundled_fact_split(fact.id)
        facts.append(dataclasses.replace(fact, split=label))
    return facts


def _bundled_fact_split(case_id: int) -> str:
    if case_id < COUNTERFACT_TRAIN_BELOW:
        return "train"
    return "valid" if case_id in COUNTERFACT_VALID else "test"


def _check_fact(n: int, source: _Source, prompt: str, target_true: str, target_new: str) -> None:
    if prompt.count("{}") != 1:
        source.fail(n, f'prompt {prompt!r} must contain exactly one "{{}}" for the subject')
    if target_true.strip().casefold() == target_new.strip().casefold():
        source.fail(
            n, f"target_true and target_new are both {target_true!r}; a rewrite must change the target"
        )


def _fact_from_rome(n: int, record: dict, source: _Source) -> Fact:
    case_id = source.get(n, record, "case_id", int)
    rewrite = source.get(n, record, "requested_rewrite", dict)
    prompt = source.get(n, rewrite, "prompt", parent="requested_rewrite")
    subject = source.get(n, rewrite, "subject", parent="requested_rewrite").strip()
    targets = {}
    for key in ("target_true", "target_new"):
        target = source.get(n, rewrite, key, dict, parent="requested_rewrite")
        targets[key] = source.get(n, target, "str", parent=f"requested_rewrite.{key}").strip()
    _check_fact(n, source, prompt, targets["target_true"], targets["target_new"])
    relation = rewrite.get("relation_id", "")
    paraphrases = source.get(n, record, "paraphrase_prompts", list)
    if not paraphrases:
        source.fail(n, "'paraphrase_prompts' is an empty list")
    cleaned = []
    for i, paraphrase in enumerate(paraphrases):
        if not isinstance(paraphrase, str) or not paraphrase.split("\n")[-1].strip():
            source.fail(n, f"'paraphrase_prompts[{i}]' must be a non-empty string")
        cleaned.append(paraphrase.split("\n")[-1].strip())
    return Fact(
        id=case_id,
        subject=subject,
        prompt=prompt,
        target_true=targets["target_true"],
        target_new=targets["target_new"],
        paraphrases=tuple(cleaned),
        split="test",
        relation_id=relation if isinstance(relation, str) else "",
    )


def _fact_from_pastalib(n: int, row: dict, source: _Source) -> Fact:
    """pastalib's flat row: context = f"{prompt.format(subject)} {target_new}"; undo that."""
    raw_id = source.get(n, row, "id", (str, int))
    if isinstance(raw_id, bool) or not str(raw_id).strip().isdigit():
        source.fail(n, f"'id' must be a case_id (digits), got {raw_id!r}")
    subject = source.get(n, row, "entity").strip()
    context = source.get(n, row, "context").strip()
    paraphrase = source.get(n, row, "prompt").strip()
    target_new = source.get(n, row, "target_mediated").strip()
    target_true = source.get(n, row, "target_unmediated").strip()
    if not context.endswith(" " + target_new) or subject not in context:
        source.fail(n, "'context' must be the question with the subject, then ' ' and target_mediated")
    question = context[: -len(target_new) - 1]
    prompt = question.replace(subject, "{}", 1)
    _check_fact(n, source, prompt, target_true, target_new)
    return Fact(int(raw_id), subject, prompt, target_true, target_new, (paraphrase,), "test")
