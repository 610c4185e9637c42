"""Verifiable-instruction benchmarks as standing system prompts, scored by their own checkers.

Why: a persona's measure is driftlab's reading of its prompt; IFEval's and IFBench's instructions
are the field's shared ones, each with a deterministic checker that other papers' numbers come
from. driftlab never copies a checker: a `Suite` builds upstream's own with the persona's
arguments and returns its verdict as 0 or 1, as upstream's strict scoring does. Both suites share
this one definition (the argument checks, the cache of built checkers, the measure); each only
says where its checkers come from and which of them driftlab can run (`bench.ifeval`,
`bench.ifbench`).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from driftlab.bench.measures import register
from driftlab.errors import DriftlabError

#: The longest reply the checkers judge. Upstream's are not bounded: IFEval's placeholder regex takes
#: quadratic time on unclosed brackets (minutes on a megabyte), the English check runs langdetect on
#: all of it. 10,000 characters is ~2,500 tokens, far above any reply a replay generates (200 by default).
MAX_CHARS = 10_000


def standing_instruction(description: str) -> str:
    """A constraint persona's system prompt: upstream's description, made to hold for every reply."""
    return f"In every reply, whatever the user asks, follow this instruction: {description}"


@dataclass(frozen=True)
class Suite:
    """One benchmark's checkers: where they come from, which ids driftlab offers, how to call them.

    `load` returns upstream's registry (instruction id -> checker class); `calling` is the context
    every build and check runs in (a seeded langdetect, nltk's downloader muted); `refused` maps an
    id driftlab cannot offer to the reason, said in one line before any work.
    """

    name: str  # the measure and the constraint personas' category
    title: str  # as papers write it
    instructions: tuple[str, ...]
    prefix_judgeable: frozenset[str]  # a violation in a prefix is one in the whole reply
    refused: dict[str, str]
    load: Callable[[], dict[str, Any]]
    calling: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    _built: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False, compare=False)

    def registry(self) -> dict[str, Any]:
        return _registry(self.name, self.load)

    def check_params(self, params: dict[str, Any]) -> None:
        """One line for an id upstream has not, or one driftlab cannot check (before any reply)."""
        name = params.get("instruction")
        if name not in self.instructions:
            raise ValueError(f"unknown {self.title} instruction {name!r}; one of: {', '.join(self.instructions)}")
        if name in self.refused:
            raise ValueError(f"{self.title} instruction {name!r} is not offered: {self.refused[name]}")

    def checker(self, instruction: str, kwargs: dict[str, Any] | None = None) -> Any:
        """Upstream's checker of `instruction` built with `kwargs` (all of its arguments: upstream draws
        a missing one at random, so a persona must name each; a DriftlabError says which is missing).
        Built once per instruction and arguments: a run scores every reply with it."""
        key = (instruction, json.dumps(dict(kwargs or {}), sort_keys=True))
        if key not in self._built:
            self._built[key] = self._build(instruction, json.loads(key[1]))
        return self._built[key]

    def _build(self, instruction: str, kwargs: dict[str, Any]) -> Any:
        found = self.registry()[instruction](instruction)
        missing = set(found.get_instruction_args_keys()) - set(kwargs)
        if missing:
            first = sorted(missing)[0]
            raise DriftlabError(
                f"{self.title} instruction {instruction!r} needs its arguments {sorted(missing)} (upstream would "
                "draw them at random).", hint=f"name them in the params' kwargs, e.g. --measure-params "
                f"'{{\"instruction\": \"{instruction}\", \"kwargs\": {{\"{first}\": ...}}}}'")
        try:
            with self.calling():
                found.build_description(**kwargs)
        except (TypeError, ValueError, KeyError) as err:  # an argument upstream cannot take, or of the wrong type
            raise DriftlabError(f"{self.title} instruction {instruction!r} cannot take the arguments {kwargs}: {err}.",
                                hint="`driftlab personas measures` and docs/personas.md name each one's arguments.") from None
        return found

    def description(self, instruction: str, kwargs: dict[str, Any] | None = None) -> str:
        """Upstream's text of the instruction with these arguments (what its prompts say)."""
        with self.calling():
            return self.registry()[instruction](instruction).build_description(**dict(kwargs or {}))

    def ready(self, personas: list[Any]) -> None:
        """Build the checker of every persona of this suite among `personas` (a run's agents) before any
        work: the checkers missing or an argument left out is one line then, not an error at the first reply."""
        for persona in personas:
            if persona.measure == self.name:
                self.checker(persona.params["instruction"], persona.params.get("kwargs"))

    def score(self, text: str, instruction: str, kwargs: dict[str, Any]) -> float:
        """1 where upstream's checker passes the reply, else 0 (its strict verdict). A reply over
        `MAX_CHARS` is not judged (an error the run records); input too deep for a checker's parser,
        where upstream raises RecursionError, fails (0)."""
        if len(text) > MAX_CHARS:
            raise ValueError(f"a reply of {len(text):,} characters: {self.title}'s checkers judge at most "
                             f"{MAX_CHARS:,}")
        found = self.checker(instruction, kwargs)
        try:
            with self.calling():
                return float(bool(found.check_following(text)))
        except RecursionError:
            return 0.0

    def register_measure(self) -> Callable[..., float]:
        """Register the suite's measure (`--measure NAME`, a constraint persona's) with driftlab's measures."""

        def measure(text: str, instruction: str, kwargs: dict[str, Any] = {}) -> float:  # noqa: B006 - never mutated
            return self.score(text, instruction, kwargs)

        measure.__doc__ = f"1 where {self.title}'s own checker of `instruction` (built with `kwargs`) passes the reply."
        needs_complete = functools.partial(_needs_complete, self.prefix_judgeable)
        return register(self.name, check=self.check_params, needs_complete=needs_complete)(measure)


def _needs_complete(prefix_judgeable: frozenset[str], params: dict[str, Any]) -> bool:
    """Every type outside `prefix_judgeable` can only judge a complete reply (an end phrase, a count,
    closing JSON): a reply cut off by the token limit scores None for them."""
    return params.get("instruction") not in prefix_judgeable


@functools.cache
def _registry(name: str, load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A suite's registry, imported once per process."""
    return load()


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
