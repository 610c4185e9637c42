"""PASTA's figures: a task's baselines (`eval.png`), a head profile (`profile.png`) and the
head-count search (`tune.png`), each from its run directory.

`write_pasta_figures(run_dir)` draws the figure of whichever PASTA protocol wrote the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from driftlab.pasta import evaluate, profile, tune
from driftlab.pasta.metrics import FLUENCY_FLOOR
from driftlab.protocol.runner import config_of
from driftlab.records.rundir import RunDir
from driftlab.report.figures import save_png
from driftlab.steering.heads import Profile


def write_pasta_figures(run_dir: str | Path) -> Path:
    """The figure of a PASTA run directory (eval, profile or tune), next to its records."""
    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    kind = manifest.get("protocol")
    if kind == "pasta-eval":
        title = f"PASTA {manifest['config']['task']} · {config_of(manifest)['backend']['model']}"
        return plot_eval(evaluate.summarize(rd.path), rd.path / "eval.png", title)
    if kind == "pasta-profile":
        return plot_profile(profile.build_profile(rd.path), rd.path / "profile.png", profile_shape(manifest))
    if kind == "pasta-tune":
        return plot_tune(tune.summarize(rd.path), rd.path / "tune.png")
    raise ValueError(f"{rd.path} holds a '{kind}' run, not a PASTA one")


def profile_shape(manifest: dict[str, Any]) -> tuple[int, int]:
    """(layers, heads) of the profiled model, as recorded (older runs: what the heads span)."""
    if "shape" in manifest:
        return tuple(manifest["shape"])
    heads = manifest.get("heads") or [[0, 0]]
    return max(h[0] for h in heads) + 1, max(h[1] for h in heads) + 1


def plot_eval(summary: dict[str, dict[str, tuple[float, float, float]]], path: Path, title: str) -> Path:
    """One panel per metric: each baseline's mean with its 95% CI."""
    baselines = list(summary)
    metrics = [m for m in next(iter(summary.values())) if m != "score"]
    fig = Figure(figsize=(3.2 * len(metrics), 3.2))
    axes = fig.subplots(1, len(metrics), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        means = [summary[b][metric][0] for b in baselines]
        lo = [summary[b][metric][0] - summary[b][metric][1] for b in baselines]
        hi = [summary[b][metric][2] - summary[b][metric][0] for b in baselines]
        colors = ["tab:red" if b == "pasta" else "tab:gray" for b in baselines]
        ax.bar(range(len(baselines)), means, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_xticks(range(len(baselines)), baselines, rotation=30, ha="right")
        ax.set_title(metric)
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, path)


def plot_profile(profile: Profile, path: Path, shape: tuple[int, int]) -> Path:
    """Layer x head heatmap of the per-head scores (unprofiled heads blank)."""
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


def plot_tune(result: dict[str, Any], path: Path) -> Path:
    """The primary metric against the number of steered heads, with 95% CIs and the unsteered band."""
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
