"""The trade-off sweep of the persona-drift paper, Fig. 5/6: stability vs MMLU cost, per method and strength.

For every point (method, strength) of a grid, on one loaded backend:

* a self-chat under `--steer <point>` over the ordered pairs of five personas, one per
  category (20 ordered pairs; `personas`: "table2", the first of each category in driftlab's
  data, or "reference", the reference code's index 0 of each), probing the agent every
  round: stability;
* MMLU at turn T under the same intervention (`driftlab mmlu`'s protocol), against one
  plain baseline shared by all points: the drop. The dialogs before the questions are the
  point's own: the first `mmlu_histories` pairs of its self-chat (default 1, the paper's
  choice), cut before round T (`mmlu_history` "dialog"), the questions spread evenly over
  them, so a point's stability gain and MMLU cost are measured on the same dialogs and no
  new dialog is generated (sweeps recorded before this option asked after a separate
  self-chat: "selfchat"). The dialogs' text differs between points (each is generated under
  its point's intervention); the persona pairs, starters and seeds do not. T is
  counted as the paper's reference code counts turns (`mmlu_turn_counting`, see
  `driftlab.protocol.mmlu.question_round`).

`benchmark` says what prices a point: "mmlu" (the default, all of the above) or
"lm-eval:<task>", an lm-evaluation-harness task run on the point's model under its steer
(`driftlab.protocol.lmeval`: a seeded sample of `benchmark_n` items, asked under the agent
personas' system prompts, the drop tested per item as MMLU's per question); its records are
then `RUN/points/<spec>/benchmark/` instead of `.../mmlu/`. Sweeps recorded before the option
priced by MMLU (`LEGACY`).

The plain model is the point (none, 0). Every point is a pair of resumable run directories
under `RUN/points/<spec>/`, all continuing one plan recorded in the sweep's manifest (the
self-chat's personas and starters, the MMLU questions), so a killed sweep resumes, a
finished point is never recomputed, and every point sees the same data. The same command
with more `--point`s adds them to a sweep (finished or not); a point cannot be dropped.

No confounds by construction: points are only comparable if they differ in nothing but the
intervention. Before a point runs, its recorded manifests are compared with what this sweep
would write now (config, plan, input hashes, package versions, model facts:
`point_differences`); a stale point (run by other code, on other data or settings) is moved
to `RUN/stale/` with a message and run again. `check_points` refuses to combine points whose
manifests differ in anything but the intervention; the table behind the figures
(`RUN/sweep.csv`: stability, paired gain, MMLU drop per point) is computed from the point
directories by `driftlab.report.sweep`, after that check.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, TypeAdapter, ValidationInfo, field_validator, model_validator

from driftlab.bench import CATEGORIES, load_personas
from driftlab.bench.starters import StarterSetName
from driftlab.chat.base import Sampling
from driftlab.console import err_console
from driftlab.errors import DriftlabError
from driftlab.protocol import lmeval
from driftlab.protocol.divergence import UNMEASURED
from driftlab.protocol.lmeval import LMEvalBench, LMEvalConfig
from driftlab.protocol.mmlu import (
    MMLU,
    MMLUConfig,
    TieRule,
    TurnCounting,
    dialog_history,
    history_entries,
    question_round,
)
from driftlab.protocol.registry import register
from driftlab.protocol.runner import (
    Protocol,
    ProtocolConfig,
    RunState,
    config_of,
    directions_given,
    recorded_dtype,
    run_protocol,
)
from driftlab.protocol.selfchat import PAPER_TOKENS, ProbeTokens, SelfChat, SelfChatConfig, probe_budget
from driftlab.records.rundir import RunDir, versions
from driftlab.steering.interventions import (
    KINDS,
    BaseIntervention,
    ClassifierFreeGuidance,
    InstABoost,
    OneSteer,
    SplitSoftmax,
    SystemPromptRepetition,
    WhenDrifting,
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
    probe_after: Literal["user", "agent"] = Field("agent", description="where the self-chats probe (SelfChatConfig)")
    starters: StarterSetName = "reference"
    sampling: Sampling = Sampling(max_new_tokens=PAPER_TOKENS)
    probe_tokens: ProbeTokens = Field(PAPER_TOKENS, description="most tokens per probe reply (SelfChatConfig)")
    seed: int = Field(0, ge=0)
    mmlu_n: int = Field(100, ge=1, le=14042)
    mmlu_turn_counting: TurnCounting = Field(
        "paper", description="how mmlu_turn counts: 'paper' (messages, as the reference code; 4 = round 3) or 'round'")
    mmlu_turn: int = Field(4, ge=0, le=64)
    mmlu_history: Literal["dialog", "selfchat"] = Field(
        "dialog", description="the dialog before the MMLU question: the point's own self-chat (first pair) or a "
                              "separate probe-free self-chat (sweeps recorded before this option)")
    mmlu_histories: int = Field(1, ge=1, le=1000, description="the point's dialogs its MMLU questions are spread "
                                                              "over (1: the paper's choice, one dialog)")
    mmlu_ties: TieRule = Field("random", description="MMLU letters tied at the top: 'random' (seeded) or 'first'")
    history_tokens: int = Field(64, ge=1, le=32768)
    data: str | None = None
    batch_size: int = Field(32, ge=1, le=4096)
    benchmark: str = Field("mmlu", description="what prices a point: 'mmlu' or 'lm-eval:<task>' (an "
                                               "lm-evaluation-harness task)")
    benchmark_include: str | None = Field(None, description="a folder of lm-eval task YAMLs (lm-eval benchmarks only)")
    benchmark_n: int | None = Field(None, ge=1, le=1_000_000, description="items of the lm-eval task per point, a "
                                                                          "seeded sample (default 100; lm-eval only)")
    when_drifting: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description=(
        "every steered point acts only once a conversation has drifted (`when-drifting:r=R`: where its pi has "
        "fallen below R times its first turn's), in its self-chat and what prices it"))
    when_drifting_by: Literal["pi", "projection"] = Field("pi", description=(
        "what --when-drifting compares with the first turn: pi, or the persona's projection (needs directions)"))

    # The grid is compared point by point when the sweep starts its units (`Sweep._add_points`):
    # a resume may add points, never drop one.
    kl: bool = Field(False, description="measure every agent reply's KLs as it is generated (SelfChatConfig.kl), at "
                                        "every point whose replies come from the model's own distribution (not "
                                        "CFG or when-drifting)")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size", "grid")
    # Sweeps recorded before these options: MMLU at a round, after a separate self-chat.
    LEGACY: ClassVar[dict[str, Any]] = {"mmlu_turn_counting": "round", "mmlu_history": "selfchat", "mmlu_ties": "first",
                                        "mmlu_histories": 1, "probe_after": "user",
                                        "probe_tokens": "turn", "benchmark": "mmlu", "benchmark_include": None,
                                        "benchmark_n": None, "when_drifting": None, "when_drifting_by": "pi", "kl": False}

    _probe_budget = field_validator("probe_tokens", mode="before")(probe_budget)

    @model_validator(mode="after")
    def _a_turns_budget_is_turn(self) -> SweepConfig:
        """As SelfChatConfig: a probe budget equal to the turn's is recorded as "turn"."""
        if self.probe_tokens == self.sampling.max_new_tokens:
            object.__setattr__(self, "probe_tokens", "turn")
        directions_given(self.backend, [p for points in self.grid.values() for p in points])
        return self

    @model_validator(mode="after")
    def _gateable(self) -> SweepConfig:
        """`when_drifting` decides per conversation; CFG and SPR act on a whole batch."""
        if self.when_drifting is not None:
            batch_wide = sorted(set(self.grid) & WhenDrifting.ungateable)
            if batch_wide:
                raise ValueError(f"--when-drifting gates each conversation's steer, and {batch_wide[0]} acts on the "
                                 "whole batch: leave it out of the grid, or run it in a sweep without --when-drifting")
            if self.when_drifting_by == "projection" and not self.backend.directions:
                raise ValueError("--when-drifting-by projection reads persona directions, and none were given: "
                                 "compute them with `driftlab directions --out DIR`, then pass --directions DIR")
        return self

    def steer(self, point: BaseIntervention | None) -> list[BaseIntervention]:
        """A point's steer: none for plain; with `when_drifting`, the point under the gate."""
        if point is None:
            return []
        if self.when_drifting is None:
            return [point]
        return [point, WhenDrifting(r=self.when_drifting, by=self.when_drifting_by)]

    @field_validator("mmlu_turn")
    @classmethod
    def _turn_as_counted(cls, turn: int, info: ValidationInfo) -> int:
        question_round(turn, info.data.get("mmlu_turn_counting", "paper"))
        return turn

    @field_validator("benchmark")
    @classmethod
    def _known_benchmark(cls, benchmark: str) -> str:
        task = lmeval.task_of(benchmark)
        if benchmark != "mmlu" and (not task or task != task.strip() or any(c.isspace() for c in task)):
            raise ValueError("use 'mmlu' or 'lm-eval:<task>' (an lm-evaluation-harness task name)")
        return benchmark

    @model_validator(mode="after")
    def _benchmark_options(self) -> SweepConfig:
        """lm-eval options only with an lm-eval benchmark; its sample size recorded as run (default 100);
        no point it cannot run (an intervention that edits the conversation: lm-eval sends raw text)."""
        if self.task is None:
            if self.benchmark_include is not None or self.benchmark_n is not None:
                raise ValueError("--benchmark-include and --benchmark-n apply to --benchmark lm-eval:<task>; MMLU's "
                                 "size is --mmlu-n")
            return self
        if self.benchmark_n is None:
            object.__setattr__(self, "benchmark_n", 100)
        edits = sorted({p.kind for points in self.grid.values() for p in points if p.hook == "conversation"})
        if edits:
            raise ValueError(f"{', '.join(edits)} edits the conversation, and lm-eval sends raw text: an lm-eval "
                             f"benchmark cannot price it (leave it out of the grid, or use --benchmark mmlu)")
        return self

    @property
    def task(self) -> str | None:
        """The lm-eval task of an lm-eval benchmark (None: MMLU)."""
        return lmeval.task_of(self.benchmark)

    @property
    def children(self) -> tuple[str, str]:
        """A point's run directories: its self-chat and what prices it."""
        return children(self.benchmark)

    @model_validator(mode="after")
    def _dialog_long_enough(self) -> SweepConfig:
        needed = question_round(self.mmlu_turn, self.mmlu_turn_counting) - 1
        if self.task is None and self.mmlu_history == "dialog" and needed > self.rounds:
            raise ValueError(f"the MMLU question at turn {self.mmlu_turn} ({self.mmlu_turn_counting} counting) "
                             f"follows {needed} rounds of the point's dialog, which has {self.rounds}")
        if (self.mmlu_history == "dialog" or self.task) and self.pair_ids and self.mmlu_histories > len(self.pair_ids):
            raise ValueError(f"{'MMLU' if self.task is None else 'lm-eval'} over {self.mmlu_histories} dialogs needs as many persona pairs; the sweep has "
                             f"{len(self.pair_ids)}")
        return self

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
            specs = [p.spec() for p in points]
            twice = sorted({s for s in specs if specs.count(s) > 1})
            if twice:  # one point run once but tested twice would inflate the Holm family
                raise ValueError(f"the grid lists {', '.join(twice)} more than once; give each point once")
        if not grid:
            raise ValueError("the grid is empty")
        return grid

    def points(self) -> list[tuple[str, BaseIntervention | None]]:
        """(method, intervention) for the plain model (None) and every grid point, in grid order."""
        return [(PLAIN, None)] + [(m, p) for m, points in self.grid.items() for p in points]

    def selfchat(self, point: BaseIntervention | None) -> SelfChatConfig:
        steer = self.steer(point)
        return SelfChatConfig(
            backend=self.backend, pairs=0, pair_ids=self.pair_ids, rounds=self.rounds, sampling=self.sampling,
            probe_tokens=self.probe_tokens, seed=self.seed, batch_size=self.batch_size, steer=steer, starters=self.starters,
            probe_after=self.probe_after, kl=self.kl and not {i.kind for i in steer} & set(UNMEASURED),
        )

    def mmlu(self, point: BaseIntervention | None) -> MMLUConfig:
        return MMLUConfig(
            backend=self.backend, n=self.mmlu_n, turn=self.mmlu_turn, turn_counting=self.mmlu_turn_counting,
            history="dialog" if self.mmlu_history == "dialog" else "selfchat", steer=self.steer(point),
            histories=self.mmlu_histories, ties=self.mmlu_ties, seed=self.seed, history_tokens=self.history_tokens, data=self.data, plain=point is None,
        )

    def bench(self, point: BaseIntervention | None) -> LMEvalConfig:
        """The point's lm-eval benchmark (an lm-eval sweep only)."""
        if self.task is None:
            raise ValueError("an MMLU sweep has no lm-eval benchmark")
        return LMEvalConfig(backend=self.backend, task=self.task, include=self.benchmark_include,
                            n=self.benchmark_n or 100, steer=self.steer(point), histories=self.mmlu_histories,
                            seed=self.seed, batch_size=self.batch_size)


def point_dir(out: str | Path, spec: str) -> Path:
    """RUN/points/<spec> of a point's `--steer` spec ('' for the plain model)."""
    return Path(out) / "points" / (spec.replace(":", "_").replace("=", "").replace(",", "_") or PLAIN)


@register
class Sweep(Protocol[SweepConfig]):
    """Every point of the grid on one backend: a unit is one point (its self-chat, then its MMLU or lm-eval run)."""

    name = "sweep"
    records = TypeAdapter(dict)  # none of its own: its records live in the point directories

    def check(self) -> None:
        cfg = self.config
        if cfg.task is not None:  # before any model loads: lm-eval, a local model, the task, its data and metric
            lmeval.require_lm_eval()
            lmeval.require_local(cfg.backend)
            lmeval.check_task(cfg.task, cfg.benchmark_include)
        SelfChat(cfg.selfchat(None)).check()
        if cfg.task is None:
            MMLU(cfg.mmlu(None)).check()

    def require(self) -> None:
        if self.config.task is not None:  # a resume too (`check` runs for new sweeps only)
            LMEvalBench(self.config.bench(None), self.backend).require()

    def plan(self) -> dict[str, Any]:
        cfg = self.config
        selfchat = SelfChat(cfg.selfchat(None)).draw_plan()
        if cfg.task is None:
            return {"selfchat": selfchat, "mmlu": MMLU(cfg.mmlu(None)).draw_plan()}
        bench = LMEvalBench(cfg.bench(None)).draw_plan()
        return {"selfchat": selfchat,
                "benchmark": {**bench, "systems": lmeval.personas_plan(selfchat, cfg.mmlu_histories)}}

    def describe(self) -> dict[str, Any]:
        return {"points": [p.spec() if p else "" for _, p in self.config.points()],
                "models": {"agent": self.backend.describe()}}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {}

    def units(self, state: RunState) -> Iterator[tuple[int, BaseIntervention | None]]:
        self._add_points(state)
        # The plan as recorded (JSON), not as built in memory: points copied from another run of the same
        # plan compare equal to it on a first run as on a resume (the built one holds tuples where JSON keeps lists: an MMLU question's choices).
        self._plan = state.rundir.read_manifest()
        for i, (_, point) in enumerate(self.config.points()):
            yield i, point

    def _add_points(self, state: RunState) -> None:
        """Let a sweep resumed with more points (every recorded one, and others) run the new ones.

        Everything else was compared by the resume (`RESUME_IGNORES` leaves out only the grid),
        so the new points continue the same plan and are as comparable as the old ones; the
        finished points are kept, and the Holm family of the report grows with the grid. A grid
        that lacks a recorded point is refused: dropping a point from a family after seeing its
        result is what the correction is there to prevent.
        """
        recorded: list[str] = state.manifest.get("points", [])
        now = [p.spec() if p else "" for _, p in self.config.points()]
        gone = [s for s in recorded if s not in now]
        if gone:
            raise DriftlabError(
                f"{state.rundir.path} holds the point(s) {', '.join(gone)}, which this sweep's grid lacks.",
                hint="Add them back with --point (a sweep's points can be added, never dropped: the report tests "
                     "them as one family), or choose a new --out directory.")
        if now == recorded:
            return
        added = [s for s in now if s not in recorded]
        config = {**state.manifest["config"], "grid": self.config.model_dump(mode="json")["grid"]}
        state.rundir.update_manifest(config=config, points=now, completed=False)
        state.manifest = state.rundir.read_manifest()
        if self.progress and added:
            err_console().print(f"sweep: adding {len(added)} point(s) to {state.rundir.path}: {', '.join(added)}; "
                                "the finished points are kept.", highlight=False, markup=False)

    def run_unit(self, unit: tuple[int, BaseIntervention | None]) -> list:
        i, point = unit
        cfg = self.config
        if self.progress:
            err_console().print(f"sweep: point {i + 1}/{len(cfg.points())}: {point.spec() if point else 'plain'}",
                                highlight=False, markup=False)
        where = point_dir(self.run_dir, point.spec() if point else "")
        self._redo_if_stale(where, point)
        run_protocol(SelfChat(cfg.selfchat(point), self.backend), where / "selfchat", plan=self._plan["selfchat"],
                     progress=self.progress)
        if cfg.task is not None:
            run_protocol(LMEvalBench(cfg.bench(point), self.backend), where / "benchmark",
                         plan=self._plan["benchmark"], progress=self.progress)
            return []
        run_protocol(MMLU(cfg.mmlu(point), self.backend), where / "mmlu", plan=self._mmlu_plan(where, point),
                     progress=self.progress)
        return []

    def _mmlu_plan(self, where: Path, point: BaseIntervention | None) -> dict[str, Any]:
        """The sweep's MMLU plan; with the "dialog" history, the point's own dialog (its self-chat's
        first pair, cut before the question's round) and where it came from."""
        plan = self._plan["mmlu"]
        if self.config.mmlu_history != "dialog":
            return plan
        history = dialog_history(where / "selfchat", self.config.mmlu(point).round, pairs=self.config.mmlu_histories,
                                 source=HISTORY_FROM)
        return {**plan, "history": history}

    def _expected(self, point: BaseIntervention | None) -> dict[str, dict[str, Any]]:
        """The manifests (as far as `point_differences` compares them) this sweep writes for a point now."""
        cfg, agent = self.config, self.backend.describe()
        mmlu_plan = dict(self._plan.get("mmlu") or {})
        mmlu = cfg.mmlu(point)
        if cfg.task is None and cfg.mmlu_history == "dialog" and mmlu.round:
            entries = [{"from": HISTORY_FROM, "pair": p["pair"], "condition": "persona", "rounds": mmlu.round - 1,
                        "agent": p["agent"], "user": p["user"], "starter": p["starter"]}
                       for p in self._plan["selfchat"]["pairs"][: cfg.mmlu_histories]]
            mmlu_plan["history"] = entries[0] if cfg.mmlu_histories == 1 else entries
        common = {"versions": versions()}
        out = {"selfchat": {"config": cfg.selfchat(point).model_dump(mode="json"), **self._plan["selfchat"], **common,
                            "models": {"agent": agent, "user": agent}}}
        if cfg.task is not None:
            out["benchmark"] = {"config": cfg.bench(point).model_dump(mode="json"), **self._plan["benchmark"],
                                **common, "models": {"agent": agent}}
            return out
        return {**out, "mmlu": {"config": mmlu.model_dump(mode="json"), **mmlu_plan, **common,
                                "models": {"agent": agent}}}

    def _redo_if_stale(self, where: Path, point: BaseIntervention | None) -> None:
        """Move a point run by other code, data or settings than this sweep's to RUN/stale/ (and so run it
        again): its records could not be combined with the others'."""
        expected = self._expected(point)
        diffs = [f"{child}: {d}" for child in self.config.children if RunDir(where / child).exists()
                 for d in point_differences(RunDir(where / child).read_manifest(), expected[child], child)]
        if not diffs:
            return
        stale = self.run_dir / "stale"
        stale.mkdir(exist_ok=True)
        n = 1
        while (stale / f"{where.name}.{n}").exists():  # an earlier stale copy of this point is kept too
            n += 1
        dest = stale / f"{where.name}.{n}"
        shutil.move(str(where), dest)
        err_console().print(
            f"sweep: point {point.spec() if point else 'plain'} was run with other settings than this sweep's "
            f"({'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}): moved to {dest}, running it again.",
            highlight=False, markup=False)


HISTORY_FROM = "../selfchat"  # a point's MMLU history: its own self-chat, beside its MMLU run
CHILDREN = ("selfchat", "mmlu")  # an MMLU sweep's; an lm-eval sweep's: `children`
CONFIGS: dict[str, type[ProtocolConfig]] = {"selfchat": SelfChatConfig, "mmlu": MMLUConfig, "benchmark": LMEvalConfig}
PLAN_KEYS = ("pairs", "personas", "questions", "inputs", "history", "benchmark", "items", "systems")


def children(benchmark: str = "mmlu") -> tuple[str, str]:
    """A point's run directories under a sweep priced by `benchmark`: its self-chat, and its MMLU run
    ("mmlu") or its lm-eval run ("benchmark")."""
    return CHILDREN if lmeval.task_of(benchmark) is None else ("selfchat", "benchmark")
INTERVENTION_KEYS = ("steer", "plain")  # the one thing the points of a sweep may differ in
RUN_PLACE_KEYS = ("device", "device_map", "path")  # where a model ran, not what it is
PULL_KEYS = ("pulled_at", "seconds")  # when and how fast a preset was pulled, not what it is (its sha256 is)


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        return {k: v for key, sub in value.items() for k, v in _flatten(sub, f"{prefix}.{key}").items()}
    return {prefix: value}


def manifest_facts(manifest: dict[str, Any], child: str, *, intervention: bool = True) -> dict[str, Any]:
    """What a point's run must share with the others to be compared with them, flattened to dotted
    names: its config (settings a resume ignores left out; settings added since filled in as the run
    meant them), its plan (pairs, personas, questions, input hashes, the MMLU history's source, not its
    text), package versions (not Python's) and model facts (not the device). With
    `intervention=False` the intervention itself is left out."""
    cls = CONFIGS[child]
    config = {**cls.LEGACY, **config_of(manifest)}  # legacy keys are top-level in these configs
    if (config.get("backend") or {}).get("dtype") == "auto":  # what "auto" resolved to on the machine that ran it
        config["backend"] = {**config["backend"], "dtype": recorded_dtype(manifest) or "auto"}
    facts = _flatten(config, "config")
    skip = [*cls.RESUME_IGNORES, *(() if intervention else INTERVENTION_KEYS)]
    facts = {k: v for k, v in facts.items() if not any(k == f"config.{s}" or k.startswith(f"config.{s}.")
                                                          for s in skip)}
    for key in PLAN_KEYS:
        value = manifest.get(key)
        if key == "history" and isinstance(value, (dict, list)):  # each point's own dialogs: not their text
            value = [{k: v for k, v in e.items() if k != "conversation"} for e in history_entries(value)]
            value = value[0] if len(value) == 1 else {str(i): e for i, e in enumerate(value)}
        facts.update(_flatten(value, key))
    facts.update(_flatten({k: v for k, v in (manifest.get("versions") or {}).items() if k != "python"}, "versions"))
    for role, model in (manifest.get("models") or {}).items():
        model = {k: v for k, v in (model or {}).items() if k not in RUN_PLACE_KEYS}
        facts.update({k: v for k, v in _flatten(model, f"models.{role}").items()
                      if k.rsplit(".", 1)[-1] not in PULL_KEYS})
    return facts


def point_differences(recorded: dict[str, Any], expected: dict[str, Any], child: str, *,
                      intervention: bool = True) -> list[str]:
    """'name: recorded -> expected' for every fact (`manifest_facts`) in which two manifests differ."""
    a = manifest_facts(recorded, child, intervention=intervention)
    b = manifest_facts(expected, child, intervention=intervention)
    return [f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_points(out: str | Path) -> None:
    """Refuse a sweep whose points differ in anything but the intervention (code version, sampling,
    data hashes, model, seeds, pairs, questions): each point's self-chat and MMLU (or lm-eval)
    manifests are compared with the plain point's."""
    out = Path(out)
    manifest = RunDir(out).read_manifest()
    specs = manifest.get("points", [])
    kids = children(config_of(manifest).get("benchmark") or "mmlu")
    base = {child: RunDir(point_dir(out, "") / child).read_manifest() for child in kids}
    for spec in specs[1:]:
        for child in kids:
            manifest = RunDir(point_dir(out, spec) / child).read_manifest()
            diffs = point_differences(base[child], manifest, child, intervention=False)
            if diffs:
                raise DriftlabError(
                    f"{out}: point {spec} cannot be compared with plain: its {child} run differs in more than the "
                    f"intervention ({'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''}).",
                    hint="Resume the sweep with the same `driftlab sweep` command: it re-runs stale points "
                         "(a sweep of an older manifest format needs a new --out).")
