"""Auto-calibration: the strongest setting of a mitigation whose MMLU drop fits a budget.

Each method's knob is mapped to a strength s in [0, 1] (0 = plain decoding, 1 = the
strongest setting considered):

    split-softmax   k     = 1 - s                  (k in [0, 1])
    instaboost      m     = 1 + s (M_MAX - 1)      (InstABoost searched m in 1..19)
    cfg             alpha = 1 + s (ALPHA_MAX - 1)
    spr             p     = s

The MMLU drop is measured as `driftlab mmlu` does (question at turn T of the agent's
dialog, letter by log-likelihood, same seeded questions), against one plain baseline that
all points share. Search: s = 1 first (if it fits, it is the answer), then bisection for
`steps` halvings, keeping the strongest s whose measured drop is within the budget. Every
point is its own resumable MMLU run directory, planned once (the questions and the dialog's
persona pair recorded in the calibration's manifest), so an interrupted calibration resumes
with the same questions for every point.

The decision uses the measured drop; its paired 95% interval and p (`driftlab.protocol.mmlu.drop`:
over one dialog, Newcombe's interval and the exact McNemar test; over `--histories` dialogs,
the cluster sign-flip test and cluster-robust interval) are reported next to it, with a note
when the interval reaches past the budget (more questions, `--n`, or dialogs narrow it).
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from driftlab.chat.spec import BackendSpec
from driftlab.console import err_console
from driftlab.protocol.mmlu import MMLU, MMLUConfig, answer_health, answers, correctness, dialogs_of, drop
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, RunState, run_protocol
from driftlab.stats import pairs_needed_proportions
from driftlab.steering.interventions import KINDS, BaseIntervention

Method = Literal["split-softmax", "instaboost", "cfg", "spr"]
M_MAX = 19.0
ALPHA_MAX = 5.0
# Each method's knob and its value at strength s in [0, 1].
KNOBS = {
    "split-softmax": ("k", lambda s: 1 - s),
    "instaboost": ("m", lambda s: 1 + s * (M_MAX - 1)),
    "cfg": ("alpha", lambda s: 1 + s * (ALPHA_MAX - 1)),
    "spr": ("p", lambda s: s),
}
SUMMARY = "calibration.json"


def setting(method: str, s: float) -> BaseIntervention:
    """The intervention of `method` at strength s in [0, 1] (its knob to 4 significant digits)."""
    knob, value = KNOBS[method]
    return KINDS[method](**{knob: float(f"{value(s):.4g}")})


def point_name(method: str, s: float) -> str:
    """The directory of the point at strength s, e.g. split-softmax_k0.5."""
    knob, value = KNOBS[method]
    return f"{method}_{knob}{value(s):.4g}"


def strengths(steps: int) -> Generator[float, bool, None]:
    """The strengths to measure, told after each whether its drop was within the budget:
    s = 1 first (if it fits, it is the answer), then `steps` halvings of [0, 1]."""
    if (yield 1.0):
        return
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (yield mid):
            lo = mid
        else:
            hi = mid


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Method
    max_drop: float = Field(gt=0.0, le=1.0, allow_inf_nan=False, description="MMLU accuracy budget, e.g. 0.02")
    steps: int = Field(5, ge=1, le=20, description="bisection halvings after the s = 1 check")
    mmlu: MMLUConfig = MMLUConfig()

    # The MMLU settings are checked again by each point's own run directory.
    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*(f"mmlu.{k}" for k in MMLUConfig.RESUME_IGNORES),)
    LEGACY: ClassVar[dict[str, Any]] = {f"mmlu.{k}": v for k, v in MMLUConfig.LEGACY.items()}

    @property
    def backend(self) -> BackendSpec:
        return self.mmlu.backend


class Point(BaseModel):
    """One measured strength: its MMLU drop with the paired interval and test (`method`: exact
    McNemar over one dialog, the cluster sign-flip test over several; n, method and p default to
    None in calibrations written before they were recorded)."""

    strength: float
    steer: str
    drop: float
    ci: tuple[float, float]
    within: bool
    n: int | None = None
    ci_method: str | None = None
    p: float | None = None
    method: str | None = None
    lost: int | None = None  # questions right without the steering and wrong with it
    gained: int | None = None
    dialogs: int | None = None  # the dialogs the questions were asked after
    top_letter: str | None = None  # the letter it chose most, and that letter's share of its answers
    top_share: float | None = None
    collapsed: bool | None = None  # top_share above mmlu.COLLAPSE: its accuracy is that letter's share, not knowledge


@register
class Calibration(Protocol[CalibrationConfig]):
    """The search, resumable: its units are MMLU runs (the plain baseline, then each strength),
    each a run directory of its own under the calibration's; it writes calibration.json."""

    name = "calibrate"
    records = TypeAdapter(dict)  # none of its own: its points are MMLU run directories

    def _mmlu(self, steer: BaseIntervention | None) -> MMLUConfig:
        """The MMLU run of the plain baseline (steer None) or of one point (steered only)."""
        point = {"steer": [], "plain": True} if steer is None else {"steer": [steer], "plain": False}
        return MMLUConfig.model_validate({**self.config.mmlu.model_dump(), **point})

    def check(self) -> None:
        MMLU(self._mmlu(None)).check()

    def plan(self) -> dict[str, Any]:
        return {"mmlu": MMLU(self._mmlu(None)).draw_plan()}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {}

    def units(self, state: RunState) -> Iterator[float | None]:
        self._plan = state.manifest["mmlu"]
        self.points: list[Point] = []
        yield None  # the plain baseline
        search = strengths(self.config.steps)
        s = next(search)
        while True:
            yield s
            try:
                s = search.send(self.points[-1].within)
            except StopIteration:
                return

    def run_unit(self, s: float | None) -> list:
        cfg = self.config
        if s is None:
            run_protocol(MMLU(self._mmlu(None), self.backend), self.run_dir / "plain", plan=self._plan,
                         progress=self.progress)
            self.plain = correctness(self.run_dir / "plain")["plain"]
            self.dialogs = dialogs_of(self.run_dir / "plain")
            return []
        steer = setting(cfg.method, s)
        where = self.run_dir / "points" / point_name(cfg.method, s)
        run_protocol(MMLU(self._mmlu(steer), self.backend), where, plan=self._plan, progress=self.progress)
        d = drop(self.plain, correctness(where)["steered"], self.dialogs)
        health = answer_health(answers(where)["steered"])
        # A strength whose answers collapsed onto one letter is never within budget, whatever its drop.
        within = d["mean"] <= cfg.max_drop and not health["collapsed"]
        point = Point(strength=s, steer=steer.spec(), drop=d["mean"], ci=d["ci"], within=within,
                      n=d["n"], ci_method=d["ci_method"], p=d["p"], method=d["method"], lost=d["lost"],
                      gained=d["gained"], dialogs=d["dialogs"], top_letter=health["top_letter"],
                      top_share=health["top_share"], collapsed=health["collapsed"])
        self.points.append(point)
        if self.progress:
            err_console().print(f"calibrate: {point.steer}: drop {point.drop:+.3f} [{point.ci[0]:+.3f}, "
                                f"{point.ci[1]:+.3f}] (n={point.n}, p={point.p:.3g}) -> "
                                + (f"answers collapsed ({point.top_share:.0%} {point.top_letter}): not within budget"
                                   if point.collapsed else f"{'within' if point.within else 'over'} budget"),
                                highlight=False, markup=False)
        return []

    def finish(self, state: RunState) -> None:
        cfg = self.config
        best = max((p for p in self.points if p.within), key=lambda p: p.strength, default=None)
        summary: dict[str, Any] = {
            "method": cfg.method, "max_drop": cfg.max_drop,
            "plain_accuracy": sum(self.plain.values()) / len(self.plain),
            "points": [p.model_dump() for p in sorted(self.points, key=lambda p: p.strength)],
            "best": best.model_dump() if best else None,
            "power": _power(self.points, cfg.max_drop),
        }
        summary["note"] = _note(best, cfg) + _power_note(summary["power"], len(self.plain))
        (self.run_dir / SUMMARY).write_text(json.dumps(summary, indent=2))


def summary(run_dir: str | Path) -> dict[str, Any]:
    """What a finished calibration found (its calibration.json)."""
    return json.loads((Path(run_dir) / SUMMARY).read_text())


def _power(points: list[Point], max_drop: float) -> dict[str, Any]:
    """The questions the exact McNemar test needs to detect a drop of the budget itself (alpha 0.05,
    power 0.8), at the share of questions the points answered differently from plain (median)."""
    shares = sorted((p.lost + p.gained) / p.n for p in points if p.n and p.lost is not None and p.gained is not None)
    measured = shares[len(shares) // 2] if shares else 0.0
    share = min(1.0, max(2 * max_drop, measured))
    return {"effect": max_drop, "discordant": share, "n": pairs_needed_proportions(max_drop, share)}


def _power_note(power: dict[str, Any], n: int) -> str:
    if n >= power["n"]:
        return ""
    return (f" With {n} questions a drop of {power['effect']:g} is more likely missed than found: detecting it "
            f"needs about {power['n']} (exact McNemar, alpha 0.05, power 0.8).")


def _note(best: Point | None, config: CalibrationConfig) -> str:
    if best is None:
        return (f"No tested strength of {config.method} keeps the MMLU drop within {config.max_drop:g}: "
                "the budget cannot be met (try a larger budget, or more questions if the drops are noisy).")
    if best.ci[1] > config.max_drop:
        return (f"{best.steer} is within budget by its measured drop, but its 95% CI reaches "
                f"{best.ci[1]:+.3f}: more questions (--n) would make this surer.")
    return f"{best.steer} keeps the MMLU drop within {config.max_drop:g} (95% CI upper bound {best.ci[1]:+.3f})."
