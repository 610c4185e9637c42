"""`driftlab pasta eval`: one task under several baselines, in a resumable run directory.

Per baseline and test example one record: the metrics of that example (and the reply for
generation tasks). The summary is each metric's mean with a 95% interval over examples, per
baseline (`driftlab.stats.mean_interval`: Wilson for 0/1 metrics, t or BCa by n for graded
ones); every baseline sees the same examples (and few-shot the same 3 train
demonstrations), so differences between baselines are paired and tested as such
(`paired_gains`: exact McNemar for 0/1 metrics, Wilcoxon signed-rank for graded ones, Holm
across the baselines compared with the reference). The examples themselves
are recorded in the manifest's plan, so a resumed run answers what it planned even if the
data file changed since.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from driftlab.chat.base import ChatBackend, ChatRequest, Sampling
from driftlab.errors import DriftlabError
from driftlab.pasta.metrics import argmax_accuracy, efficacy
from driftlab.pasta.tasks import BASELINES, EXAMPLES, N_SHOTS, Example, PromptName, Task, TaskName, get_task
from driftlab.protocol.registry import register
from driftlab.protocol.runner import C, Protocol, ProtocolConfig, RunState
from driftlab.records.rundir import RunDir
from driftlab.stats import Interval, PairedTest, mean_interval, paired_test, with_holm
from driftlab.steering.interventions import Interventions, Steer


class PastaEvalConfig(ProtocolConfig):
    """A PASTA task evaluation (recorded in the run's manifest)."""

    task: TaskName
    baselines: list[str] = Field(default_factory=lambda: ["zero-shot", "pasta"])
    steer: Steer = Field(default_factory=Interventions, description="the pasta intervention of the 'pasta' baseline")
    n: int | None = Field(None, ge=1, description="test examples (None: all)")
    split: Literal["test", "valid"] = Field("test", description="'valid' while choosing heads, 'test' for results")
    prompt: PromptName = Field("original", description="the instruction's wording (App. A.1, Table 4)")
    data: str | None = Field(None, description="a real data file instead of the bundled set")
    max_new_tokens: int | None = Field(None, ge=1, le=4096, description="generation tasks (None: the task's)")
    generate_tokens: int = Field(0, ge=0, le=4096, description=(
        "scoring tasks: also generate this many tokens per example, for fluency and consistency (App. E)"))
    batch_size: int = Field(8, ge=1, le=1024)

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")

    @field_validator("baselines")
    @classmethod
    def _baselines(cls, v: list[str]) -> list[str]:
        bad = [b for b in v if b not in BASELINES]
        if bad or not v:
            raise ValueError(f"unknown baseline {bad[0]!r}; known: {', '.join(BASELINES)}" if bad else "no baseline")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _pasta_needs_heads(self) -> PastaEvalConfig:
        # DriftlabError, not ValueError: a cross-field error has no one field to name.
        task = get_task(self.task)
        task.check_prompt(self.prompt)
        if self.generate_tokens and task.mode == "generate":
            raise DriftlabError(f"Task {self.task} already generates its replies and scores their quality.",
                                hint="Drop --generate-tokens (--max-new-tokens sets the reply length).")
        pasta = self.steer.get("pasta")
        if "pasta" in self.baselines and pasta is None:
            raise DriftlabError("The pasta baseline needs heads to steer.",
                                hint="Give --heads (a head config or a profile.json with --topk), or drop --baseline pasta.")
        if pasta is not None and pasta.span != "marked":
            raise DriftlabError("PASTA tasks emphasise marked spans, not the system prompt.", hint="Use span=marked.")
        return self

    def interventions(self, baseline: str) -> Interventions:
        return self.steer if baseline == "pasta" else Interventions()

    @property
    def tokens(self) -> int:
        return self.max_new_tokens or get_task(self.task).max_new_tokens


class ExampleRecord(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["example"] = "example"
    baseline: str
    id: str
    metrics: dict[str, float]
    text: str | None = None

    @property
    def key(self) -> tuple:
        return ("example", self.baseline, self.id)


RECORDS: TypeAdapter = TypeAdapter(ExampleRecord)


def score_examples(backend: ChatBackend, task: Task, examples: list[Example], iv: Interventions, baseline: str,
                   shots: list[Example], batch_size: int, data: str | None = None, generate: int = 0,
                   ) -> list[tuple[dict[str, float], str | None]]:
    """Metrics of each example under one baseline (shared by eval, tuning and head profiling).

    Scoring tasks compare candidates' log-likelihoods; with `generate` > 0 they also generate
    that many tokens greedily and add the reply's fluency (and consistency) to the metrics.
    """
    convs = [task.conversation(ex, baseline, shots) for ex in examples]
    if task.mode == "generate":
        sampling = Sampling(greedy=True, max_new_tokens=task.max_new_tokens)
        replies = backend.generate(ChatRequest(convs, sampling, interventions=iv))
        return [(task.score_reply(ex, r.text, data), r.text) for ex, r in zip(examples, replies, strict=True)]
    scored = _score_candidates(backend, task, examples, convs, iv, baseline, batch_size)
    if not generate:
        return [(m, None) for m in scored]
    replies = backend.generate(ChatRequest(convs, Sampling(greedy=True, max_new_tokens=generate), interventions=iv))
    return [({**m, **task.quality(ex, r.text, data)}, r.text)
            for ex, m, r in zip(examples, scored, replies, strict=True)]


def _score_candidates(backend, task: Task, examples: list[Example], convs: list[list[dict]], iv: Interventions,
                      baseline: str, batch_size: int) -> list[dict[str, float]]:
    out = []
    for ex, conv in zip(examples, convs, strict=True):
        contexts, conts = [conv] * len(ex.candidates), list(ex.candidates)
        paraphrases = ex.extra.get("paraphrases", [])
        for para in paraphrases:  # CounterFact's paraphrase score: the same facts, another question
            pconv = [*conv[:-1], {"role": "user", "content": replace(ex.prompt, after=f" {para}").render(baseline)}]
            contexts += [pconv] * len(ex.candidates)
            conts += list(ex.candidates)
        scores = [s.logprob for s in backend.loglikelihood(contexts, conts, iv, batch_size=batch_size)]
        k = len(ex.candidates)
        first = scores[:k]
        if task.name == "counterfact":  # candidates are (new, true)
            scored = {"es": efficacy([first[0]], [first[1]])}
            if paraphrases:
                rest = scores[k:]
                scored["ps"] = efficacy(rest[0::2], rest[1::2])
        else:
            scored = {"acc": argmax_accuracy([first], [ex.target])}
        out.append(scored)
    return out


class TaskProtocol(Protocol[C]):
    """What PASTA's protocols share: a task, its examples recorded in the plan, and a backend
    that can score them. Their units are batches of examples under one steering."""

    unit = "examples"

    @property
    def task(self) -> Task:
        return get_task(self.config.task, self.config.max_new_tokens)

    @property
    def split(self) -> str:
        """Where the examples come from: train (profiling), valid (tuning), test (results)."""
        raise NotImplementedError

    def examples(self) -> list[Example]:
        cfg = self.config
        return self.task.examples(self.split, cfg.n, cfg.data, cfg.prompt)

    def check(self) -> None:
        if not self.examples():
            raise DriftlabError(f"No {self.split} examples for task {self.config.task}.",
                                hint="Check --data (a real file's rows serve as every split).")

    def require(self) -> None:
        if self.task.mode == "score" and not self.backend.capabilities.loglikelihood:
            raise DriftlabError(f"{self.backend.name} cannot score log-likelihoods, which task {self.config.task} "
                                "needs.", hint="Use a local model.")

    def plan(self) -> dict[str, Any]:
        return {"examples": EXAMPLES.dump_python(self.examples(), mode="json")}

    @staticmethod
    def planned(manifest: dict[str, Any], key: str = "examples") -> list[Example]:
        return EXAMPLES.validate_python(manifest.get(key, []))

    def batches(self, examples: list[Example]) -> Iterator[list[Example]]:
        for start in range(0, len(examples), self.config.batch_size):
            yield examples[start : start + self.config.batch_size]


@register
class PastaEval(TaskProtocol[PastaEvalConfig]):
    """One task under several baselines; a unit is a batch of examples under one baseline."""

    name = "pasta-eval"
    records = RECORDS

    @property
    def label(self) -> str:
        return f"pasta eval {self.config.task}"

    @property
    def split(self) -> str:
        return self.config.split

    def examples(self) -> list[Example]:
        # A real file has no split (every row is both "train" and "test"): never test on a demonstration.
        demos = {s.id for s in self.shots()}
        cfg = self.config
        return [e for e in self.task.examples(cfg.split, None, cfg.data, cfg.prompt) if e.id not in demos][: cfg.n]

    def shots(self) -> list[Example]:
        cfg = self.config
        return self.task.examples("train", N_SHOTS, cfg.data, cfg.prompt) if "few-shot" in cfg.baselines else []

    def require(self) -> None:
        for b in self.config.baselines:
            self.backend.capabilities.require(self.backend.name, self.config.interventions(b))
        super().require()

    def plan(self) -> dict[str, Any]:
        return {**super().plan(), "shots": EXAMPLES.dump_python(self.shots(), mode="json")}

    def describe(self) -> dict[str, Any]:
        return {"baselines": self.config.baselines, **super().describe()}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"example": len(manifest.get("examples", [])) * len(manifest.get("baselines", []))}

    def units(self, state: RunState) -> Iterator[tuple[str, list[Example]]]:
        self._shots = self.planned(state.manifest, "shots")
        examples = self.planned(state.manifest)
        for baseline in self.config.baselines:
            yield from ((baseline, chunk) for chunk in
                        self.batches([e for e in examples if ("example", baseline, e.id) not in state.done]))

    def run_unit(self, unit: tuple[str, list[Example]]) -> list[ExampleRecord]:
        baseline, chunk = unit
        cfg = self.config
        scored = score_examples(self.backend, self.task, chunk, cfg.interventions(baseline), baseline, self._shots,
                                cfg.batch_size, cfg.data, cfg.generate_tokens)
        return [ExampleRecord(baseline=baseline, id=ex.id, metrics=m, text=t)
                for ex, (m, t) in zip(chunk, scored, strict=True)]


def paired_gains(run_dir: str | Path, reference: str = "zero-shot") -> dict[str, dict[str, PairedTest]]:
    """baseline -> metric -> the paired test of that baseline against `reference`, example by example.

    Every baseline answers the same examples, so the comparison is paired: the exact McNemar
    test for a 0/1 metric (only the examples where the two disagree count), the Wilcoxon
    signed-rank test for a graded one, with the mean difference (baseline - reference) and
    its interval. For each metric the baselines form one family and are Holm-corrected
    (`p_holm`). Empty if the run has no `reference` baseline.
    """
    per: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for r in RunDir(run_dir).records(RECORDS):
        per[r.baseline][r.id] = r.metrics
    ref = per.get(reference)
    if not ref:
        return {}
    out: dict[str, dict[str, PairedTest]] = {}
    for baseline, rows in per.items():
        if baseline == reference:
            continue
        ids = [i for i in rows if i in ref]
        metrics = [m for m in rows[ids[0]] if m in ref[ids[0]]] if ids else []
        out[baseline] = {m: paired_test({i: rows[i][m] for i in ids}, {i: ref[i][m] for i in ids}) for m in metrics}
    for metric in {m for tests in out.values() for m in tests}:  # one family per metric: the baselines
        family = [b for b in out if metric in out[b]]
        for b, t in zip(family, with_holm([out[b][metric] for b in family]), strict=True):
            out[b][metric] = t
    return out


def summarize(run_dir: str | Path) -> dict[str, dict[str, tuple[float, float, float]]]:
    """baseline -> metric -> (mean, CI low, CI high) over examples."""
    return metric_cis(RunDir(run_dir).records(RECORDS), lambda r: r.baseline)


def metric_intervals(records: Iterable[Any], group: Callable[[Any], Hashable]) -> dict[Any, dict[str, Interval]]:
    """group -> metric -> its mean over the records (each with `.metrics`) of that group, with the
    interval `driftlab.stats.mean_interval` chooses (n and method included)."""
    values: dict[Any, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for name, v in r.metrics.items():
            values[group(r)][name].append(v)
    return {g: {m: mean_interval(v) for m, v in ms.items()} for g, ms in values.items()}


def metric_cis(records: Iterable[Any], group: Callable[[Any], Hashable]) -> dict[Any, dict[str, tuple[float, float, float]]]:
    """group -> metric -> (mean, CI low, CI high): `metric_intervals` as plain tuples (JSON, figures)."""
    return {g: {m: iv.as_tuple() for m, iv in ms.items()} for g, ms in metric_intervals(records, group).items()}
