"""`driftlab pasta tune`: choose how many heads to steer on a validation split.

The PASTA paper picks the steered set's size |H| per task by cross-validation (Sec. 4: top-k from
several values, "select |H| by cross validation"): too few heads change nothing, too many
break the model. `tune` builds one head set per top-k from the given profiles (the same
selection as `driftlab pasta select`), runs PASTA with each on the task's validation split,
and keeps the best by the task's primary metric (ties go to fewer heads). The unsteered
model is scored on the same examples as a reference. Writes `tune.json` (every point with
a 95% CI) and `heads.json` (the best set, pastalib's format, ready for `--heads`);
`driftlab.report.pasta` draws `tune.png` (metric against |H|). The run directory resumes
after kill -9; its manifest records the examples and the head sets themselves, so a later
change to a profile or data file cannot mix results.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from driftlab.errors import DriftlabError
from driftlab.pasta.evaluate import TaskProtocol, metric_cis, score_examples
from driftlab.pasta.metrics import FLUENCY_FLOOR
from driftlab.pasta.tasks import Example, PromptName, TaskName, get_task
from driftlab.protocol.registry import register
from driftlab.protocol.runner import ProtocolConfig, RunState, config_of
from driftlab.protocol.selfchat import digest
from driftlab.records.rundir import RunDir
from driftlab.steering.heads import load_profile, save_heads, select
from driftlab.steering.interventions import Interventions, Pasta

UNSTEERED = 0  # the topk of the reference point: no heads, the zero-shot prompt
RESULT, HEADS = "tune.json", "heads.json"


class TuneConfig(ProtocolConfig):
    """A search over the number of steered heads (recorded in the run's manifest)."""

    task: TaskName
    profiles: list[str] = Field(min_length=1, description="profile.json files the head sets are selected from")
    select: Literal["intersection", "union", "task-specific"] = "intersection"
    topk: list[int] = Field(default_factory=lambda: [10, 20, 40, 80], min_length=1)
    n: int | None = Field(16, ge=1, description="validation examples (None: all)")
    alpha: float = Field(0.01, gt=0.0, lt=1.0, allow_inf_nan=False)
    prompt: PromptName = "original"
    max_new_tokens: int | None = Field(None, ge=1, le=4096)
    data: str | None = None
    batch_size: int = Field(8, ge=1, le=1024)

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")

    @field_validator("topk")
    @classmethod
    def _topk(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError("every top-k must be at least 1")
        return sorted(set(v))

    @model_validator(mode="after")
    def _check(self) -> TuneConfig:
        get_task(self.task).check_prompt(self.prompt)
        if self.select == "task-specific" and len(self.profiles) != 1:
            raise DriftlabError(f"task-specific selection takes one profile, got {len(self.profiles)}.",
                                hint="Pass the profile of the task you tune.")
        return self


class PointRecord(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["example"] = "example"
    topk: int  # UNSTEERED for the reference point
    id: str
    metrics: dict[str, float]
    text: str | None = None

    @property
    def key(self) -> tuple:
        return ("example", self.topk, self.id)


RECORDS: TypeAdapter = TypeAdapter(PointRecord)


def head_sets(config: TuneConfig) -> list[dict[str, Any]]:
    """One point per top-k that gives a new, non-empty head set: {"topk", "heads"}.

    A larger k whose set equals a smaller k's (possible with an intersection) would repeat
    the same run, and an empty intersection is the unsteered model: both are left out.
    """
    profiles = [load_profile(p) for p in config.profiles]
    other = sorted({p.model for p in profiles} - {config.backend.model})
    if other:
        raise DriftlabError(f"The profiles come from {', '.join(other)}, not {config.backend.model}.",
                            hint="Tune with the model the heads were profiled on.")
    points, seen = [], set()
    for k in config.topk:
        heads = tuple(select(profiles, config.select, k))
        if heads and heads not in seen:
            seen.add(heads)
            points.append({"topk": k, "heads": [list(h) for h in heads]})
    if not points:
        raise DriftlabError(f"No top-k in {config.topk} selects any head ({config.select} of "
                            f"{len(profiles)} profiles).", hint="Try larger --topk values, or --select union.")
    return points


@register
class HeadTuner(TaskProtocol[TuneConfig]):
    """PASTA with each head set on the validation split, beside the unsteered model; a unit
    is a batch of examples under one head set."""

    name = "pasta-tune"
    records = RECORDS
    split = "valid"

    @property
    def label(self) -> str:
        return f"pasta tune {self.config.task}"

    def check(self) -> None:
        head_sets(self.config)  # bad profiles fail before a run directory or a model exists
        super().check()

    def require(self) -> None:
        self.backend.capabilities.require(self.backend.name, Interventions.of(Pasta(heads=None)))
        super().require()

    def plan(self) -> dict[str, Any]:
        return {**super().plan(), "points": head_sets(self.config)}

    def inputs(self) -> dict[str, str]:
        return {"profiles": digest([load_profile(p).model_dump() for p in self.config.profiles])}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"example": (len(manifest.get("points", [])) + 1) * len(manifest.get("examples", []))}

    def units(self, state: RunState) -> Iterator[tuple[int, Interventions, str, list[Example]]]:
        examples = self.planned(state.manifest)
        runs = [(UNSTEERED, Interventions(), "zero-shot")] + [
            (p["topk"], Interventions.of(Pasta(heads=tuple(map(tuple, p["heads"])), alpha=self.config.alpha)), "pasta")
            for p in state.manifest["points"]]
        for k, iv, baseline in runs:
            pending = [e for e in examples if ("example", k, e.id) not in state.done]
            yield from ((k, iv, baseline, chunk) for chunk in self.batches(pending))

    def run_unit(self, unit: tuple[int, Interventions, str, list[Example]]) -> list[PointRecord]:
        k, iv, baseline, chunk = unit
        scored = score_examples(self.backend, self.task, chunk, iv, baseline, [], self.config.batch_size,
                                self.config.data)
        return [PointRecord(topk=k, id=ex.id, metrics=m, text=t) for ex, (m, t) in zip(chunk, scored, strict=True)]

    def finish(self, state: RunState) -> None:
        result = summarize(self.run_dir)
        (self.run_dir / RESULT).write_text(json.dumps(result, indent=1))
        if result["best"] is not None:  # else every point was degenerate: nothing to recommend
            save_heads([tuple(h) for h in result["best"]["heads"]], self.run_dir / HEADS)


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Each point's metrics (mean, CI low, CI high), the unsteered reference and the best point.

    The best is the highest primary metric among the points whose replies are not
    degenerate (mean fluency at least 3.0, the paper's floor, where the task measures
    fluency: a model that stops writing pronouns by babbling scores pronoun accuracy);
    ties go to fewer heads. None when every point is degenerate.
    """
    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    cfg = manifest["config"]
    primary = get_task(cfg["task"]).primary
    stats = metric_cis(rd.records(RECORDS), lambda r: r.topk)
    points = [{"topk": p["topk"], "n_heads": len(p["heads"]), "heads": p["heads"], "metrics": stats.get(p["topk"], {})}
              for p in manifest["points"]]
    for p in points:  # the paper drops any result whose mean fluency is below 3.0 (Sec. 4)
        p["fluent"] = "fluency" not in p["metrics"] or p["metrics"]["fluency"][0] >= FLUENCY_FLOOR
    eligible = [p for p in points if primary in p["metrics"] and p["fluent"]]
    best = max(eligible, key=lambda p: (p["metrics"][primary][0], -p["n_heads"])) if eligible else None
    return {"task": cfg["task"], "model": config_of(manifest)["backend"]["model"], "metric": primary,
            "select": cfg["select"], "examples": len(manifest["examples"]), "unsteered": stats.get(UNSTEERED, {}),
            "points": points, "best": best}
