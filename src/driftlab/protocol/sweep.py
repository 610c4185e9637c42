"""The trade-off sweep of seed 000 Fig. 5/6: stability vs MMLU cost, per method and strength.

For every point (method, strength) of a grid, on one loaded backend:

* a self-chat under `--steer <point>` over the ordered pairs of the paper's five personas
  (the first of each category: 20 ordered pairs), probing the agent every round: stability;
* MMLU at turn T under the same intervention (`driftlab mmlu`'s protocol), against one
  plain baseline shared by all points: the drop.

The plain model is the point (none, 0). Every point is a pair of resumable run directories
under `RUN/points/<spec>/`, so a killed sweep resumes and a finished point is never
recomputed. `RUN/sweep.csv` holds the table behind the figures (report.sweep).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from driftlab.bench import CATEGORIES, load_personas
from driftlab.bench.starters import StarterSetName
from driftlab.chat.base import ChatBackend, Sampling
from driftlab.chat.factory import ModelName, Runtime, SpanMode
from driftlab.console import err_console
from driftlab.protocol.mmlu import MMLU, MMLUConfig, correctness, drop
from driftlab.protocol.registry import register
from driftlab.protocol.selfchat import PAPER_TOKENS, SelfChat, SelfChatConfig
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import KINDS, Interventions

# Default strengths per method (weakest to strongest); `--grid` overrides them.
GRID: dict[str, list[str]] = {
    "split-softmax": ["split-softmax:k=0.9", "split-softmax:k=0.8", "split-softmax:k=0.7", "split-softmax:k=0.5"],
    "spr": ["spr:p=0.25", "spr:p=0.5", "spr:p=1"],
    "cfg": ["cfg:alpha=1.25", "cfg:alpha=1.5", "cfg:alpha=2", "cfg:alpha=3"],
    "instaboost": ["instaboost:m=2", "instaboost:m=5", "instaboost:m=10", "instaboost:m=19"],
}
PLAIN = "plain"
register("sweep", TypeAdapter(dict), lambda manifest: {})  # its records live in the point directories


def paper_pairs() -> list[tuple[str, str]]:
    """The 20 ordered (agent, user) pairs of the first persona of each of the five categories.

    Ordered so that any first N pairs spread over the agents: pair k has agent k mod 5 and
    user (k mod 5 + 1 + k // 5) mod 5, so `--pairs 5` already covers every category once.
    """
    personas = load_personas()
    five = [next(p.id for p in personas if p.category == c) for c in CATEGORIES]
    return [(five[i], five[(i + d) % 5]) for d in range(1, 5) for i in range(5)]


class SweepConfig(BaseModel):
    """The grid and the per-point protocols (recorded in the sweep's manifest)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = "smollm2-135m"
    grid: dict[str, list[str]] = Field(default_factory=lambda: {m: list(v) for m, v in GRID.items()})
    pair_ids: list[tuple[str, str]] = Field(default_factory=paper_pairs)
    rounds: int = Field(8, ge=1, le=1000)
    starters: StarterSetName = "reference"
    sampling: Sampling = Sampling(max_new_tokens=PAPER_TOKENS)
    seed: int = Field(0, ge=0)
    mmlu_n: int = Field(100, ge=1, le=14042)
    mmlu_turn: int = Field(4, ge=0, le=64)
    history_tokens: int = Field(64, ge=1, le=32768)
    data: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    span: SpanMode = "content"
    runtime: Runtime = Runtime()
    batch_size: int = Field(32, ge=1, le=4096)

    @field_validator("grid")
    @classmethod
    def _valid_grid(cls, grid: dict[str, list[str]]) -> dict[str, list[str]]:
        out = {}
        for method, specs in grid.items():
            if method not in KINDS:
                raise ValueError(f"unknown method '{method}'; use one of {', '.join(sorted(KINDS))}")
            normalised = [Interventions.parse([s]).specs()[0] for s in specs]
            wrong = [s for s in normalised if not s.startswith(method + ":")]
            if wrong or not normalised:
                raise ValueError(f"the grid of {method} must list {method} specs, got {specs}")
            out[method] = normalised
        if not out:
            raise ValueError("the grid is empty")
        return out

    def points(self) -> list[tuple[str, str]]:
        """(method, spec) for the plain model and every grid point, in grid order."""
        return [(PLAIN, "")] + [(m, s) for m, specs in self.grid.items() for s in specs]

    def selfchat(self, spec: str) -> SelfChatConfig:
        return SelfChatConfig(
            model=self.model, pairs=0, pair_ids=self.pair_ids, rounds=self.rounds, sampling=self.sampling,
            seed=self.seed, dtype=self.dtype, device=self.device, span=self.span, batch_size=self.batch_size,
            runtime=self.runtime, steer=[spec] if spec else [], starters=self.starters,
        )

    def mmlu(self, spec: str) -> MMLUConfig:
        return MMLUConfig(
            model=self.model, n=self.mmlu_n, turn=self.mmlu_turn, steer=[spec] if spec else [], seed=self.seed,
            history_tokens=self.history_tokens, dtype=self.dtype, device=self.device, span=self.span,
            runtime=self.runtime, data=self.data, plain=not spec,
        )


def point_dir(out: Path, spec: str) -> Path:
    return out / "points" / (spec.replace(":", "_").replace("=", "").replace(",", "_") or PLAIN)


def run_sweep(config: SweepConfig, out: str | Path, backend: ChatBackend, progress: bool = True) -> pd.DataFrame:
    """Run (or resume) every point on one backend; return and write the table (sweep.csv).

    Besides each point's own stability and CI, `stability_gain` is its stability minus the
    plain model's, paired by conversation (every point runs the same pairs, starters and
    seeds), with a bootstrap CI over conversations: the paired CI is far narrower than the
    two independent ones, which is what comparing methods needs.
    """
    from driftlab.report.metrics import bootstrap_mean_ci, summarize_run

    out = Path(out)
    rd = RunDir(out)
    rows: list[dict[str, Any]] = []
    with rd.writing():
        rd.start(config.model_dump(mode="json"), {"points": [s for _, s in config.points()]},
                 ("device", "batch_size", "runtime"), protocol="sweep")
        plain_correct: dict[int, float] = {}
        plain_stability = pd.Series(dtype=float)
        for i, (method, spec) in enumerate(config.points()):
            where = point_dir(out, spec)
            if progress:
                err_console().print(f"sweep: point {i + 1}/{len(config.points())}: {spec or 'plain'}",
                                    highlight=False, markup=False)
            SelfChat(config.selfchat(spec), where / "selfchat", backend, progress=progress).run()
            MMLU(config.mmlu(spec), where / "mmlu", backend, progress=progress).run()
            correct = correctness(where / "mmlu")
            if not spec:
                plain_correct = correct["plain"]
            steered = correct["steered"] if spec else plain_correct
            summary = summarize_run(where / "selfchat")
            ov = summary.overall
            agent = ov[(ov.target == "agent") & (ov.category == "all")].iloc[0]
            per_conv = _per_conversation(summary.scores)
            if not spec:
                plain_stability = per_conv
            gain = (per_conv - plain_stability).dropna()
            gain_ci = bootstrap_mean_ci(gain.to_numpy(float))
            d = drop(plain_correct, steered)
            rows.append({
                "method": method, "spec": spec or "plain", "strength_rank": _rank(config, method, spec),
                "stability": agent["mean"], "stability_ci_low": agent["ci_low"], "stability_ci_high": agent["ci_high"],
                "stability_gain": float(gain.mean()) if len(gain) else float("nan"),
                "stability_gain_ci_low": gain_ci[0], "stability_gain_ci_high": gain_ci[1],
                "mmlu_accuracy": sum(steered.values()) / len(steered), "mmlu_drop": d["mean"],
                "mmlu_drop_ci_low": d["ci"][0], "mmlu_drop_ci_high": d["ci"][1], "n_conversations": int(agent["n"]),
            })
        table = pd.DataFrame(rows)
        table.to_csv(out / "sweep.csv", index=False)
        rd.update_manifest(completed=True)
    return table


def _per_conversation(scores: pd.DataFrame) -> pd.Series:
    """Each conversation's agent stability (mean probe score over rounds), indexed by pair."""
    agent = scores[(scores.target == "agent") & (scores.condition == "persona")]
    return agent.groupby("pair")["score"].mean()


def _rank(config: SweepConfig, method: str, spec: str) -> int:
    return 0 if not spec else config.grid[method].index(spec) + 1
