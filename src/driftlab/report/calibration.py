"""The figure of a calibration (`calibration.png`): each measured strength's MMLU drop with its
paired 95% CI, the budget, and the strength chosen."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from driftlab.protocol.calibrate import summary as calibration_summary
from driftlab.report.figures import save_png


def write_calibration_figure(run_dir: str | Path) -> Path:
    summary = calibration_summary(run_dir)
    pts = summary["points"]
    fig = Figure(figsize=(6, 3.6), dpi=130)
    ax = fig.subplots()
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
    return save_png(fig, Path(run_dir) / "calibration.png")
