"""Persona measures: deterministic functions f(reply, **params) -> float in [0, 1].

Each kind of check is one small function registered under an id in `MEASURES`; the
benchmark data (and user files) pick a measure by id and pass its parameters, so the same
function scores "start your words with A" and "... with Z". The functions follow the
published measures of the persona-drift paper (likenneth/persona_drift, `hundred_system_prompts.py`) and
fix them where the original was buggy or brittle; each docstring says where it deviates
and how approximate it is.

Heavy or data-loading libraries (langdetect, VADER, wordfreq, CMU dict, TextBlob's tagger)
are imported on first use, so importing this module is cheap. All of them ship their data
inside their PyPI packages: nothing is downloaded, ever.

Every measure scores an empty or blank reply 0 (enforced once, in `register`), and scores
1 MB of text in well under a second: the pure-Python scans are linear, and the library
measures whose cost grows faster (VADER, the POS tagger, one langdetect call per pair)
read a bounded, evenly spaced sample of a very long reply (`_sample`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from driftlab.errors import DriftlabError

MeasureFn = Callable[..., float]

#: Registry: measure id -> function(text, **params) -> float in [0, 1].
MEASURES: dict[str, MeasureFn] = {}
_PARAMS: dict[str, type[BaseModel]] = {}
_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {}
#: measure id -> whether it needs a complete reply: always (True), or by its params (a function of them).
_NEEDS_COMPLETE: dict[str, bool | Callable[[dict[str, Any]], bool]] = {}


def register(
    name: str, check: Callable[[dict[str, Any]], None] | None = None,
    needs_complete: bool | Callable[[dict[str, Any]], bool] = False,
) -> Callable[[MeasureFn], MeasureFn]:
    """Register a measure under `name`.

    Its keyword parameters (everything after `text`) become a pydantic model, so a data
    file's `params` are type-checked when a persona is built, not when it is first scored.
    `check` adds cross-parameter rules (e.g. a choice's answer must be one of its options).
    `needs_complete` marks a measure that cannot judge a reply cut off by the token limit (an
    unclosed JSON object, a last word or sentence that is not the real last one): such a
    reply would score as a violation it may not be, so `Persona.score(..., truncated=True)`
    returns None for it instead. A measure of many checks (IFEval's) passes a function of the params.

    The registered function scores an empty or whitespace-only reply 0 whatever the measure:
    no reply follows no instruction, but "never use the letter e" or "no verbs in the
    present tense" would otherwise pass it vacuously.
    """

    def decorate(fn: MeasureFn) -> MeasureFn:
        if name in MEASURES:
            raise ValueError(f"measure {name!r} registered twice")
        hints = get_type_hints(fn, include_extras=True)  # resolves the postponed annotations
        fields: dict[str, Any] = {}
        for pname, param in list(inspect.signature(fn).parameters.items())[1:]:
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[pname] = (hints.get(pname, Any), default)
        _PARAMS[name] = create_model(f"{name}_params", __config__=ConfigDict(extra="forbid"), **fields)
        if check is not None:
            _CHECKS[name] = check
        if needs_complete:
            _NEEDS_COMPLETE[name] = needs_complete

        @functools.wraps(fn)
        def measure(text: str, *args: Any, **params: Any) -> float:
            return 0.0 if not text or text.isspace() else fn(text, *args, **params)

        MEASURES[name] = measure
        return measure

    return decorate


def register_custom(fn: Callable[[str], float], name: str | None = None, needs_complete: bool = False) -> str:
    """Register a measure written in the user's own code (`driftlab.measure`); returns its id.

    Any callable `text -> float in [0, 1]` scores: a notebook's lambda, a classifier, a call to
    a judge. Its id is what a run's manifest records, so a resumed run (a new process) finds it
    again when the same code registers it again; re-registering an id with a function of the same
    module and name replaces it (a re-run notebook cell), a different function under a taken id
    is refused. A value that is not a number in [0, 1] is caught where the reply is scored.
    """
    if not callable(fn):
        raise DriftlabError(f"a measure must be a callable text -> float in [0, 1], not {type(fn).__name__}",
                            hint="e.g. `lambda text: float('bonjour' in text.lower())`, with name=...")
    if name is None:  # a function registered before (dl.measure) keeps the name it was given
        name = next((k for k, f in _CUSTOM.items() if f is fn), getattr(fn, "__name__", ""))
    if not re.fullmatch(r"[A-Za-z_][\w-]*", name or "") or name == "<lambda>":
        raise DriftlabError(f"cannot name the measure {fn!r} after itself ({name!r}): pass name=.",
                            hint="pass name='my-measure' (letters, digits, '-' and '_'): manifests record it.")
    old = _CUSTOM.get(name)
    if name in MEASURES and (old is None or _origin(old) != _origin(fn)):
        raise DriftlabError(f"the measure id {name!r} is already taken by {'a built-in measure' if old is None else _origin(old)}.",
                            hint="pass another name=...")
    for table in (MEASURES, _PARAMS, _CHECKS):
        table.pop(name, None)
    _NEEDS_COMPLETE.pop(name, None)
    register(name, needs_complete=needs_complete)(_one_argument(fn))
    _CUSTOM[name] = fn
    return name


_CUSTOM: dict[str, Callable[[str], float]] = {}  # id -> the user's function (built-ins are not here)


def _origin(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _one_argument(fn: Callable[[str], float]) -> MeasureFn:
    """The user's function as a measure without parameters (register reads parameters from the signature)."""

    def measure(text: str) -> float:
        return fn(text)

    measure.__name__ = getattr(fn, "__name__", "measure")
    return measure


def parse_keywords(text: str) -> dict[str, str]:
    """`key=value,key=value` as a dict: a measure's parameters in a one-line spec
    (`judge:model=x,rubric=...`). A comma starts a new pair only before `word=`, so a rubric may
    hold commas ("rubric=warm, never familiar")."""
    out: dict[str, str] = {}
    for part in re.split(r",\s*(?=\w+\s*=)", text.strip()):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{part!r} is not key=value (e.g. model=smollm2-135m,rubric=...)")
        out[key.strip()] = value.strip()
    return out


def register_params(name: str, model: type[BaseModel]) -> None:
    """Make `validate_params` check the parameters of `name` by `model`: for a measure that is no
    function of the text (the judge, `driftlab.bench.judge`), whose parameters are a model of their own."""
    _PARAMS[name] = model


_PLUGINS: dict[str, MeasureFn] = {}  # id -> a function another package declared (entry points)


def plugin_measures() -> list[str]:
    """Register the measures other packages declare (entry point group `driftlab.measures`: a
    function `f(text, **params) -> float in [0, 1]`, its parameters typed like the built-ins';
    `f.needs_complete = True` marks one that cannot judge a cut reply); returns their ids."""
    from driftlab.plugins import load

    for name, fn in load("driftlab.measures").items():
        if _PLUGINS.get(name) is fn:
            continue
        if name in MEASURES:
            raise DriftlabError(f"The driftlab.measures plugin {name!r} takes the id of a measure driftlab has.",
                                hint="Rename the entry point in the plugin's package.")
        register(name, needs_complete=bool(getattr(fn, "needs_complete", False)))(fn)
        _PLUGINS[name] = fn
    return sorted(_PLUGINS)


def needs_complete(name: str, params: dict[str, Any] | None = None) -> bool:
    """Whether measure `name` (with these params) can only judge a complete reply (see `register`)."""
    rule = _NEEDS_COMPLETE.get(name, False)
    return bool(rule(params or {}) if callable(rule) else rule)


def validate_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """`params` checked and coerced for measure `name` ("3" -> 3); ValueError with a readable message if they do not fit."""
    if name not in _PARAMS:
        raise ValueError(f"unknown measure {name!r}; known measures: {', '.join(sorted(MEASURES))}")
    model = _PARAMS[name]
    try:
        coerced = model.model_validate(params).model_dump(exclude_unset=True)
    except ValidationError as err:
        expected = ", ".join(model.model_fields) or "none"
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'params'}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(
            f"bad params for measure {name!r} ({problems}); expected parameters: {expected}"
        ) from None
    if name in _CHECKS:
        _CHECKS[name](coerced)
    return coerced


def measure_params(name: str) -> dict[str, str]:
    """Parameter name -> readable type ("list[str]", "int = 4") of a measure, for docs and listings."""
    out = {}
    for pname, info in _PARAMS[name].model_fields.items():
        out[pname] = _type_name(info.annotation) + ("" if info.is_required() else f" = {info.default!r}")
    return out


def _type_name(tp: Any) -> str:
    """'list[str | list[str]]' rather than typing's repr with Annotated metadata."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


# --------------------------------------------------------------------------- text helpers

# A word: letters/digits with internal apostrophes or hyphens ("don't", "well-known", "fb4u39").
_WORD_RE = re.compile(r"[^\W_]+(?:['’\-][^\W_]+)*")
# A token for phrase matching: any run of letters/digits; apostrophes and hyphens split, so
# "it's" -> "it s" and "Magic: The Gathering" -> "magic the gathering" match their terms.
_TOKEN_RE = re.compile(r"[^\W_]+")
_THOUSANDS_RE = re.compile(r"(?<=\d)[,_](?=\d{3}(?!\d))")
_ABBREVIATIONS = frozenset("mr mrs ms dr st prof sr jr vs etc approx mt ft".split())
# A run of end marks is only tried from its start (the lookbehind): tried from every
# position, a long run not followed by a space ("....x") took quadratic time.
_BOUNDARY_RE = re.compile(r"(?<![.!?…])[.!?…]+[\"'”’)\]]*(?=\s|$)|\n\s*")
_NONSPACE_RE = re.compile(r"\S")


def words(text: str) -> list[str]:
    """The words of `text` (punctuation dropped, case kept)."""
    return _WORD_RE.findall(text)


def _tokens(text: str) -> list[str]:
    return _TOKEN_RE.findall(_THOUSANDS_RE.sub("", text.lower()))


def _normalize(text: str) -> str:
    """Lower-case tokens joined by single spaces, padded, so phrase search is `" t " in s`."""
    return " " + " ".join(_tokens(text)) + " "


def _has_term(normalized: str, term: str) -> bool:
    """Whether a term occurs as whole tokens; a trailing '*' makes it a prefix ("printer*")."""
    if term.endswith("*"):
        return (" " + _normalize(term[:-1]).strip()) in normalized
    return _normalize(term) in normalized


def sentences(text: str) -> list[str]:
    """Split text into sentences.

    Approximate, rule-based: a sentence ends at . ! ? or … (plus closing quotes/brackets)
    followed by whitespace, or at a line break. A period after a common abbreviation
    ("Mr.", "St.", "etc.") or a dotted one ("e.g.", "J.K.") does not end a sentence; decimals
    ("3.5") never do. Pieces without any word are dropped.
    """
    out: list[str] = []
    start = 0
    first = _first_nonspace(text, 0)  # where the first word of the current sentence begins
    for m in _BOUNDARY_RE.finditer(text):
        if m.group().startswith(".") and not m.group().startswith(".."):
            begin, end = _last_token(text, start, m.start())
            last = text[begin:end].lstrip("(\"'“‘").lower()
            list_marker = begin == first and last.isdigit()  # "1. Visit ..." starts a list item
            if last in _ABBREVIATIONS or "." in last or list_marker:
                continue
        piece = text[start : m.end()].strip()
        if words(piece):
            out.append(piece)
        start = m.end()
        first = _first_nonspace(text, start)
    tail = text[start:].strip()
    if words(tail):
        out.append(tail)
    return out


def _first_nonspace(text: str, pos: int) -> int:
    m = _NONSPACE_RE.search(text, pos)
    return m.start() if m else len(text)


def _last_token(text: str, lo: int, hi: int) -> tuple[int, int]:
    """(begin, end) of the last whitespace-separated token in text[lo:hi], found by walking back from `hi`.

    Splitting text[lo:hi] instead cost quadratic time on many abbreviations in a row
    ("e.g. e.g. ..."), where `lo` stays put while `hi` moves on.
    """
    end = hi
    while end > lo and text[end - 1].isspace():
        end -= 1
    begin = end
    while begin > lo and not text[begin - 1].isspace():
        begin -= 1
    return begin, end


def _sample(text: str, limit: int = 10_000) -> str:
    """`text` if it has at most `limit` characters, else evenly spaced sentences totalling about `limit`.

    For the library measures whose cost grows with length faster than linearly (VADER's
    "but" rule is quadratic) or steeply (the POS tagger): replies up to 10,000 characters,
    far more than a reply of a few hundred tokens, are scored whole; a longer one is scored
    on a sample spread over all of it, so a share (of positive words, of plural nouns) is
    estimated from the whole reply, not from its start.
    """
    if len(text) <= limit:
        return text
    sents = sentences(text)
    if not sents:
        return text[:limit]
    k = max(1, min(len(sents), limit * len(sents) // len(text)))  # sentences of average length that fit
    return " ".join(sents[i * len(sents) // k][: limit // k] for i in range(k))


def _fraction(flags: Iterable[bool]) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else 0.0


def _alternation(kinds: Sequence[object | None]) -> float:
    """Share of items that alternate with the previous one (the first counts if it has a kind).

    `None` means "neither kind" and never counts as alternating.
    """
    if not kinds:
        return 0.0
    hits = int(kinds[0] is not None)
    hits += sum(
        1 for prev, cur in zip(kinds, kinds[1:]) if cur is not None and prev is not None and cur != prev
    )
    return hits / len(kinds)


# --------------------------------------------------------------------------- letters and case


@register("words_start_with")
def words_start_with(text: str, letter: Annotated[str, Field(min_length=1, max_length=1)]) -> float:
    """Fraction of words that start with `letter` (case-insensitive).

    The original scored only the reply's first letter (its prompt said "start your reply");
    Table 2 says "start your words", so every word counts here.
    """
    ws = words(text)
    return _fraction(w[0].lower() == letter.lower() for w in ws)


@register("letter_absent")
def letter_absent(text: str, letter: Annotated[str, Field(min_length=1, max_length=1)]) -> float:
    """1 / (1 + number of occurrences of `letter`), case-insensitive (the original counted lower case only)."""
    return 1.0 / (1 + text.lower().count(letter.lower()))


@register("alliteration")
def alliteration(text: str) -> float:
    """Fraction of words that start with the reply's most common initial letter."""
    ws = [w.lower() for w in words(text)]
    if not ws:
        return 0.0
    return Counter(w[0] for w in ws).most_common(1)[0][1] / len(ws)


@register("letter_case")
def letter_case(text: str, case: Literal["upper", "lower"]) -> float:
    """Fraction of cased letters that are in `case` (as the original); 0 without cased letters.

    A fraction, so that drift shows as a gradual fall: counting slips instead (1 / (1 + slips))
    gave a single capitalised word 0.5 and any ordinary reply about 0. The price is a narrow
    range for "lowercase": sentence-case English is still about 0.95 there, so compare scores
    across turns. Letters without case (e.g. CJK) are ignored.
    """
    upper, lower = sum(map(str.isupper, text)), sum(map(str.islower, text))
    if not upper + lower:
        return 0.0
    return (upper if case == "upper" else lower) / (upper + lower)


@register("alternating_case")
def alternating_case(text: str) -> float:
    """Fraction of words that are ALL-CAPS or all-lowercase and flip case from the previous word.

    Mixed-case words ("London") break the chain. One-letter words ("I", "a") count as the case they have.
    """

    def kind(word: str) -> str | None:
        letters = [c for c in word if c.isalpha()]
        if letters and all(c.isupper() for c in letters):
            return "upper"
        if letters and all(c.islower() for c in letters):
            return "lower"
        return None

    return _alternation([kind(w) for w in words(text)])


@register("no_letters")
def no_letters(text: str) -> float:
    """Fraction of non-space characters that are not letters (the original also counted spaces)."""
    chars = [c for c in text if not c.isspace()]
    return _fraction(not c.isalpha() for c in chars)


@register("digits_only")
def digits_only(text: str) -> float:
    """Fraction of non-space characters that are digits (the original also counted spaces)."""
    chars = [c for c in text if not c.isspace()]
    return _fraction(c.isdigit() for c in chars)


@register("dash_separated")
def dash_separated(text: str) -> float:
    """Fraction of dash-separated chunks that are a single character ("L-o-n-d-o-n").

    Whitespace between dashed words is tolerated; the original counted it inside chunks.
    """
    chunks = [c for w in text.split() for c in w.split("-") if c]
    return _fraction(len(c) == 1 for c in chunks)


# --------------------------------------------------------------------------- words


# A cut-off reply has at least as many words as it shows, so one already longer than `n`
# is a true violation (the usual drift for "exactly 10 words"): scored, not "truncated".
@register("word_count")
def word_count(text: str, n: Annotated[int, Field(ge=1)]) -> float:
    """min(count, n) / max(count, n): 1 for exactly `n` words, falling off on both sides.

    Equals the original for n = 1 (1 / words); for n = 10 it replaces the original's linear
    ramp 1 - |count - 10| / 10, which is already 0 at 20 words, by this ratio.
    """
    c = len(words(text))
    return min(c, n) / max(c, n) if c else 0.0


@register("min_words", needs_complete=True)
def min_words(text: str, target: Annotated[int, Field(ge=1)]) -> float:
    """min(1, words / target): rewards long replies, saturating at `target` words.

    Replaces the original 1 - 1/(1 + words^(1/3)), which gave a 7-word reply 0.66. Needs a
    complete reply: one cut off by the token limit was still going, which is what is asked.
    """
    return min(1.0, len(words(text)) / target)


@register("first_equals_last", needs_complete=True)
def first_equals_last(text: str) -> float:
    """1 if the first and last words are the same word (case-insensitive), else 0."""
    ws = [w.lower() for w in words(text)]
    return float(bool(ws) and ws[0] == ws[-1])


@register("unique_words")
def unique_words(text: str) -> float:
    """Fraction of words (case-insensitive) that occur only once."""
    ws = [w.lower() for w in words(text)]
    counts = Counter(ws)
    return _fraction(counts[w] == 1 for w in ws)


@register("repeated_words")
def repeated_words(text: str) -> float:
    """Fraction of words (case-insensitive) that occur at least twice.

    Counts occurrences, not distinct words: the original divided distinct repeated words by
    all words, which caps a perfect reply at 0.5.
    """
    ws = [w.lower() for w in words(text)]
    counts = Counter(ws)
    return _fraction(counts[w] >= 2 for w in ws)


@register("doubled_words")
def doubled_words(text: str) -> float:
    """Fraction of words that sit in a doubled pair ("like like so so").

    The original compared each word with the next one repeated twice ("so" == "soso") and
    so scored every reply 0.
    """
    ws = [w.lower() for w in words(text)]
    pairs = sum(1 for i in range(0, len(ws) - 1, 2) if ws[i] == ws[i + 1])
    return 2 * pairs / len(ws) if ws else 0.0


@register("interleaved_word")
def interleaved_word(text: str, word: Annotated[str, Field(min_length=1)]) -> float:
    """How well `word` alternates with other words ("banana Visit banana the ...")."""
    target = word.lower()
    return _alternation([w.lower() == target for w in words(text)])


@register("alternating_length")
def alternating_length(text: str, max_short: Annotated[int, Field(ge=1)] = 4) -> float:
    """How well short (<= max_short letters) and long words alternate."""
    return _alternation([sum(c.isalpha() for c in w) > max_short for w in words(text)])


@register("starts_with_word")
def starts_with_word(text: str, word: Annotated[str, Field(min_length=1)]) -> float:
    """1 if the reply's first word is `word` (case-insensitive), else 0."""
    ws = words(text)
    return float(bool(ws) and ws[0].lower() == word.lower())


@register("sentences_start_with")
def sentences_start_with(text: str, word: Annotated[str, Field(min_length=1)]) -> float:
    """Fraction of sentences whose first word is `word` (case-insensitive).

    The original compared a lower-cased word with "Yes" (never equal) and checked "Yes" for
    the fb4u39 prompt; here the comparison is case-insensitive and uses the prompt's word.
    """
    firsts = [words(s)[0].lower() for s in sentences(text)]
    return _fraction(f == word.lower() for f in firsts)


def _check_regex(params: dict[str, Any]) -> None:
    try:
        re.compile(params["pattern"])
    except re.error as err:
        raise ValueError(f"pattern is not a valid regular expression: {err}") from None


@register("words_matching", check=_check_regex)
def words_matching(text: str, pattern: Annotated[str, Field(min_length=1)]) -> float:
    """Fraction of words that fully match the regular expression `pattern` (case-insensitive)."""
    rx = re.compile(pattern, re.IGNORECASE)
    return _fraction(rx.fullmatch(w) is not None for w in words(text))


# --------------------------------------------------------------------------- sentences


@register("sentence_count", needs_complete=True)
def sentence_count(text: str, n: Annotated[int, Field(ge=1)]) -> float:
    """1 if the reply has exactly `n` sentences, else 0 (sentence splitting is rule-based)."""
    return float(len(sentences(text)) == n)


@register("sentence_lengths", needs_complete=True)
def sentence_lengths(
    text: str, pattern: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
) -> float:
    """Sentence-by-sentence match of word counts to `pattern`.

    0 unless the number of sentences equals len(pattern); otherwise each sentence earns 1
    for the exact count and 0.5 when off by one, averaged (as in the original).
    """
    sents = sentences(text)
    if len(sents) != len(pattern):
        return 0.0
    score = 0.0
    for sent, want in zip(sents, pattern):
        got = len(words(sent))
        score += 1.0 if got == want else 0.5 if abs(got - want) == 1 else 0.0
    return score / len(sents)


@register("increasing_sentence_lengths", needs_complete=True)
def increasing_sentence_lengths(text: str) -> float:
    """Fraction of sentences with exactly one word more than the previous (the first has 1)."""
    lengths = [len(words(s)) for s in sentences(text)]
    return _fraction(cur == prev + 1 for prev, cur in zip([0, *lengths], lengths))


@register("questions", needs_complete=True)
def questions(text: str) -> float:
    """Fraction of sentences that end with a question mark."""
    return _fraction(s.rstrip("\"'”’)]").endswith("?") for s in sentences(text))


# --------------------------------------------------------------------------- mentions


@register("mentions_any")
def mentions_any(
    text: str,
    terms: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
    avoid: list[str] = [],  # noqa: B006 - never mutated; a plain list keeps the params schema simple
) -> float:
    """1 if any of `terms` occurs and none of `avoid` does, else 0.

    Matching is case-insensitive on whole tokens, ignoring punctuation ("Magic: The
    Gathering" matches "magic the gathering", "20,568" matches "20568"); a trailing '*'
    matches a prefix ("printer*" matches "printers").
    """
    norm = _normalize(text)
    return float(any(_has_term(norm, t) for t in terms) and not any(_has_term(norm, t) for t in avoid))


@register("mentions_all")
def mentions_all(
    text: str,
    terms: Annotated[list[str | list[str]], Field(min_length=1)],
) -> float:
    """Fraction of `terms` that occur; a term given as a list counts if any of its alternatives occurs.

    Same matching rules as `mentions_any`.
    """
    norm = _normalize(text)
    return _fraction(any(_has_term(norm, a) for a in ([t] if isinstance(t, str) else t)) for t in terms)


@register("avoids_words")
def avoids_words(
    text: str, terms: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
) -> float:
    """1 if none of `terms` occurs, else 0 (same matching rules as `mentions_any`).

    Contractions are split, so "it's" uses the forbidden pronoun "it".
    """
    norm = _normalize(text)
    return float(not any(_has_term(norm, t) for t in terms))


@register("avoided_terms")
def avoided_terms(
    text: str, terms: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
) -> float:
    """1 - (share of `terms` that occur), same matching rules as `mentions_any`.

    Partial credit, as the original gave its list of fifteen forbidden words: pass/fail
    (`avoids_words`) is 0 for nearly every reply to such a list, so it could not show drift.
    """
    norm = _normalize(text)
    return _fraction(not _has_term(norm, t) for t in terms)


@register("replies_only_with")
def replies_only_with(text: str, phrase: Annotated[str, Field(min_length=1)]) -> float:
    """Share of the reply taken by `phrase`: 1 for the phrase alone, less for extra words, 0 without it.

    Compared on tokens, so case and punctuation do not matter ("apples" = "Apples.").
    The original only required the phrase to appear somewhere.
    """
    toks, want = _tokens(text), _tokens(phrase)
    n = len(want)
    if not want or not any(toks[i : i + n] == want for i in range(len(toks) - n + 1)):
        return 0.0
    return n / len(toks)


_COLORS = (
    "red blue green yellow orange purple pink brown black white gray grey violet indigo magenta cyan aqua "
    "teal maroon navy olive beige tan coral turquoise lavender lilac gold golden silver bronze ivory "
    "charcoal ultramarine saffron sienna taupe burgundy fuchsia cerulean azure periwinkle sapphire crimson "
    "scarlet ochre sepia mauve khaki emerald amber jade ruby"
).split()
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
_TENS = "thirty forty fifty sixty seventy eighty ninety hundred thousand million dozen".split()


@register("color_and_number")
def color_and_number(text: str) -> float:
    """1 if the reply names a colour and a number (digits or a number word), else 0.

    Colours come from a fixed list of about 50 names: the original's single-word colours
    without those that are mostly food ("salmon", "cream", "chocolate"), which a London
    answer mentions as food. Whole words only, so "bored" no longer counts as "red" as it
    did in the original.
    """
    toks = set(_tokens(text))
    has_color = any(c in toks for c in _COLORS)
    has_number = any(t.isdigit() for t in toks) or any(w in toks for w in (*_NUMBER_WORDS, *_TENS))
    return float(has_color and has_number)


def _first_number(text: str) -> int | None:
    """The first number in the text, written in digits or as a word from zero to twenty."""
    for tok in _tokens(text):
        if tok.isdigit():
            return int(tok)
        if tok in _NUMBER_WORDS:
            return _NUMBER_WORDS.index(tok)
    return None


@register("close_to_number")
def close_to_number(text: str, target: Annotated[int, Field(ge=1)]) -> float:
    """1 - |first number - target| / target, floored at 0; 0 if the reply has no number."""
    found = _first_number(text)
    if found is None:
        return 0.0
    return max(0.0, 1.0 - abs(found - target) / target)


# --------------------------------------------------------------------------- formats


def _json_object(text: str) -> dict[str, Any] | None:
    """The JSON object in a reply, also when the model left out the braces.

    Lenient since the table's text of the prompt had lost its braces (they are restored now).
    """
    start, end = text.find("{"), text.rfind("}")
    candidates = [text[start : end + 1]] if 0 <= start < end else []
    candidates.append("{" + text.strip().strip(",") + "}")
    for candidate in candidates:
        try:
            obj = json.loads(candidate)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the decoder allows
            continue
        if isinstance(obj, dict):
            return obj
    return None


@register("json_keys", needs_complete=True)
def json_keys(text: str, keys: Annotated[list[str], Field(min_length=1)]) -> float:
    """Fraction of `keys` present in the JSON object of the reply; 0 if no object parses.

    The original only regex-matched '{"thought":.*, "response":.*}'; this parses the JSON.
    """
    obj = _json_object(text)
    return _fraction(k in obj for k in keys) if obj is not None else 0.0


@register("bracketed_list", needs_complete=True)
def bracketed_list(text: str) -> float:
    """Fraction of the items of the first [a, b, ...] list that are single words; 0 without a list."""
    m = re.search(r"\[([^\[\]]*)\]", text)
    if not m:
        return 0.0
    items = [item.strip() for item in m.group(1).split(",") if item.strip()]
    return _fraction(len(item.split()) == 1 for item in items)


# --------------------------------------------------------------------------- choices


def _option_map(options: list[str] | dict[str, str]) -> dict[str, str]:
    return {o: o for o in options} if isinstance(options, list) else dict(options)


def chosen_option(text: str, options: list[str] | dict[str, str]) -> str | None:
    """The option label a reply picks, or None if no single option can be identified.

    `options` maps labels to option texts ({"A": "Water", ...}); a plain list means each
    word is both label and text (["advocate", "opposed"]). Cues are tried from most to least
    explicit, after dropping markdown emphasis and quotes; the first cue that names exactly
    one option wins, a cue naming several is skipped:
    1. the whole reply is a letter: "C", "(C)", "C)", "**C**";
    2. an answer phrase: "The answer is C", "I'd pick C";
    3. a letter with a bracket anywhere: "The answer is C) Fire";
    4. a leading letter with punctuation: "C. Fire", "C - Fire";
    5. an option's text: "Fire, definitely." (a '*' suffix in a text is a prefix match;
       an option text inside a longer matched one, "GPT-3" in "GPT-3.5", is dropped);
    6. a lone capital letter ("I'd say C").
    In cues 2 and 6 a capital "A" or "I" followed by a lower-case word other than a
    conjunction is read as a word ("is A great city"), not as an option ("A or C").
    """
    opts = _option_map(options)
    clean = re.sub(r"[*_`\"“”]", "", text).strip()
    letters = "".join(label for label in opts if re.fullmatch(r"[A-Z]", label))
    if re.fullmatch(r"\(?[a-z]\)?[.):]?", clean):
        clean = clean.upper()
    if letters:
        cls = f"[{letters}]"
        cues = [
            (rf"^\(?({cls})\)?[.):]?$", False),  # a lone lower-case letter was upper-cased above
            (
                # one optional "is"/":" with its spaces, not `\s*(...)?\s*`: two adjacent \s* made
                # a long run of spaces quadratic
                rf"\b(?i:answer|option|choice|choose|pick|select|go with|say|is)\s*(?:(?i:is|would be|=|:)\s*)?\(?({cls})(?![\w'’])",
                True,
            ),
            (rf"(?<![\w'’])\(?({cls})\)", False),
            (rf"^({cls})\s*[.):,\-–—]", False),
        ]
        for pattern, guard in cues:
            found = _letters_found(pattern, clean, guard)
            if len(found) == 1:
                return found.pop()
    norm = _normalize(clean)
    hits = {label: _normalize(t.rstrip("*")) for label, t in opts.items() if _has_term(norm, t)}
    hits = {label: t for label, t in hits.items() if not any(t != u and t in u for u in hits.values())}
    if len(hits) == 1:
        return hits.popitem()[0]
    if letters:
        found = _letters_found(rf"(?<![\w'’])([{letters}])(?![\w'’])", clean, guard=True)
        if len(found) == 1:
            return found.pop()
    return None


_WORD_AFTER_RE = re.compile(r"\s+(?!(?:or|and|nor|vs)\b)[a-z]")


def _letters_found(pattern: str, text: str, guard: bool) -> set[str]:
    """Letters captured by `pattern`; with `guard`, skip "A"/"I" followed by a lower-case word."""
    found = set()
    for m in re.finditer(pattern, text):
        letter = m.group(1)
        # match at a position, not on a slice: slicing copied the rest of the text per letter
        if guard and letter in "AI" and _WORD_AFTER_RE.match(text, m.end(1)):
            continue
        found.add(letter)
    return found


def _check_choice(params: dict[str, Any]) -> None:
    labels = _option_map(params["options"])
    if params["answer"] not in labels:
        raise ValueError(f"answer {params['answer']!r} is not one of the options {sorted(labels)}")


@register("choice", check=_check_choice)
def choice(
    text: str,
    answer: Annotated[str, Field(min_length=1)],
    options: Annotated[list[str] | dict[str, str], Field(min_length=2)],
) -> float:
    """1 if the reply picks option `answer` (see `chosen_option` for the parsing), else 0.

    The original tested `"C" in reply`, which any reply containing a capital C passed.
    """
    return float(chosen_option(text, options) == answer)


# --------------------------------------------------------------------------- lexicon-based


@functools.cache
def _vader() -> Any:
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


@register("sentiment")
def sentiment(text: str, field: Literal["pos", "neg", "neu", "compound"], invert: bool = False) -> float:
    """A VADER sentiment score (vaderSentiment's lexicon and rules).

    `pos`/`neg`/`neu` are the shares of the text carrying that polarity, so even a very
    joyful reply rarely exceeds about 0.6: compare these scores across turns, not with a
    fixed threshold. `compound` (in [-1, 1]) is rescaled to [0, 1]; `invert` returns 1 - score.
    VADER is a lexicon method tuned for social-media English: sarcasm, negated clauses and
    other languages are read loosely. Its time is quadratic in the words of a text with "but",
    so a reply over 10,000 characters is scored on an evenly spaced sample of its sentences
    (`_sample`).
    """
    value = float(_vader().polarity_scores(_sample(text))[field])
    if field == "compound":
        value = (value + 1.0) / 2.0
    return 1.0 - value if invert else value


_TEEN_SLANG = frozenset(
    "dude lol smh ya omg idk imo imho brb ttyl bae fomo yolo slay lit savage ghosting thirsty flex gucci "
    "lowkey highkey fam shook stan clapback extra salty vibe finna woke squad bet receipts ship snack yeet "
    "vibing didnt yeah yo isnt im cant wont u like lotsa selfie sum iffy bout em dope haha unis thng every1s "
    "whatevs 2 tbh thats aight totally insta fb twitter snapchat tiktok drill cray netflix n tho oh memes b "
    "hes shes whats obvi duh np bro biggue brainfart man loads gotta chk sick btw mate hit crazy af iconic ur "
    "rly bruh ull youll dig theres".split()
)


@register("slang_words")
def slang_words(text: str) -> float:
    """Fraction of tokens on the original's list of about 120 teenage-slang words ("lol", "u", "tbh", ...).

    Approximate by construction: a fixed word list, which also contains common words such
    as "like" and "totally"; a perfectly slangy reply still scores well below 1.
    """
    toks = _tokens(text)
    return _fraction(t in _TEEN_SLANG for t in toks)


def _plain_words(text: str) -> list[str]:
    """Lower-case words for dictionary look-ups: hyphenated words split, words with digits dropped."""
    parts = (p for w in words(text) for p in w.lower().replace("’", "'").split("-"))
    return [p for p in parts if p and not any(c.isdigit() for c in p)]


@functools.cache
def _frequent_words(top_n: int) -> frozenset[str]:
    from wordfreq import top_n_list

    return frozenset(top_n_list("en", top_n))


@register("rare_words")
def rare_words(text: str, top_n: Annotated[int, Field(ge=100)] = 10000) -> float:
    """Fraction of words that are not among the `top_n` most frequent English words (wordfreq).

    The original used the Google 10,000-word list downloaded at import; wordfreq's list is
    shipped with the package and built from several corpora, so borderline words differ.
    Hyphenated words count as their parts; words with digits are ignored.
    """
    ws = _plain_words(text)
    common = _frequent_words(top_n)
    return _fraction(w not in common for w in ws)


@functools.lru_cache(maxsize=1 << 16)  # bounded: a long reply of made-up words must not grow it forever
def _syllables(word: str) -> int:
    """Syllables per the CMU Pronouncing Dictionary; a vowel-group estimate for unlisted words."""
    import pronouncing

    phones = pronouncing.phones_for_word(word)
    if phones:
        return min(pronouncing.syllable_count(p) for p in phones)
    groups = len(re.findall(r"[aeiouy]+", word))
    if word.endswith("e") and not word.endswith(("le", "ee")) and groups > 1:
        groups -= 1
    return max(1, groups)


@register("syllable_limit")
def syllable_limit(text: str, max_syllables: Annotated[int, Field(ge=1)] = 1) -> float:
    """Fraction of words with at most `max_syllables` syllables (CMU dict via `pronouncing`).

    Words missing from the CMU dict (names, slang) get a vowel-group estimate, which is
    usually right for short words; hyphenated words count as their parts and words with
    digits are ignored. Where a word has
    several pronunciations the shortest counts. The original checked a downloaded list of
    one-syllable words.
    """
    return _fraction(_syllables(w) <= max_syllables for w in _plain_words(text))


@functools.cache
def _tagger() -> Callable[[str], list[tuple[str, str]]]:
    # TextBlob's PatternTagger: the Brill-style tagger of the `pattern` library, whose
    # lexicon and rules ship inside the textblob wheel (nltk's taggers need a data download).
    from textblob.en import tag

    return lambda text: [(w, t) for w, t in tag(text, tokenize=True)]


def _pos_tags(text: str) -> list[tuple[str, str]]:
    """Penn Treebank tags of the word tokens (punctuation dropped), of `_sample(text)`.

    The pure-Python tagger takes seconds on a megabyte; the measures built on it are shares,
    which an evenly spaced sample of the sentences of a reply over 10,000 characters estimates well.
    """
    return [(w, t) for w, t in _tagger()(_sample(text)) if any(c.isalnum() for c in w)]


@register("plural_nouns")
def plural_nouns(text: str) -> float:
    """Fraction of words tagged as plural nouns (NNS, NNPS).

    Part-of-speech tags come from TextBlob's PatternTagger (a lexicon plus contextual rules,
    about 95% accurate on news text; looser on unusual style). A high score means roughly
    a third of the words or more, since function words and verbs are needed too.
    """
    tags = _pos_tags(text)
    return _fraction(t in ("NNS", "NNPS") for _, t in tags)


@register("past_tense_verbs")
def past_tense_verbs(text: str) -> float:
    """Fraction of verbs tagged past tense or past participle (VBD, VBN); 1 if there are no verbs.

    Tagged by TextBlob's PatternTagger (see `plural_nouns`); modals ("can", "will") are not
    verbs in the Penn tag set, so "you can visit" counts one present verb.
    """
    verbs = [t for _, t in _pos_tags(text) if t.startswith("VB")]
    return _fraction(t in ("VBD", "VBN") for t in verbs) if verbs else 1.0


# --------------------------------------------------------------------------- languages


@functools.cache
def _langdetect() -> Callable[[str], list[Any]]:
    """detect_langs on a private factory seeded 0.

    langdetect samples n-grams at random; its module-level detector reads the global
    `DetectorFactory.seed` at every call, so any other code that seeds langdetect would
    change our scores. A factory of our own with its own seed (an instance attribute)
    keeps the measure deterministic whatever else runs in the process.
    """
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.set_seed(0)

    def detect_langs(text: str) -> list[Any]:
        detector = factory.create()
        detector.append(text)
        return detector.get_probabilities()

    return detect_langs


@functools.cache
def _langdetect_codes() -> frozenset[str]:
    """The codes langdetect can return ("fr", "zh-cn", ...): the names of its shipped profiles."""
    from langdetect.detector_factory import PROFILES_DIRECTORY

    return frozenset(os.listdir(PROFILES_DIRECTORY))


def _check_languages(*fields: str) -> Callable[[dict[str, Any]], None]:
    """A params check that each of `fields` (when given) is a code langdetect can return.

    Any other code ("french", "FR", "fr-FR") would load fine and then score every reply 0.
    """

    def check(params: dict[str, Any]) -> None:
        known = _langdetect_codes()
        for field in fields:
            code = params.get(field)
            if code is not None and code not in known:
                close = difflib.get_close_matches(code.lower()[:2], known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{field} {code!r} is not a language code langdetect knows.{hint} "
                    f"Use one of: {', '.join(sorted(known))}"
                )

    return check


# langdetect reads at most 10,000 characters (its max_text_length), but first runs URL and
# e-mail regexes over the whole string; it gets twice that, so a megabyte costs nothing more.
_LANGDETECT_CHARS = 20_000


def _language_probs(text: str) -> dict[str, float]:
    """langdetect's language -> probability; empty when the text has no letters."""
    from langdetect.lang_detect_exception import LangDetectException

    text = text[:_LANGDETECT_CHARS]
    if not any(c.isalpha() for c in text):
        return {}
    try:
        return {r.lang: float(r.prob) for r in _langdetect()(text)}
    except LangDetectException:
        return {}


def _top_language(text: str) -> str | None:
    probs = _language_probs(text)
    return max(probs, key=probs.__getitem__) if probs else None


@register("language", check=_check_languages("lang"))
def language(text: str, lang: Annotated[str, Field(min_length=2)]) -> float:
    """langdetect's probability that the reply is in `lang` (ISO 639-1 code, e.g. "fr").

    langdetect (seeded, so deterministic) is reliable on a sentence or more; on a few
    words it can be wrong, and a mixed-language reply gets a split probability.
    """
    return _language_probs(text).get(lang, 0.0)


_BRACKET_RE = re.compile(r"\(([^()]+)\)")
#: translated_pairs scores at most this many pairs (evenly spaced): two langdetect calls each.
_MAX_PAIRS = 16


def _translated_pairs(text: str) -> list[tuple[str, str]]:
    r"""The (sentence, bracketed translation) pairs of a text, in linear time.

    The same pairs as `re.findall(r"([^()]+?)\s*\(([^()]+)\)", text)` (the sentence without
    its trailing spaces): an innermost bracket with the text since the previous bracket
    character. That regex retried its lazy prefix from every position and took quadratic
    time on text without brackets (100 KB: 100 s).
    """
    pairs, prev = [], 0
    for m in _BRACKET_RE.finditer(text):
        lo = max(prev, text.rfind("(", prev, m.start()) + 1, text.rfind(")", prev, m.start()) + 1)
        if lo < m.start():
            source = text[lo : m.start()].rstrip() or text[lo]
            pairs.append((source, m.group(1)))
        prev = m.end()
    return pairs


@register("translated_pairs", check=_check_languages("source", "target"))
def translated_pairs(
    text: str,
    source: Annotated[str, Field(min_length=2)] = "fr",
    target: Annotated[str, Field(min_length=2)] = "en",
) -> float:
    """How well the reply alternates `source`-language sentences with (target-language translations).

    Each "sentence (translation)" pair earns 0.5 if the sentence is detected as `source`
    and 0.5 if the bracketed part is detected as `target`; the score is the mean over pairs,
    0 without pairs. Detection on short pieces ("Bonjour !") is the weak spot (see `language`).
    A reply with more than 16 pairs is scored on 16 evenly spaced ones, which bounds the
    langdetect calls (a few milliseconds each) for any length.
    """
    pairs = _translated_pairs(text)
    if len(pairs) > _MAX_PAIRS:
        pairs = [pairs[i * len(pairs) // _MAX_PAIRS] for i in range(_MAX_PAIRS)]
    scores = [
        0.5 * (_top_language(src.strip(" .,;:!?")) == source) + 0.5 * (_top_language(tgt) == target)
        for src, tgt in pairs
    ]
    return sum(scores) / len(scores) if scores else 0.0


@register("translation", check=_check_languages("lang"))
def translation(
    text: str,
    lang: Annotated[str, Field(min_length=2)],
    must_contain: list[str] = [],  # noqa: B006 - never mutated
    max_words: Annotated[int, Field(ge=1)] = 30,
) -> float:
    """Probability that the reply is a short `lang` translation: P(lang) if it has at most
    `max_words` words and contains every `must_contain` term, else 0.

    The original required "Londres" and fewer than 20 words, without a language check.
    """
    if len(words(text)) > max_words:
        return 0.0
    if must_contain and mentions_all(text, must_contain) < 1.0:
        return 0.0
    return language(text, lang)
