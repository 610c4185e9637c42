"""`driftlab pasta profile`: score every attention head by steering it alone (PASTA paper Sec. 3.2).

For each (layer, head) the task runs on `n` train examples with PASTA on that head only;
the head's score is the task's primary metric averaged over them. Generation tasks batch
many heads at once: each row of a decode batch steers its own head (the engine takes
per-row head masks), so a batch holds `batch_size` (head, example) rows. Records, one per
(head, example), make the profile resumable after kill -9; the plan records the examples
and the heads. The result, `profile.json`, ranks the heads (best first; ties by layer,
head); `driftlab.report.pasta` draws it as a layer x head heatmap (`profile.png`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from driftlab.attention.config import parse_heads
from driftlab.chat.base import Sampling, token_backend
from driftlab.errors import DriftlabError
from driftlab.pasta.evaluate import TaskProtocol, score_examples
from driftlab.pasta.tasks import Example, PromptName, TaskName, get_task
from driftlab.protocol.registry import register
from driftlab.protocol.runner import ProtocolConfig, RunState, config_of
from driftlab.records.rundir import RunDir
from driftlab.steering.heads import Profile
from driftlab.steering.interventions import Interventions, Pasta

BASELINE = (-1, -1)  # the (layer, head) key of the unsteered run
PROFILE = "profile.json"


class ProfileConfig(ProtocolConfig):
    task: TaskName
    n: int = Field(16, ge=1, le=100000, description="train examples per head")
    alpha: float = Field(0.01, gt=0.0, lt=1.0, allow_inf_nan=False)
    layers: str | None = Field(None, description="profile only these layers ('0-5+9'); None: all")
    score: Literal["metric", "likelihood"] = Field(
        "metric", description="rank heads by the task metric (the paper) or by the reference answer's likelihood")
    prompt: PromptName = Field("original", description="the instruction's wording (App. A.1)")
    max_new_tokens: int | None = Field(None, ge=1, le=4096)
    data: str | None = None
    batch_size: int = Field(16, ge=1, le=1024, description="(head, example) rows per decode batch")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: str | None) -> str | None:
        if v is None:
            return None
        heads = parse_heads(v)
        if heads is None or any(h is not None for _, h in heads):
            raise ValueError("give layers only, e.g. '0-5+9'")
        return v

    @model_validator(mode="after")
    def _prompt(self) -> ProfileConfig:
        get_task(self.task).check_prompt(self.prompt)
        return self


class HeadRecord(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["head"] = "head"
    layer: int  # -1 with head -1: no steering (the baseline)
    head: int
    id: str
    score: float
    metrics: dict[str, float]

    @property
    def key(self) -> tuple:
        return ("head", self.layer, self.head, self.id)


RECORDS: TypeAdapter = TypeAdapter(HeadRecord)
Row = tuple[tuple[int, int], Example]  # (layer, head) steered alone (BASELINE: none), and one example


@register
class HeadProfiler(TaskProtocol[ProfileConfig]):
    """Every head steered alone on the train examples. Units: for generation tasks, batches of
    (head, example) rows (each row steers its own head); for scored tasks and likelihood
    ranking, one head's examples."""

    name = "pasta-profile"
    records = RECORDS
    unit = "runs"
    split = "train"

    @property
    def label(self) -> str:
        return f"profile {self.config.task}"

    def require(self) -> None:
        backend = token_backend(self.backend, "head profiling (it steers one head at a time)")
        backend.capabilities.require(backend.name, Interventions.of(Pasta(heads=None)))
        super().require()

    def _heads(self) -> list[tuple[int, int]]:
        shape = token_backend(self.backend, "head profiling").shape
        L, H = shape.layers, shape.heads
        layers = sorted({layer for layer, _ in parse_heads(self.config.layers)}) if self.config.layers else range(L)
        if any(not 0 <= layer < L for layer in layers):
            raise DriftlabError(f"--layers {self.config.layers} is outside this model's {L} layers.",
                                hint=f"Layers are 0..{L - 1}.")
        return [(layer, h) for layer in layers for h in range(H)]

    def describe(self) -> dict[str, Any]:
        shape = token_backend(self.backend, "head profiling").shape
        return {"heads": self._heads(), "shape": [shape.layers, shape.heads], **super().describe()}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"head": (len(manifest.get("heads", [])) + 1) * len(manifest.get("examples", []))}

    def units(self, state: RunState) -> Iterator[list[Row]]:
        examples = self.planned(state.manifest)
        heads = [BASELINE, *(tuple(h) for h in state.manifest["heads"])]
        rows = [(lh, e) for lh in heads for e in examples if ("head", *lh, e.id) not in state.done]
        if self.config.score == "metric" and self.task.mode == "generate":
            size = self.config.batch_size
            yield from (rows[start : start + size] for start in range(0, len(rows), size))
            return
        per_head: dict[tuple[int, int], list[Row]] = defaultdict(list)
        for row in rows:
            per_head[row[0]].append(row)
        yield from per_head.values()

    def run_unit(self, rows: list[Row]) -> list[HeadRecord]:
        if self.config.score == "likelihood":
            return self._likelihood(rows)
        if self.task.mode == "generate":
            return self._generate(rows)
        return self._score(rows)

    def _steer(self, layer: int, head: int) -> tuple[Interventions, str]:
        """The interventions and baseline of one head's rows (BASELINE: no steering, zero-shot)."""
        if (layer, head) == BASELINE:
            return Interventions(), "zero-shot"
        return Interventions.of(Pasta(heads=((layer, head),), alpha=self.config.alpha)), "pasta"

    def _generate(self, rows: list[Row]) -> list[HeadRecord]:
        """Each steered row steers its own head: one decode batch for many heads."""
        backend = token_backend(self.backend, "head profiling")
        task, sampling = self.task, Sampling(greedy=True, max_new_tokens=self.task.max_new_tokens)
        marked = Interventions.of(Pasta(heads=None, alpha=self.config.alpha))  # how the markup renders
        steered = [(lh, ex) for lh, ex in rows if lh != BASELINE]
        out = []
        if steered:
            prompts = {ex.id: backend.render(task.conversation(ex, "pasta"), interventions=marked) for _, ex in steered}
            replies = backend.generate_tokens(
                [prompts[ex.id] for _, ex in steered], sampling, interventions=[self._steer(*lh)[0] for lh, _ in steered],
                cache_store=[False] * len(steered))
            out += [(lh, ex, r.text) for (lh, ex), r in zip(steered, replies, strict=True)]
        base = [ex for lh, ex in rows if lh == BASELINE]
        if base:
            replies = backend.generate_tokens([backend.render(task.conversation(ex, "zero-shot")) for ex in base],
                                              sampling, cache_store=[False] * len(base))
            out += [(BASELINE, ex, r.text) for ex, r in zip(base, replies, strict=True)]
        records = []
        for (layer, head), ex, text in out:
            m = task.score_reply(ex, text, self.config.data)
            records.append(HeadRecord(layer=layer, head=head, id=ex.id, score=m[task.primary], metrics=m, text=text))
        return records

    def _likelihood(self, rows: list[Row]) -> list[HeadRecord]:
        """Rank by the mean per-token log-probability of each example's reference answer
        (teacher-forced, no generation). A graded score where the task metric is 0 for every
        head on a small model (e.g. SmolLM2 never writes JSON unprompted), and far cheaper."""
        (layer, head), examples = rows[0][0], [ex for _, ex in rows]
        iv, baseline = self._steer(layer, head)
        convs = [self.task.conversation(ex, baseline) for ex in examples]
        scores = self.backend.loglikelihood(convs, [ex.answer for ex in examples], iv, batch_size=self.config.batch_size)
        return [HeadRecord(layer=layer, head=head, id=ex.id, score=s.logprob / s.n_tokens,
                           metrics={"answer_logprob_per_token": s.logprob / s.n_tokens})
                for ex, s in zip(examples, scores, strict=True)]

    def _score(self, rows: list[Row]) -> list[HeadRecord]:
        """Scoring tasks: one log-likelihood pass over the examples per head."""
        (layer, head), examples = rows[0][0], [ex for _, ex in rows]
        iv, baseline = self._steer(layer, head)
        scored = score_examples(self.backend, self.task, examples, iv, baseline, [], self.config.batch_size,
                                self.config.data)
        return [HeadRecord(layer=layer, head=head, id=ex.id, score=m[self.task.primary], metrics=m)
                for ex, (m, _) in zip(examples, scored, strict=True)]

    def finish(self, state: RunState) -> None:
        (self.run_dir / PROFILE).write_text(build_profile(self.run_dir).model_dump_json(indent=1))


def build_profile(run_dir: str | Path) -> Profile:
    """The ranking of a profiling run's heads (mean primary score, best first)."""
    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    cfg = manifest["config"]
    scores: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in rd.records(RECORDS):
        scores[(r.layer, r.head)].append(r.score)
    base = scores.pop(BASELINE, [])
    means = [(layer, head, sum(v) / len(v)) for (layer, head), v in scores.items()]
    means.sort(key=lambda x: (-x[2], x[0], x[1]))
    metric = "answer_logprob_per_token" if cfg.get("score") == "likelihood" else get_task(cfg["task"]).primary
    model = config_of(manifest)["backend"]["model"]
    return Profile(model=model, task=cfg["task"], metric=metric, alpha=cfg["alpha"],
                   n=len(manifest.get("examples", [])), baseline=sum(base) / len(base) if base else None,
                   scores=means)
