"""`driftlab pasta profile`: score every attention head by steering it alone (seed 002 Sec. 3.2).

For each (layer, head) the task runs on `n` train examples with PASTA on that head only;
the head's score is the task's primary metric averaged over them. Generation tasks batch
many heads at once: each row of a decode batch steers its own head (the engine takes
per-row head masks), so a batch holds `batch_size` (head, example) rows. Records, one per
(head, example), make the profile resumable after kill -9. The result, `profile.json`,
ranks the heads (best first; ties by layer, head) and `profile.png` shows the scores as a
layer x head heatmap with the unsteered baseline marked on the colour bar.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.attention.config import parse_heads
from driftlab.chat.base import Sampling
from driftlab.chat.factory import BackendSpec, Dtype, ModelName, make_backend
from driftlab.console import WorkProgress
from driftlab.errors import DriftlabError
from driftlab.pasta.evaluate import score_examples
from driftlab.pasta.heads import Profile
from driftlab.pasta.tasks import PromptName, Task, TaskName, get_task
from driftlab.protocol.registry import register
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import Interventions

BASELINE = (-1, -1)  # the (layer, head) key of the unsteered run


class ProfileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelName = DEFAULT_MODEL
    task: TaskName
    n: int = Field(16, ge=1, le=100000, description="train examples per head")
    alpha: float = Field(0.01, gt=0.0, lt=1.0, allow_inf_nan=False)
    layers: str | None = Field(None, description="profile only these layers ('0-5+9'); None: all")
    score: Literal["metric", "likelihood"] = Field(
        "metric", description="rank heads by the task metric (the paper) or by the reference answer's likelihood")
    prompt: PromptName = Field("original", description="the instruction's wording (App. A.1)")
    max_new_tokens: int | None = Field(None, ge=1, le=4096)
    data: str | None = None
    dtype: Dtype = "auto"
    device: str = "auto"
    batch_size: int = Field(16, ge=1, le=1024, description="(head, example) rows per decode batch")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ("device", "batch_size")

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


def _expected(manifest: dict[str, Any]) -> dict[str, int]:
    return {"head": (len(manifest.get("heads", [])) + 1) * len(manifest.get("examples", []))}


register("pasta-profile", RECORDS, _expected)


class HeadProfiler:
    def __init__(self, config: ProfileConfig, out: str | RunDir, backend, progress: bool = True) -> None:
        backend.capabilities.require(backend.name, Interventions.parse(["pasta:heads=all"]))
        self.config, self.backend, self.progress = config, backend, progress
        self.rundir = out if isinstance(out, RunDir) else RunDir(out)

    def _heads(self) -> list[tuple[int, int]]:
        cfg = self.backend.model.config.get_text_config()
        L, H = cfg.num_hidden_layers, cfg.num_attention_heads
        layers = sorted({layer for layer, _ in parse_heads(self.config.layers)}) if self.config.layers else range(L)
        if any(not 0 <= layer < L for layer in layers):
            raise DriftlabError(f"--layers {self.config.layers} is outside this model's {L} layers.",
                                hint=f"Layers are 0..{L - 1}.")
        return [(layer, h) for layer in layers for h in range(H)]

    def run(self) -> Profile:
        cfg = self.config
        task = get_task(cfg.task, cfg.max_new_tokens)
        examples = task.examples("train", cfg.n, cfg.data, cfg.prompt)
        if not examples:
            raise DriftlabError(f"No train examples for task {cfg.task}.", hint="Check --data.")
        by_id = {e.id: e for e in examples}
        heads = self._heads()
        with self.rundir.writing():
            plan = {"examples": list(by_id), "heads": heads, "models": {"agent": self.backend.describe()}}
            self.rundir.start(cfg.model_dump(mode="json"), plan, cfg.RESUME_IGNORES, protocol="pasta-profile")
            done = {r.key for r in self.rundir.records(RECORDS)}
            rows = [(lh, e) for lh in [BASELINE, *heads] for e in by_id if ("head", *lh, e) not in done]
            with WorkProgress(f"profile {cfg.task}", len(rows), self.progress, unit="runs") as bar:
                if cfg.score == "likelihood":
                    self._likelihood(task, rows, by_id, bar)
                elif task.mode == "generate":
                    self._generate(task, rows, by_id, bar)
                else:
                    self._score(task, rows, by_id, bar)
            profile = build_profile(self.rundir.path)
            (self.rundir.path / "profile.json").write_text(profile.model_dump_json(indent=1))
            plot_profile(profile, self.rundir.path / "profile.png", self._shape())
            self.rundir.update_manifest(completed=True)
        return profile

    def _shape(self) -> tuple[int, int]:
        cfg = self.backend.model.config.get_text_config()
        return cfg.num_hidden_layers, cfg.num_attention_heads

    def _generate(self, task: Task, rows, by_id, bar) -> None:
        """Batches of (head, example) rows, each row steering its own head."""
        iv = Interventions.parse([f"pasta:heads=all,alpha={self.config.alpha}"])
        sampling = Sampling(greedy=True, max_new_tokens=task.max_new_tokens)
        rendered = {e: self.backend.render(task.conversation(by_id[e], "pasta"), interventions=iv) for e in by_id}
        plain = {e: self.backend.render(task.conversation(by_id[e], "zero-shot")) for e in by_id}
        for start in range(0, len(rows), self.config.batch_size):
            chunk = rows[start : start + self.config.batch_size]
            steered = [(lh, e) for lh, e in chunk if lh != BASELINE]
            out = []
            if steered:
                replies = self.backend.generate_tokens(
                    [rendered[e].ids for _, e in steered], sampling, interventions=iv,
                    spans=[rendered[e].spans() for _, e in steered], row_heads=[((lh[0], lh[1]),) for lh, _ in steered],
                    cache_store=[False] * len(steered))
                out += [(lh, e, r.text) for (lh, e), r in zip(steered, replies, strict=True)]
            base = [e for lh, e in chunk if lh == BASELINE]
            if base:
                replies = self.backend.generate_tokens([plain[e].ids for e in base], sampling,
                                                       cache_store=[False] * len(base))
                out += [(BASELINE, e, r.text) for e, r in zip(base, replies, strict=True)]
            records = []
            for (layer, head), e, text in out:
                m = task.score_reply(by_id[e], text, self.config.data)
                records.append(HeadRecord(layer=layer, head=head, id=e, score=m[task.primary], metrics=m, text=text))
            self.rundir.append(records)
            bar.advance(len(chunk))

    def _steer(self, layer: int, head: int) -> tuple[Interventions, str]:
        """The interventions and baseline of one head's rows (BASELINE: no steering, zero-shot)."""
        if (layer, head) == BASELINE:
            return Interventions(), "zero-shot"
        return Interventions.parse([f"pasta:heads={layer}.{head},alpha={self.config.alpha}"]), "pasta"

    def _likelihood(self, task: Task, rows, by_id, bar) -> None:
        """Rank by the mean per-token log-probability of each example's reference answer
        (teacher-forced, no generation). A graded score where the task metric is 0 for every
        head on a small model (e.g. SmolLM2 never writes JSON unprompted), and far cheaper."""
        for (layer, head), ids in _group(rows).items():
            iv, baseline = self._steer(layer, head)
            examples = [by_id[e] for e in ids]
            convs = [task.conversation(ex, baseline) for ex in examples]
            scores = self.backend.loglikelihood(convs, [ex.answer for ex in examples], iv,
                                                batch_size=self.config.batch_size)
            self.rundir.append([
                HeadRecord(layer=layer, head=head, id=ex.id, score=s.logprob / s.n_tokens,
                           metrics={"answer_logprob_per_token": s.logprob / s.n_tokens})
                for ex, s in zip(examples, scores, strict=True)])
            bar.advance(len(ids))

    def _score(self, task: Task, rows, by_id, bar) -> None:
        """Scoring tasks: one log-likelihood pass over the examples per head."""
        for (layer, head), ids in _group(rows).items():
            iv, baseline = self._steer(layer, head)
            examples = [by_id[e] for e in ids]
            scored = score_examples(self.backend, task, examples, iv, baseline, [], self.config.batch_size,
                                    self.config.data)
            self.rundir.append([HeadRecord(layer=layer, head=head, id=ex.id, score=m[task.primary], metrics=m)
                                for ex, (m, _) in zip(examples, scored, strict=True)])
            bar.advance(len(ids))


def _group(rows) -> dict[tuple[int, int], list[str]]:
    """(head, example) rows -> example ids per head, in order."""
    per_head: dict[tuple[int, int], list[str]] = defaultdict(list)
    for lh, e in rows:
        per_head[lh].append(e)
    return per_head


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
    return Profile(model=cfg["model"], task=cfg["task"], metric=metric, alpha=cfg["alpha"],
                   n=len(manifest.get("examples", [])), baseline=sum(base) / len(base) if base else None,
                   scores=means)


def plot_profile(profile: Profile, path: Path, shape: tuple[int, int]) -> Path:
    """Layer x head heatmap of the per-head scores (unprofiled heads blank)."""
    import numpy as np
    from matplotlib.figure import Figure

    from driftlab.report.figures import save_png

    L, H = shape
    grid = np.full((L, H), np.nan)
    for layer, head, score in profile.scores:
        grid[layer, head] = score
    fig = Figure(figsize=(max(6.0, 0.45 * H + 3.5), max(4.0, 0.22 * L + 2.0)))
    ax = fig.subplots()
    im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower")
    bar = fig.colorbar(im, ax=ax, label=f"{profile.metric} when steering this head alone")
    base = ""
    if profile.baseline is not None:
        bar.ax.axhline(profile.baseline, color="red", linewidth=2)
        base = f" · red line: no steering ({profile.baseline:.3f})"
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"PASTA head profile: {profile.task} · {profile.model}\nalpha={profile.alpha} · "
                 f"n={profile.n} examples{base}", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)


def run_profile(config: ProfileConfig, out: str, progress: bool = True) -> Profile:
    rundir = RunDir(out)
    with rundir.writing():
        spec = BackendSpec(model=config.model, dtype=config.dtype, device=config.device)
        backend = make_backend(spec, run_dir=rundir.path)
        if not hasattr(backend, "generate_tokens"):
            raise DriftlabError(f"{config.model} is not a local model; head profiling steers its attention.",
                                hint="Profile a preset name or a local Hugging Face directory.")
        return HeadProfiler(config, rundir, backend, progress).run()
