"""`driftlab pasta tune`: choose how many heads to steer on a validation split.

Seed 002 picks the steered set's size |H| per task by cross-validation (Sec. 4: top-k from
several values, "select |H| by cross validation"): too few heads change nothing, too many
break the model. `tune` builds one head set per top-k from the given profiles (the same
selection as `driftlab pasta select`), runs PASTA with each on the task's validation split,
and keeps the best by the task's primary metric (ties go to fewer heads). The unsteered
model is scored on the same examples as a reference. Writes `tune.json` (every point with
a 95% CI), `heads.json` (the best set, pastalib's format, ready for `--heads`) and
`tune.png` (metric against |H|). The run directory resumes after kill -9; its manifest
records the head sets themselves, so a later change to a profile file cannot mix results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.chat.factory import BackendSpec, Dtype, ModelName, make_backend
from driftlab.console import WorkProgress
from driftlab.errors import DriftlabError
from driftlab.pasta.evaluate import metric_cis, score_batches
from driftlab.pasta.heads import load_profile, save_heads, select
from driftlab.pasta.metrics import FLUENCY_FLOOR
from driftlab.pasta.tasks import PromptName, TaskName, get_task
from driftlab.protocol.registry import register
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import Interventions

UNSTEERED = 0  # the topk of the reference point: no heads, the zero-shot prompt


class TuneConfig(BaseModel):
    """A search over the number of steered heads (recorded in the run's manifest)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = DEFAULT_MODEL
    task: TaskName
    profiles: list[str] = Field(min_length=1, description="profile.json files the head sets are selected from")
    select: Literal["intersection", "union", "task-specific"] = "intersection"
    topk: list[int] = Field(default_factory=lambda: [10, 20, 40, 80], min_length=1)
    n: int | None = Field(16, ge=1, description="validation examples (None: all)")
    alpha: float = Field(0.01, gt=0.0, lt=1.0, allow_inf_nan=False)
    prompt: PromptName = "original"
    max_new_tokens: int | None = Field(None, ge=1, le=4096)
    data: str | None = None
    dtype: Dtype = "auto"
    device: str = "auto"
    batch_size: int = Field(8, ge=1, le=1024)

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ("device", "batch_size")

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


def _expected(manifest: dict[str, Any]) -> dict[str, int]:
    return {"example": (len(manifest.get("points", [])) + 1) * len(manifest.get("examples", []))}


register("pasta-tune", RECORDS, _expected)


def head_sets(config: TuneConfig) -> list[dict[str, Any]]:
    """One point per top-k that gives a new, non-empty head set: {"topk", "heads"}.

    A larger k whose set equals a smaller k's (possible with an intersection) would repeat
    the same run, and an empty intersection is the unsteered model: both are left out.
    """
    profiles = [load_profile(p) for p in config.profiles]
    other = sorted({p.model for p in profiles} - {config.model})
    if other:
        raise DriftlabError(f"The profiles come from {', '.join(other)}, not {config.model}.",
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


class HeadTuner:
    def __init__(self, config: TuneConfig, out: str | RunDir, backend, progress: bool = True) -> None:
        backend.capabilities.require(backend.name, Interventions.parse(["pasta:heads=all"]))
        if get_task(config.task).mode == "score" and not backend.capabilities.loglikelihood:
            raise DriftlabError(f"{backend.name} cannot score log-likelihoods, which task {config.task} needs.",
                                hint="Use a local model.")
        self.config, self.backend, self.progress = config, backend, progress
        self.rundir = out if isinstance(out, RunDir) else RunDir(out)

    def run(self) -> dict[str, Any]:
        cfg = self.config
        task = get_task(cfg.task, cfg.max_new_tokens)
        examples = task.examples("valid", cfg.n, cfg.data, cfg.prompt)
        if not examples:
            raise DriftlabError(f"No validation examples for task {cfg.task}.",
                                hint="Check --data (a real file's rows serve as the validation split).")
        with self.rundir.writing():
            plan = {"examples": [e.id for e in examples], "points": head_sets(cfg),
                    "models": {"agent": self.backend.describe()}}
            manifest = self.rundir.start(cfg.model_dump(mode="json"), plan, cfg.RESUME_IGNORES, protocol="pasta-tune")
            by_id = {e.id: e for e in examples}
            examples = [by_id[i] for i in manifest["examples"]]
            runs = [(UNSTEERED, Interventions(), "zero-shot")] + [
                (p["topk"], Interventions.parse([f"pasta:heads={_spec(p['heads'])},alpha={cfg.alpha}"]), "pasta")
                for p in manifest["points"]]
            done = {r.key for r in self.rundir.records(RECORDS)}
            todo = [(k, iv, b, [e for e in examples if ("example", k, e.id) not in done]) for k, iv, b in runs]
            with WorkProgress(f"pasta tune {cfg.task}", sum(len(t[3]) for t in todo), self.progress,
                              unit="examples") as bar:
                for k, iv, baseline, pending in todo:
                    score_batches(self.rundir, bar, PointRecord, {"topk": k}, self.backend, task, pending, iv,
                                  baseline, [], cfg.batch_size, cfg.data)
            result = summarize(self.rundir.path)
            (self.rundir.path / "tune.json").write_text(json.dumps(result, indent=1))
            plot_tune(result, self.rundir.path / "tune.png")
            self.rundir.update_manifest(completed=True)
            if result["best"] is not None:  # else every point was degenerate: nothing to recommend
                save_heads([tuple(h) for h in result["best"]["heads"]], self.rundir.path / "heads.json")
        return result


def _spec(heads: list[list[int]]) -> str:
    return "+".join(f"{layer}.{head}" for layer, head in heads)


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
    return {"task": cfg["task"], "model": cfg["model"], "metric": primary, "select": cfg["select"],
            "examples": len(manifest["examples"]), "unsteered": stats.get(UNSTEERED, {}), "points": points,
            "best": best}


def plot_tune(result: dict[str, Any], path: Path) -> Path:
    """The primary metric against the number of steered heads, with 95% CIs and the unsteered band."""
    from matplotlib.figure import Figure

    from driftlab.report.figures import save_png

    metric = result["metric"]
    pts = [p for p in result["points"] if metric in p["metrics"]]
    x = [p["n_heads"] for p in pts]
    mean = [p["metrics"][metric][0] for p in pts]
    err = [[m - p["metrics"][metric][1] for m, p in zip(mean, pts, strict=True)],
           [p["metrics"][metric][2] - m for m, p in zip(mean, pts, strict=True)]]
    fig = Figure(figsize=(5.5, 3.6))
    ax = fig.subplots()
    if metric in result["unsteered"]:
        m, lo, hi = result["unsteered"][metric]
        ax.axhspan(lo, hi, color="tab:gray", alpha=0.2)
        ax.axhline(m, color="tab:gray", linestyle="--", label=f"no steering ({m:.2f})")
    ax.errorbar(x, mean, yerr=err, marker="o", color="tab:red", capsize=3, label="PASTA")
    for p, xi, yi in zip(pts, x, mean, strict=True):
        note = "" if p["fluent"] else f" fluency {p['metrics']['fluency'][0]:.1f} < {FLUENCY_FLOOR:g}"
        ax.annotate(f"k={p['topk']}{note}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7,
                    color="black" if p["fluent"] else "tab:gray")
    degenerate = [(xi, yi) for p, xi, yi in zip(pts, x, mean, strict=True) if not p["fluent"]]
    if degenerate:
        ax.plot(*zip(*degenerate), marker="x", markersize=10, color="black", linestyle="none",
                label="degenerate replies (not eligible)")
    best = result["best"]
    if best is not None:
        ax.plot([best["n_heads"]], [best["metrics"][metric][0]], marker="*", markersize=14, color="gold",
                markeredgecolor="black", linestyle="none", label=f"chosen: {best['n_heads']} heads")
    ax.set_xscale("log")
    ax.set_xticks(x, [str(v) for v in x])  # the head counts tried, not powers of ten
    ax.minorticks_off()
    ax.margins(x=0.25)  # room for the labels
    ax.set_xlabel("steered heads |H| (log scale)")
    ax.set_ylabel(f"{metric} on the validation split")
    ax.set_title(f"PASTA head count: {result['task']} · {result['model']}\n"
                 f"{result['select']} of the profiles' top-k · n={result['examples']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def run_tune(config: TuneConfig, out: str, progress: bool = True) -> dict[str, Any]:
    head_sets(config)  # bad profiles fail before a run directory or a model exists
    rundir = RunDir(out)
    with rundir.writing():
        spec = BackendSpec(model=config.model, dtype=config.dtype, device=config.device)
        return HeadTuner(config, rundir, make_backend(spec, run_dir=rundir.path), progress).run()
