"""PASTA's four tasks (PASTA paper Sec. 4, App. A.1), registered by name, and their baselines.

A task turns a data row into a prompt made of three parts: text before the emphasised
span, the span, and text after it. The baselines differ only in how the span is shown:

* `zero-shot` — plain text;
* `marked` — the span between asterisks, visible to the model (markdown-style emphasis);
* `quoted` — the span between double quotes;
* `few-shot` — plain text after 3 demonstrations (train rows, as earlier chat turns);
* `pasta` — plain text, with the span emphasised by attention steering (the span is
  passed as `*...*` markup, which the backend turns into emphasis and removes).

Generation tasks (JSON formatting, pronoun changing) score a greedy reply; scoring tasks
(BiasBios, CounterFact) compare log-likelihoods of candidate answers as the start of the
assistant's reply. Chat models get the whole prompt as one user message: the paper's
models were base models with raw text, so absolute numbers are not comparable to its
Table 1, only the direction of each baseline against zero-shot.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator, TypeAdapter

from driftlab.errors import DriftlabError
from driftlab.pasta import metrics
from driftlab.pasta.datasets import OCCUPATIONS, Bio, Fact, load_bios, load_facts, occupation_label
from driftlab.steering.interventions import did_you_mean

BASELINES = ("zero-shot", "marked", "quoted", "few-shot", "pasta")
N_SHOTS = 3
#: Instruction wordings (App. A.1; Table 4 measures how much each task's score depends on them).
PROMPTS = ("original", "shortened", "rephrased")
PromptName = Literal["original", "shortened", "rephrased"]


@dataclass(frozen=True)
class Prompt:
    before: str
    span: str
    after: str = ""

    def render(self, baseline: str) -> str:
        if baseline == "marked":
            return f"{self.before}*{self.span}*{self.after}"
        if baseline == "quoted":
            return f'{self.before}"{self.span}"{self.after}'
        if baseline == "pasta":  # markup for the backend: literal asterisks in the text are escaped
            esc = lambda s: s.replace("*", "\\*")  # noqa: E731
            return f"{esc(self.before)}*{esc(self.span)}*{esc(self.after)}"
        return f"{self.before}{self.span}{self.after}"


@dataclass(frozen=True)
class Example:
    """One prompt and what scoring it needs."""

    id: str
    prompt: Prompt
    answer: str  # the reference answer (a demonstration's reply; the target of scoring tasks)
    candidates: tuple[str, ...] = ()  # scoring tasks: answers compared by log-likelihood
    target: int = 0  # index of the right candidate
    extra: dict = field(default_factory=dict, compare=False)  # task-specific (paraphrase prompts, the bio)


#: Examples as JSON (a protocol's plan records the examples it will answer).
EXAMPLES: TypeAdapter[list[Example]] = TypeAdapter(list[Example])


@dataclass(frozen=True)
class Task:
    """A registered task: data, prompts, how it is answered and scored."""

    name: str
    mode: Literal["generate", "score"]
    primary: str  # the metric head profiling ranks by
    max_new_tokens: int
    description: str
    prompts: tuple[str, ...] = ("original",)  # the instruction wordings it has

    def examples(self, split: str, n: int | None = None, data: str | None = None,
                 prompt: str = "original") -> list[Example]:
        self.check_prompt(prompt)
        rows = _ROWS[self.name](data, split)
        out = [_BUILD[self.name](row, prompt) for row in rows]
        return out[:n] if n is not None else out

    def check_prompt(self, prompt: str) -> None:
        if prompt not in self.prompts:
            raise DriftlabError(f"Task {self.name} has no '{prompt}' prompt.",
                                hint=f"Its prompts: {', '.join(self.prompts)} (the paper rewords only JSON "
                                     "formatting and pronoun changing).")

    def conversation(self, example: Example, baseline: str, shots: Sequence[Example] = ()) -> list[dict]:
        if baseline not in BASELINES:
            raise DriftlabError(f"Unknown baseline '{baseline}'.", hint=f"Use one of {', '.join(BASELINES)}.")
        conv: list[dict] = []
        if baseline == "few-shot":
            for demo in shots:
                conv += [{"role": "user", "content": demo.prompt.render("zero-shot")},
                         {"role": "assistant", "content": demo.answer}]
        conv.append({"role": "user", "content": example.prompt.render(baseline)})
        return conv

    def score_reply(self, example: Example, text: str, data: str | None = None) -> dict[str, float]:
        """Per-example metrics of a generated reply (generation tasks); `data` is the data file
        the example came from (consistency is measured against that file's bios)."""
        if self.name == "json":
            ok = metrics.json_format_ok(text)
            pred = metrics.json_prediction_ok(text, example.extra["occupation"]) if ok else False
            return {"format_acc": float(ok), "prediction_acc": float(pred), "score": (ok + pred) / 2}
        if self.name == "pronouns":
            changed, all_changed = metrics.pronoun_scores(text)
            return {"acc": float(changed), "all_acc": float(all_changed), "they_acc": float(metrics.they_rewrite(text)),
                    **self.quality(example, text, data), "score": float(changed)}
        raise DriftlabError(f"Task {self.name} is scored by log-likelihood, not by replies.")

    def quality(self, example: Example, text: str, data: str | None = None) -> dict[str, float]:
        """Generation quality (App. E): fluency (bi/tri-gram entropy) and, where the data set has
        reference texts, consistency (tf-idf similarity to the bios of the example's occupation).
        CounterFact's references would be ROME's attribute snippets, which are not bundled."""
        out = {"fluency": metrics.fluency(text)}
        if "occupation" in example.extra:
            out["consistency"] = _consistency(data).score(text, _occupation_vector(data, example.extra["occupation"]))
        return out


# -- the four tasks ---------------------------------------------------------------------------
# App. A.1's wordings; the emphasised span is always the instruction. "rephrased" JSON puts the
# instruction before the bio. The pronoun wordings keep the paper's text verbatim (its typo too).
_JSON_ASK = "Answer the occupation of {person} and generate the answer as json format."
_JSON_EXAMPLE = ' Here is an example: {{"name": , "occupation": , }}.'
JSON_INSTRUCTIONS = {
    "original": _JSON_ASK + _JSON_EXAMPLE + " Now generate the answer.",
    "shortened": _JSON_ASK,
    "rephrased": _JSON_ASK + _JSON_EXAMPLE,
}
PRONOUN_INSTRUCTIONS = {
    "original": "For the aforementioned text, substitute 'she' and 'he' with 'they' and generate the occupation of "
                "{person} after changing pronouns.",
    "shortened": "Change 'she' and 'he' with 'they' and answer the occupation of {person} after replacing the "
                 "pronouns.",
    "rephrased": "For the aforementioned descriptions, replace 'she' and 'he' with 'they' in the aformentioned text "
                 "and generate the new text after replacing the pronouns.",
}


def _context(bio: Bio) -> str:
    return bio.bio.rstrip()


def _json(bio: Bio, prompt: str = "original") -> Example:
    instruction = JSON_INSTRUCTIONS[prompt].format(person=bio.name)
    if prompt == "rephrased":
        text = Prompt("", instruction, f" {_context(bio)} Now generate the answer.")
    else:
        text = Prompt(f"{_context(bio)} ", instruction)
    answer = json.dumps({"name": bio.name, "occupation": bio.occupation_text})
    return Example(id=bio.id, prompt=text, answer=answer, extra={"occupation": bio.occupation, "bio": bio.bio})


def _pronouns(bio: Bio, prompt: str = "original") -> Example:
    instruction = PRONOUN_INSTRUCTIONS[prompt].format(person=bio.name)
    return Example(id=bio.id, prompt=Prompt(f"{_context(bio)} ", instruction), answer=they_version(bio.bio),
                   extra={"occupation": bio.occupation, "bio": bio.bio})


def _biasbios(bio: Bio, prompt: str = "original") -> Example:
    first = bio.first_sentence
    rest = bio.bio[len(first):]
    labels = tuple(occupation_label(o) for o in OCCUPATIONS)
    return Example(id=bio.id, prompt=Prompt("", first, f"{rest.rstrip()} {bio.name} has the occupation of"),
                   answer=bio.occupation_text, candidates=labels, target=OCCUPATIONS.index(bio.occupation),
                   extra={"occupation": bio.occupation, "bio": bio.bio})


def _counterfact(fact: Fact, prompt: str = "original") -> Example:
    return Example(id=str(fact.id), prompt=Prompt(f"Previously, {fact.old_fact}. ", f"Currently, {fact.new_fact}.",
                                                  f" {fact.question}"),
                   answer=fact.target_new, candidates=(fact.target_new, fact.target_true), target=0,
                   extra={"paraphrases": list(fact.paraphrases), "old": fact.old_fact, "new": fact.new_fact})


@functools.cache
def _consistency(data: str | None) -> metrics.Consistency:
    """tf-idf fitted on every bio of the data set, as pastalib fits it on BiasBios."""
    return metrics.Consistency(b.bio for b in load_bios(data))


@functools.cache
def _occupation_vector(data: str | None, occupation: str):
    """The reference of a reply: the mean tf-idf vector of the data set's bios of its occupation."""
    return _consistency(data).reference_vector([b.bio for b in load_bios(data) if b.occupation == occupation])


_ROWS = {"json": load_bios, "pronouns": load_bios, "biasbios": load_bios, "counterfact": load_facts}
_BUILD = {"json": _json, "pronouns": _pronouns, "biasbios": _biasbios, "counterfact": _counterfact}

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("json", "generate", "score", 64, "JSON formatting: answer a bio's occupation as JSON (format and "
             "prediction accuracy); the instruction is emphasised.", PROMPTS),
        Task("pronouns", "generate", "score", 160, "Pronoun changing: rewrite a bio with 'they' (accuracy, "
             "all-pronoun accuracy, fluency, consistency); the instruction is emphasised.", PROMPTS),
        Task("biasbios", "score", "acc", 0, "BiasBios: the occupation is the most likely of 28 (accuracy); the "
             "first sentence is emphasised."),
        Task("counterfact", "score", "es", 0, "CounterFact: P(new fact) > P(old fact) for the question (efficacy) "
             "and its paraphrases (paraphrase score); the new fact is emphasised."),
    )
}


def _known_task(name: str) -> str:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'{did_you_mean(name, TASKS)}; known: {', '.join(TASKS)}")
    return name


TaskName = Annotated[str, AfterValidator(_known_task)]  # a config field naming a registered task


def get_task(name: str, max_new_tokens: int | None = None) -> Task:
    """A registered task; `max_new_tokens` overrides its reply length (generation tasks)."""
    if name not in TASKS:
        raise DriftlabError(f"Unknown PASTA task '{name}'.", hint=f"Known: {', '.join(TASKS)}.")
    task = TASKS[name]
    return dataclasses.replace(task, max_new_tokens=max_new_tokens) if max_new_tokens else task


_THEY = [
    (r"\bshe is\b|\bhe is\b", "they are"), (r"\bshe was\b|\bhe was\b", "they were"),
    (r"\bshe has\b|\bhe has\b", "they have"), (r"\bshe does\b|\bhe does\b", "they do"),
    (r"\bherself\b|\bhimself\b", "themselves"), (r"\bhers\b", "theirs"), (r"\bhis\b", "their"),
    (r"\bhim\b", "them"), (r"\bher\b(?=\s*[.,;:!?)]|\s*$)", "them"), (r"\bher\b", "their"), (r"\bshe\b|\bhe\b", "they"),
]


def they_version(text: str) -> str:
    """A bio with she/he pronouns replaced by they-forms: the few-shot demonstrations' reply.

    Rule-based ("her" becomes "them" before punctuation, else "their"; verbs after the pronoun
    are fixed for is/was/has/does only), good enough for a demonstration of the requested format.
    """
    for pattern, repl in _THEY:
        text = re.sub(pattern, lambda m, r=repl: r.capitalize() if m.group(0)[0].isupper() else r, text,
                      flags=re.IGNORECASE)
    return text
