"""The trade-off sweep of seed 000 Fig. 5/6: stability vs MMLU cost, per method and strength.

For every point (method, strength) of a grid, on one loaded backend:

* a self-chat under `--steer <point>` over the ordered pairs of five personas, one per
  category (20 ordered pairs; `personas`: "table2", the first of each category in driftlab's
  data, or "reference", the reference code's index 0 of each), probing the agent every
  round: stability;
* MMLU at turn T under the same intervention (`driftlab mmlu`'s protocol), against one
  plain baseline shared by all points: the drop.

The plain model is the point (none, 0). Every point is a pair of resumable run directories
under `RUN/points/<spec>/`, all continuing one plan recorded in the sweep's manifest (the
self-chat's personas and starters, the MMLU questions), so a killed sweep resumes, a
finished point is never recomputed, and every point sees the same data. The table behind
the figures (`RUN/sweep.csv`: stability, paired gain, MMLU drop per point) is computed
from the point directories by `driftlab.report.sweep`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, TypeAdapter, field_validator, model_validator

from driftlab.bench import CATEGORIES, load_personas
from driftlab.bench.starters import StarterSetName
from driftlab.chat.base import Sampling
from driftlab.console import err_console
from driftlab.errors import DriftlabError
from driftlab.protocol.mmlu import MMLU, MMLUConfig
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState, run_protocol
from driftlab.protocol.selfchat import PAPER_TOKENS, SelfChat, SelfChatConfig
from driftlab.steering.interventions import (
    KINDS,
    BaseIntervention,
    ClassifierFreeGuidance,
    InstABoost,
    OneSteer,
    SplitSoftmax,
    SystemPromptRepetition,
)

# Default strengths per method (weakest to strongest); `--point` replaces them.
GRID: dict[str, list[BaseIntervention]] = {
    "split-softmax": [SplitSoftmax(k=k) for k in (0.9, 0.8, 0.7, 0.5)],
    "spr": [SystemPromptRepetition(p=p) for p in (0.25, 0.5, 1.0)],
    "cfg": [ClassifierFreeGuidance(alpha=a) for a in (1.25, 1.5, 2.0, 3.0)],
    "instaboost": [InstABoost(m=m) for m in (2.0, 5.0, 10.0, 19.0)],
}
PLAIN = "plain"


PersonaSet = Literal["table2", "reference"]
# The reference code (likenneth/persona_drift, run.py) sweeps index 0 of each of its category
# lists (hundred_system_prompts.py); driftlab's ids for those prompts, in CATEGORIES order. Its
# pattern prompt reads "start your reply with the letter A"; driftlab's start-words-with-a is
# Table 2's wording of it.
REFERENCE_PERSONAS = {
    "multiple_choice": "academic-synonym",
    "persona": "loves-tennis",
    "pattern": "start-words-with-a",
    "memorization": "harry-potter-recommendation",
    "language": "french-with-english-translation",
}


def sweep_personas(personas: PersonaSet = "table2") -> list[str]:
    """The five sweep personas, one per category in CATEGORIES order.

    "table2" (the default, kept by name): the first persona of each category in driftlab's
    data (Table 2 order); "reference": the reference code's index 0 of each category
    (`REFERENCE_PERSONAS`), the five personas behind the paper's Fig. 5/6.
    """
    if personas == "reference":
        return [REFERENCE_PERSONAS[c] for c in CATEGORIES]
    if personas != "table2":
        raise DriftlabError(f"Unknown sweep persona set {personas!r}.", hint="Use 'table2' or 'reference'.")
    everyone = load_personas()
    return [next(p.id for p in everyone if p.category == c) for c in CATEGORIES]


def paper_pairs(personas: PersonaSet = "table2") -> list[tuple[str, str]]:
    """The 20 ordered (agent, user) pairs of the five sweep personas (`sweep_personas`).

    Ordered so that any first N pairs spread over the agents: pair k has agent k mod 5 and
    user (k mod 5 + 1 + k // 5) mod 5, so `--pairs 5` already covers every category once.
    """
    five = sweep_personas(personas)
    return [(five[i], five[(i + d) % 5]) for d in range(1, 5) for i in range(5)]


class SweepConfig(ProtocolConfig):
    """The grid and the per-point protocols (recorded in the sweep's manifest)."""

    grid: dict[str, list[OneSteer]] = Field(default_factory=lambda: {m: list(v) for m, v in GRID.items()})
    personas: PersonaSet = Field("table2", description="the five personas whose ordered pairs are swept "
                                                        "(without explicit pair_ids): 'table2' or 'reference'")
    pair_ids: list[tuple[str, str]] = Field(default_factory=paper_pairs)
    rounds: int = Field(8, ge=1, le=1000)
    probe_after: Literal["user", "agent"] = Field("user", description="where the self-chats probe (SelfChatConfig)")
    starters: StarterSetName = "reference"
    sampling: Sampling = Sampling(max_new_tokens=PAPER_TOKENS)
    seed: int = Field(0, ge=0)
    mmlu_n: int = Field(100, ge=1, le=14042)
    mmlu_turn: int = Field(4, ge=0, le=64)
    history_tokens: int = Field(64, ge=1, le=32768)
    data: str | None = None
    batch_size: int = Field(32, ge=1, le=4096)

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")

    @model_validator(mode="before")
    @classmethod
    def _pairs_of_the_persona_set(cls, data: Any) -> Any:
        if isinstance(data, dict) and "pair_ids" not in data and data.get("personas", "table2") != "table2":
            data = {**data, "pair_ids": paper_pairs(data["personas"])}
        return data

    @field_validator("grid")
    @classmethod
    def _valid_grid(cls, grid: dict[str, list[BaseIntervention]]) -> dict[str, list[BaseIntervention]]:
        for method, points in grid.items():
            if method not in KINDS:
                raise ValueError(f"unknown method '{method}'; use one of {', '.join(sorted(KINDS))}")
            if not points or any(p.kind != method for p in points):
                raise ValueError(f"the grid of {method} must list {method} specs, got {[p.spec() for p in points]}")
        if not grid:
            raise ValueError("the grid is empty")
        return grid

    def points(self) -> list[tuple[str, BaseIntervention | None]]:
        """(method, intervention) for the plain model (None) and every grid point, in grid order."""
        return [(PLAIN, None)] + [(m, p) for m, points in self.grid.items() for p in points]

    def selfchat(self, point: BaseIntervention | None) -> SelfChatConfig:
        return SelfChatConfig(
            backend=self.backend, pairs=0, pair_ids=self.pair_ids, rounds=self.rounds, sampling=self.sampling,
            seed=self.seed, batch_size=self.batch_size, steer=[point] if point else [], starters=self.starters,
            probe_after=self.probe_after,
        )

    def mmlu(self, point: BaseIntervention | None) -> MMLUConfig:
        return MMLUConfig(
            backend=self.backend, n=self.mmlu_n, turn=self.mmlu_turn, steer=[point] if point else [],
            seed=self.seed, history_tokens=self.history_tokens, data=self.data, plain=point is None,
        )


def point_dir(out: str | Path, spec: str) -> Path:
    """RUN/points/<spec> of a point's `--steer` spec ('' for the plain model)."""
    return Path(out) / "points" / (spec.replace(":", "_").replace("=", "").replace(",", "_") or PLAIN)


@register
class Sweep(Protocol[SweepConfig]):
    """Every point of the grid on one backend: a unit is one point (its self-chat, then its MMLU run)."""

    name = "sweep"
    records = TypeAdapter(dict)  # none of its own: its records live in the point directories

    def check(self) -> None:
        SelfChat(self.config.selfchat(None)).check()
        MMLU(self.config.mmlu(None)).check()

    def plan(self) -> dict[str, Any]:
        return {"selfchat": SelfChat(self.config.selfchat(None)).draw_plan(),
                "mmlu": MMLU(self.config.mmlu(None)).draw_plan()}

    def describe(self) -> dict[str, Any]:
        return {"points": [p.spec() if p else "" for _, p in self.config.points()],
                "models": {"agent": self.backend.describe()}}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {}

    def units(self, state: RunState) -> Iterator[tuple[int, BaseIntervention | None]]:
        self._plan = state.manifest
        for i, (_, point) in enumerate(self.config.points()):
            yield i, point

    def run_unit(self, unit: tuple[int, BaseIntervention | None]) -> list:
        i, point = unit
        cfg = self.config
        if self.progress:
            err_console().print(f"sweep: point {i + 1}/{len(cfg.points())}: {point.spec() if point else 'plain'}",
                                highlight=False, markup=False)
        where = point_dir(self.run_dir, point.spec() if point else "")
        run_protocol(SelfChat(cfg.selfchat(point), self.backend), where / "selfchat", plan=self._plan["selfchat"],
                     progress=self.progress)
        run_protocol(MMLU(cfg.mmlu(point), self.backend), where / "mmlu", plan=self._plan["mmlu"],
                     progress=self.progress)
        return []
