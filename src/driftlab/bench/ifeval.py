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
would fetch at import): `NEEDS_NLTK_DATA` are refused in one line. IFBench's 58 newer types are
`bench.ifbench`'s; both share `bench.constraints.Suite`.
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

from driftlab.bench.constraints import MAX_CHARS, Suite, seeded_langdetect, standing_instruction
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
#: `combination:repeat_prompt` repeats the user's request: one turn's, not a standing instruction.
NOT_STANDING = frozenset({"combination:repeat_prompt"})


def _load() -> dict[str, Any]:
    """lm-eval's IFEval registry (instruction id -> checker class).

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


SUITE = Suite(
    name=CATEGORY, title="IFEval", instructions=INSTRUCTIONS, prefix_judgeable=PREFIX_JUDGEABLE, load=_load,
    refused={**dict.fromkeys(NEEDS_NLTK_DATA, "its checker needs nltk's punkt data, which driftlab never downloads"),
             **dict.fromkeys(NOT_STANDING, "it repeats one user request, not a standing instruction")},
    calling=seeded_langdetect,  # (upstream's language checks draw at random unless seeded)
)
registry, checker, ready, description = SUITE.registry, SUITE.checker, SUITE.ready, SUITE.description
ifeval = SUITE.register_measure()
__all__ = ["CATEGORY", "INSTRUCTIONS", "MAX_CHARS", "SUITE", "checker", "description", "ifeval", "ready", "registry",
           "seeded_langdetect", "standing_instruction"]
