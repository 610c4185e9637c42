"""`driftlab pasta eval`: one task under several baselines, in a resumable run directory.

Per baseline and test example one record: the metrics of that example (and the reply for
generation tasks). The summary is each metric's mean with a 95% bootstrap CI over
examples, per baseline; every baseline sees the same examples (and few-shot the same 3
train demonstrations), so differences between baselines are paired.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.chat.base import ChatRequest, Sampling
from driftlab.chat.factory import BackendSpec, Dtype, ModelName, make_backend
from driftlab.console import WorkProgress
from driftlab.errors import DriftlabError
from driftlab.pasta.metrics import argmax_accuracy, efficacy
from driftlab.pasta.tasks import BASELINES, N_SHOTS, Example, PromptName, Task, TaskName, get_task
from driftlab.protocol.registry import register
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import Interventions


class PastaEvalConfig(BaseModel):
    """A PASTA task evaluation (recorded in the run's manifest)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = DEFAULT_MODEL
    task: TaskName
    baselines: list[str] = Field(default_factory=lambda: ["zero-shot", "pasta"])
    steer: list[str] = Field(default_factory=list, description="the pasta spec used by the 'pasta' baseline")
    n: int | None = Field(None, ge=1, description="test examples (None: all)")
    split: Literal["test", "valid"] = Field("test", description="'valid' while choosing heads, 'test' for results")
    prompt: PromptName = Field("original", description="the instruction's wording (App. A.1, Table 4)")
    data: str | None = Field(None, description="a real data file instead of the bundled set")
    max_new_tokens: int | None = Field(None, ge=1, le=4096, description="generation tasks (None: the task's)")
    generate_tokens: int = Field(0, ge=0, le=4096, description=(
        "scoring tasks: also generate this many tokens per example, for fluency and consistency (App. E)"))
    dtype: Dtype = "auto"
    device: str = "auto"
    batch_size: int = Field(8, ge=1, le=1024)

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ("device", "batch_size")

    @field_validator("baselines")
    @classmethod
    def _baselines(cls, v: list[str]) -> list[str]:
        bad = [b for b in v if b not in BASELINES]
        if bad or not v:
            raise ValueError(f"unknown baseline {bad[0]!r}; known: {', '.join(BASELINES)}" if bad else "no baseline")
        return list(dict.fromkeys(v))

    @field_validator("steer")
    @classmethod
    def _normalise_steer(cls, v: list[str]) -> list[str]:
        return Interventions.parse(v).specs()

    @model_validator(mode="after")
    def _pasta_needs_heads(self) -> PastaEvalConfig:
        # DriftlabError, not ValueError: a cross-field error has no one field to name.
        task = get_task(self.task)
        task.check_prompt(self.prompt)
        if self.generate_tokens and task.mode == "generate":
            raise DriftlabError(f"Task {self.task} already generates its replies and scores their quality.",
                                hint="Drop --generate-tokens (--max-new-tokens sets the reply length).")
        iv = Interventions.parse(self.steer)
        if "pasta" in self.baselines and iv.get("pasta") is None:
            raise DriftlabError("The pasta baseline needs heads to steer.",
                                hint="Give --heads (a head config or a profile.json with --topk), or drop --baseline pasta.")
        if iv.get("pasta") is not None and iv.get("pasta").span != "marked":
            raise DriftlabError("PASTA tasks emphasise marked spans, not the system prompt.", hint="Use span=marked.")
        return self

    def interventions(self, baseline: str) -> Interventions:
        return Interventions.parse(self.steer) if baseline == "pasta" else Interventions()

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


def _expected(manifest: dict[str, Any]) -> dict[str, int]:
    return {"example": len(manifest.get("examples", [])) * len(manifest.get("baselines", []))}


register("pasta-eval", RECORDS, _expected)


def score_examples(backend, task: Task, examples: list[Example], iv: Interventions, baseline: str,
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


def score_batches(rundir: RunDir, bar, record: type[BaseModel], fields: dict[str, Any], backend, task: Task,
                  examples: list[Example], iv: Interventions, baseline: str, shots: list[Example], batch_size: int,
                  data: str | None = None, generate: int = 0) -> None:
    """`score_examples` in batches, appending `record(**fields, id=, metrics=, text=)` for each
    example as its batch ends, so a killed run keeps every finished batch (eval and tune share this)."""
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        scored = score_examples(backend, task, chunk, iv, baseline, shots, batch_size, data, generate)
        rundir.append([record(**fields, id=ex.id, metrics=m, text=t) for ex, (m, t) in zip(chunk, scored, strict=True)])
        bar.advance(len(chunk))


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


class PastaEval:
    def __init__(self, config: PastaEvalConfig, out: str | RunDir, backend, progress: bool = True) -> None:
        for b in config.baselines:
            backend.capabilities.require(backend.name, config.interventions(b))
        if get_task(config.task).mode == "score" and not backend.capabilities.loglikelihood:
            raise DriftlabError(f"{backend.name} cannot score log-likelihoods, which task {config.task} needs.",
                                hint="Use a local model.")
        self.config, self.backend, self.progress = config, backend, progress
        self.rundir = out if isinstance(out, RunDir) else RunDir(out)

    def run(self) -> RunDir:
        cfg = self.config
        task = get_task(cfg.task, cfg.max_new_tokens)
        shots = task.examples("train", N_SHOTS, cfg.data, cfg.prompt) if "few-shot" in cfg.baselines else []
        # A real file has no split (every row is both "train" and "test"): never test on a demonstration.
        demos = {s.id for s in shots}
        examples = [e for e in task.examples(cfg.split, None, cfg.data, cfg.prompt) if e.id not in demos][: cfg.n]
        if not examples:
            raise DriftlabError(f"No {cfg.split} examples for task {cfg.task}.", hint="Check --data.")
        with self.rundir.writing():
            plan = {"examples": [e.id for e in examples], "baselines": cfg.baselines,
                    "shots": [s.id for s in shots], "models": {"agent": self.backend.describe()}}
            self.rundir.start(cfg.model_dump(mode="json"), plan, cfg.RESUME_IGNORES, protocol="pasta-eval")
            done = {r.key for r in self.rundir.records(RECORDS)}
            todo = {b: [e for e in examples if ("example", b, e.id) not in done] for b in cfg.baselines}
            with WorkProgress(f"pasta eval {cfg.task}", sum(map(len, todo.values())), self.progress,
                              unit="examples") as bar:
                for baseline in cfg.baselines:
                    score_batches(self.rundir, bar, ExampleRecord, {"baseline": baseline}, self.backend, task,
                                  todo[baseline],
                                  cfg.interventions(baseline), baseline, shots, cfg.batch_size, cfg.data,
                                  cfg.generate_tokens)
            plot_eval(summarize(self.rundir.path), self.rundir.path / "eval.png", f"PASTA {cfg.task} · {cfg.model}")
            self.rundir.update_manifest(completed=True)
        return self.rundir


def plot_eval(summary: dict[str, dict[str, tuple[float, float, float]]], path: Path, title: str) -> Path:
    """One panel per metric: each baseline's mean with its 95% CI."""
    from matplotlib.figure import Figure

    from driftlab.report.figures import save_png

    baselines = list(summary)
    metrics = [m for m in next(iter(summary.values())) if m != "score"]
    fig = Figure(figsize=(3.2 * len(metrics), 3.2))
    axes = fig.subplots(1, len(metrics), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        means = [summary[b][metric][0] for b in baselines]
        lo = [summary[b][metric][0] - summary[b][metric][1] for b in baselines]
        hi = [summary[b][metric][2] - summary[b][metric][0] for b in baselines]
        colors = ["tab:red" if b == "pasta" else "tab:gray" for b in baselines]
        ax.bar(range(len(baselines)), means, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_xticks(range(len(baselines)), baselines, rotation=30, ha="right")
        ax.set_title(metric)
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, path)


def run_eval(config: PastaEvalConfig, out: str, progress: bool = True) -> RunDir:
    rundir = RunDir(out)
    with rundir.writing():
        spec = BackendSpec(model=config.model, dtype=config.dtype, device=config.device)
        return PastaEval(config, rundir, make_backend(spec, run_dir=rundir.path), progress).run()


def paired_gains(run_dir: str | Path, reference: str = "zero-shot") -> dict[str, dict[str, tuple[float, float, float]]]:
    """baseline -> metric -> (mean, CI low, CI high) of its per-example difference from `reference`.

    Every baseline answers the same examples, so the difference is taken example by example
    before bootstrapping: with a few dozen examples the two baselines' own CIs overlap far
    more than their paired difference's does. Empty if the run has no `reference` baseline.
    """
    from driftlab.pasta.metrics import mean_ci

    per: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for r in RunDir(run_dir).records(RECORDS):
        per[r.baseline][r.id] = r.metrics
    ref = per.get(reference)
    if not ref:
        return {}
    out = {}
    for baseline, rows in per.items():
        if baseline == reference:
            continue
        ids = [i for i in rows if i in ref]
        metrics = [m for m in rows[ids[0]] if m in ref[ids[0]]] if ids else []
        out[baseline] = {m: mean_ci([rows[i][m] - ref[i][m] for i in ids]) for m in metrics}
    return out


def summarize(run_dir: str | Path) -> dict[str, dict[str, tuple[float, float, float]]]:
    """baseline -> metric -> (mean, CI low, CI high) over examples."""
    return metric_cis(RunDir(run_dir).records(RECORDS), lambda r: r.baseline)


def metric_cis(records: Iterable[Any], group: Callable[[Any], Hashable]) -> dict[Any, dict[str, tuple[float, float, float]]]:
    """group -> metric -> (mean, CI low, CI high) over the records (each with `.metrics`) of that group."""
    from driftlab.pasta.metrics import mean_ci

    values: dict[Any, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for name, v in r.metrics.items():
            values[group(r)][name].append(v)
    return {g: {m: mean_ci(v) for m, v in ms.items()} for g, ms in values.items()}
