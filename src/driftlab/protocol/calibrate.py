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
point is its own resumable MMLU run directory, so an interrupted calibration resumes.

The decision uses the measured drop; its paired 95% CI is reported next to it, with a note
when the CI reaches past the budget (more questions, `--n`, narrow it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from driftlab.chat.base import ScoringBackend
from driftlab.console import err_console
from driftlab.protocol.mmlu import MMLU, MMLUConfig, correctness, drop
from driftlab.protocol.registry import register
from driftlab.records.rundir import RunDir

Method = Literal["split-softmax", "instaboost", "cfg", "spr"]
# A calibration directory holds no records of its own: its points are MMLU run directories.
register("calibrate", TypeAdapter(dict), lambda manifest: {})
M_MAX = 19.0
ALPHA_MAX = 5.0


def spec_at(method: str, s: float) -> str:
    """The --steer spec of `method` at strength s in [0, 1]."""
    if method == "split-softmax":
        return f"split-softmax:k={1 - s:.4g}"
    if method == "instaboost":
        return f"instaboost:m={1 + s * (M_MAX - 1):.4g}"
    if method == "cfg":
        return f"cfg:alpha={1 + s * (ALPHA_MAX - 1):.4g}"
    return f"spr:p={s:.4g}"


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Method
    max_drop: float = Field(gt=0.0, le=1.0, allow_inf_nan=False, description="MMLU accuracy budget, e.g. 0.02")
    steps: int = Field(5, ge=1, le=20, description="bisection halvings after the s = 1 check")
    mmlu: MMLUConfig = MMLUConfig()


class Point(BaseModel):
    strength: float
    steer: str
    drop: float
    ci: tuple[float, float]
    within: bool


def calibrate(config: CalibrationConfig, out: str | Path, backend: ScoringBackend, progress: bool = True) -> dict:
    """Run the search (resumably, under `out`) and return its summary (also in out/calibration.json)."""
    out = Path(out)
    base = config.mmlu.model_copy(update={"steer": [], "plain": True})
    rd = RunDir(out)
    with rd.writing():
        # The MMLU settings are checked by each point's own run directory (which lets device
        # and batch size change); here the method and the budget must match to resume.
        rd.start(config.model_dump(mode="json"), {}, ("mmlu",), protocol="calibrate")
        MMLU(base, out / "plain", backend, progress=progress).run()
        plain = correctness(out / "plain")["plain"]
        points: list[Point] = []

        def measure(s: float) -> Point:
            spec = spec_at(config.method, s)
            point_cfg = MMLUConfig.model_validate({**config.mmlu.model_dump(), "steer": [spec], "plain": False})
            where = out / "points" / spec.replace(":", "_").replace("=", "")
            MMLU(point_cfg, where, backend, progress=progress).run()
            d = drop(plain, correctness(where)["steered"])
            p = Point(strength=s, steer=point_cfg.steer[0], drop=d["mean"], ci=d["ci"],
                      within=d["mean"] <= config.max_drop)
            points.append(p)
            if progress:
                err_console().print(f"calibrate: {p.steer}: drop {p.drop:+.3f} [{p.ci[0]:+.3f}, {p.ci[1]:+.3f}] "
                                    f"-> {'within' if p.within else 'over'} budget", highlight=False, markup=False)
            return p

        lo, hi = 0.0, 1.0
        if measure(1.0).within:
            lo = 1.0
        else:
            for _ in range(config.steps):
                mid = (lo + hi) / 2
                if measure(mid).within:
                    lo = mid
                else:
                    hi = mid
        best = next((p for p in points if p.strength == lo), None)
        summary: dict[str, Any] = {
            "method": config.method, "max_drop": config.max_drop,
            "plain_accuracy": sum(plain.values()) / len(plain),
            "points": [p.model_dump() for p in sorted(points, key=lambda p: p.strength)],
            "best": best.model_dump() if best else None,
            "note": _note(best, config),
        }
        (out / "calibration.json").write_text(json.dumps(summary, indent=2))
        _figure(summary, out / "calibration.png")
        rd.update_manifest(completed=True)
    return summary


def _note(best: Point | None, config: CalibrationConfig) -> str:
    if best is None:
        return (f"No tested strength of {config.method} keeps the MMLU drop within {config.max_drop:g}: "
                "the budget cannot be met (try a larger budget, or more questions if the drops are noisy).")
    if best.ci[1] > config.max_drop:
        return (f"{best.steer} is within budget by its measured drop, but its 95% CI reaches "
                f"{best.ci[1]:+.3f}: more questions (--n) would make this surer.")
    return f"{best.steer} keeps the MMLU drop within {config.max_drop:g} (95% CI upper bound {best.ci[1]:+.3f})."


def _figure(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = summary["points"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=130)
    for p in pts:
        color = "tab:green" if p["within"] else "tab:red"
        ax.errorbar([p["strength"]], [p["drop"]], yerr=[[p["drop"] - p["ci"][0]], [p["ci"][1] - p["drop"]]],
                    fmt="o", color=color, capsize=3)
        ax.annotate(p["steer"].split(":", 1)[1], (p["strength"], p["drop"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.axhline(summary["max_drop"], color="0.3", ls="--", lw=1, label=f"budget {summary['max_drop']:g}")
    if summary["best"]:
        ax.axvline(summary["best"]["strength"], color="tab:green", lw=1, alpha=0.5, label="chosen")
    ax.set_xlabel(f"strength of {summary['method']} (0 = plain, 1 = strongest considered)")
    ax.set_ylabel("MMLU drop (plain - steered)")
    ax.set_title(f"Calibration of {summary['method']}: plain accuracy {summary['plain_accuracy']:.3f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
