"""The theory checks of the persona-drift paper, Sec. 5, as files: run every part, write plots, tables and a summary.

Layout of DIR (all names fixed so docs and scripts can link to them):
    checks.csv / checks.md     one row per claim: measured, expected, pass/FAIL/info
    summary.json               the same rows with raw numbers, config, seed and timings
    thm51_cone.png             Theorem 5.1 simulations
    prop52_wendel.png          Proposition 5.2 / Wendel vs Monte Carlo
    prop53_volume.png          Proposition 5.3 cone volumes and slopes
    fig7_embedding_norms.png   Figure 7 (only with a model)
    *.csv                      the numbers behind each plot
"""

from __future__ import annotations

import csv
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from driftlab.errors import DriftlabError
from driftlab.records.rundir import jsonable
from driftlab.theory import cone, embeddings, volume, wendel
from driftlab.theory.checks import Check
from driftlab.theory.cone import ConeResult, eps_tilde
from driftlab.theory.embeddings import EmbeddingResult
from driftlab.theory.volume import VolumeResult, mu_closed
from driftlab.theory.wendel import WendelResult, p_span, paper_n_bound, wendel_hemisphere


@dataclass
class TheoryReport:
    out: Path
    checks: list[Check] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks)


def _write_csv(path: Path, header: list[str], rows: list[tuple]) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def _markdown(checks: list[Check]) -> str:
    lines = ["| id | claim | measured | expected | status |", "|---|---|---|---|---|"]
    for c in checks:
        cells = [c.id, c.claim, c.measured, c.expected, c.status]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    return "\n".join(lines) + "\n"



def cone_figure(res: ConeResult, path: str | Path) -> Path:
    """Three panels: generation under the hypothesis and broken, a dialog, and an eps sweep."""
    cone, et, eps = res.cone, res.eps_tilde, res.cfg.eps
    assert res.dialog is not None
    fig = Figure(figsize=(15, 4.3))
    axes = fig.subplots(1, 3)
    ax = axes[0]
    styles = [
        ("typical (random O)", "tab:blue", res.valid[0::2]),
        ("adversarial (O = I, aligned)", "tab:purple", res.valid[1::2]),
        (f"broken (b = {res.cfg.broken_contraction:g} m)", "tab:red", res.broken),
    ]
    for label, col, traces in styles:
        for i, tr in enumerate(traces):
            ax.plot(
                cone.rel_orth(tr.tokens[tr.kind == "agent"]),
                color=col,
                alpha=0.6,
                lw=1,
                label=label if i == 0 else None,
            )
    ax.axhline(eps, color="k", ls=":", label=f"eps = {eps:g}")
    ax.axhline(et, color="k", ls="--", label=f"eps~ = {et:.4f}")
    ax.set_yscale("log")
    ax.set_xlabel("generation step")
    ax.set_ylabel("||v|| / ||h||  (part orthogonal to span C)")
    ax.set_title("Thm 5.1: agent-only generation")
    ax.legend(fontsize=7, loc="lower right")

    dlg = res.dialog
    r = cone.rel_orth(dlg.tokens)
    t = np.arange(len(r))
    ax = axes[1]
    for kind, col in {"system": "tab:green", "agent": "tab:purple", "user": "tab:orange"}.items():
        sel = dlg.kind == kind
        ax.scatter(t[sel], r[sel], s=6, color=col, label=f"{kind} tokens")
    ax.axhline(et, color="k", ls="--", label="eps~")
    ax.set_yscale("log")
    ax.set_xlabel("position in context")
    ax.set_ylabel("||v|| / ||h||")
    ax.set_title("Dialog: uniform user turns leave the cone")
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[2]
    sw = np.array(res.sweep)
    grid = np.linspace(0.005, 0.6, 200)
    ax.plot(grid, eps_tilde(grid, cone.theta), "k--", label=f"eps~(eps), theta = {res.cfg.theta_deg:g} deg")
    ax.plot(grid, grid, "k:", label="eps")
    ax.plot(sw[:, 0], sw[:, 3], "o", mfc="none", color="k", label="sharpness point")
    ax.plot(sw[:, 0], sw[:, 2], "s", color="tab:purple", label="max over generated tokens")
    ax.set_xlabel("eps")
    ax.set_ylabel("relative orthogonal norm")
    ax.set_title("Bound vs simulation across eps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def wendel_figure(res: WendelResult, path: str | Path) -> Path:
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    ax = axes[0]
    cmap = colormaps["viridis"]
    dims = res.cfg.dims
    for i, D in enumerate(dims):
        col = cmap(i / max(1, len(dims) - 1))
        rows = [g for g in res.grid if g[0] == D]
        ns = np.arange(D, 4 * D + 12)
        ax.plot(ns / D, [p_span(D, int(n)) for n in ns], color=col, lw=1.5, label=f"Wendel, D = {D}")
        ax.plot(ns / D, [1 - wendel_hemisphere(D, int(n)) for n in ns], color=col, lw=1, ls=":")
        n_mc = np.array([g[1] for g in rows])
        p_mc = np.array([g[3] for g in rows])
        err = 2 * np.sqrt(np.maximum(p_mc * (1 - p_mc), 1 / rows[0][2]) / rows[0][2])
        ax.errorbar(n_mc / D, p_mc, yerr=err, fmt="o", ms=4, color=col, capsize=2)
        ax.axvline(paper_n_bound(D, 0.01) / D, color=col, ls="--", lw=0.8)
    ax.set_xlabel("user tokens per dimension, n / D")
    ax.set_ylabel("P(cone of n tokens = R^D)")
    ax.set_title(
        "Prop 5.2: Wendel (lines), LP Monte Carlo (dots, 2 sd)\n"
        "dotted: proof's a_{D,n}; dashed: n = 4D + 2 log(1/eta), eta = 0.01",
        fontsize=9,
    )
    ax.legend(fontsize=7)

    ax = axes[1]
    for eta in res.cfg.etas:
        rows = [b for b in res.bounds if b[1] == eta]
        ax.plot([b[0] for b in rows], [b[4] for b in rows], "o-", ms=3, label=f"minimal n, eta = {eta:g}")
    Ds = np.array(res.cfg.bound_dims)
    ax.plot(Ds, 4 * Ds, "k--", lw=1, label="4D (bound's leading term)")
    ax.plot(Ds, 2 * Ds, "k:", lw=1, label="2D (P = 1/2)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("dimension D")
    ax.set_ylabel("n needed for P(span) >= 1 - eta")
    ax.set_title("How loose is n >= 4D + 2 log(1/eta)?", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def volume_figure(res: VolumeResult, path: str | Path) -> Path:
    cfg = res.cfg
    psi1, psi2 = math.radians(cfg.psi1_deg), math.radians(cfg.psi2_deg)
    fig = Figure(figsize=(11, 4.3))
    axes = fig.subplots(1, 2)
    grid = np.logspace(math.log10(min(cfg.is_eps)) - 0.2, 0, 200)
    ax = axes[0]
    cmap = colormaps["tab10"]
    dims = sorted({(r[0], r[1]) for r in res.imp})
    for i, (d, psi_deg) in enumerate(dims):
        col = cmap(i)
        ax.plot(
            grid,
            mu_closed(cfg.D, d, math.radians(psi_deg), grid),
            color=col,
            lw=1.2,
            label=f"d = {d}, psi = {psi_deg:g} deg",
        )
        mc = [r for r in res.mc if r[0] == d and r[1] == psi_deg and r[3] > 0]
        ax.plot([r[2] for r in mc], [r[5] for r in mc], "s", color=col, ms=5, mfc="none")
        imp = [r for r in res.imp if r[0] == d and r[1] == psi_deg]
        ax.plot([r[2] for r in imp], [r[3] for r in imp], "o", color=col, ms=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("eps")
    ax.set_ylabel("mu(C^eps)")
    ax.set_title(
        f"Cone volume, D = {cfg.D}: closed form (lines),\nplain MC (squares), importance sampling (dots)",
        fontsize=9,
    )
    ax.legend(fontsize=7)

    ax = axes[1]
    imp = {(r[0], r[2]): r[3] for r in res.imp}
    for i, (d1, d2, slope, _, _, const) in enumerate(res.slopes):
        col = cmap(i)
        ratio = mu_closed(cfg.D, d1, psi1, grid) / mu_closed(cfg.D, d2, psi2, grid)
        ax.plot(grid, ratio, color=col, lw=1.2, label=f"d1 = {d1}, d2 = {d2}: fitted slope {slope:.3f}")
        ax.plot(grid, const * grid ** (d2 - d1), color=col, ls=":", lw=1)
        eps = [e for e in cfg.is_eps if (d1, e) in imp and (d2, e) in imp]
        ax.plot(eps, [imp[(d1, e)] / imp[(d2, e)] for e in eps], "o", color=col, ms=3)
        pb = [b for b in res.bounds if b[0] == d1 and b[1] == d2]
        if pb:
            ax.plot([b[2] for b in pb], [b[4] for b in pb], "--", color=col, lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("eps")
    ax.set_ylabel("mu(C0^eps) / mu(Cn^eps)")
    ax.set_title(
        "Prop 5.3: ratio (lines, dots = IS), const * eps^(d2-d1) (dotted),\npaper's explicit bound (dashed)",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def embedding_figure(res: EmbeddingResult, path: str | Path) -> Path:
    s = res.stats
    fig = Figure(figsize=(5.5, 3.8))
    ax = fig.subplots()
    hi = np.quantile(res.norms, 0.999)
    ax.hist(res.norms[res.norms <= hi], bins=120, density=True, color="tab:blue", alpha=0.8)
    ax.axvline(s["median"], color="k", ls="--", lw=1, label=f"median {s['median']:.3g}")
    ax.set_xlabel("L2 norm of embedding row")
    ax.set_ylabel("density")
    ax.set_title(
        f"Embedding norms: {Path(res.model).name or res.model} ({int(s['rows'])} tokens)", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


@dataclass(frozen=True)
class Part:
    """One simulated claim: how to run it, its figure and the tables behind it."""

    key: str
    title: str
    module: ModuleType  # with Config, run(cfg, seed) and checks(result)
    config: type
    png: str
    figure: Callable[[Any, Path], Path]
    tables: Callable[[Any], list[tuple[str, list[str], list]]]  # (file, header, rows)


PARTS = (
    Part("thm51", "Theorem 5.1: simulating the attention-only model", cone, cone.ConeConfig, "thm51_cone.png",
         cone_figure, lambda r: [("thm51_sweep.csv", ["eps", "eps_tilde", "max_generated_rel_orth",
                                                      "sharpness_rel_orth"], r.sweep)]),
    Part("prop52", "Proposition 5.2: Wendel's formula vs LP Monte Carlo", wendel, wendel.WendelConfig,
         "prop52_wendel.png", wendel_figure,
         lambda r: [("prop52_wendel.csv", ["D", "n", "trials", "p_span_mc", "p_span_wendel", "z", "p_span_proof_index",
                                           "z_proof_index"], r.grid),
                    ("prop52_bounds.csv", ["D", "eta", "n_bound_2log", "n_bound_1log", "n_min", "p_fail_at_2log",
                                           "p_fail_at_1log"], r.bounds)]),
    Part("prop53", "Proposition 5.3: cone volumes (closed form, Monte Carlo, importance sampling)", volume,
         volume.VolumeConfig, "prop53_volume.png", volume_figure,
         lambda r: [("prop53_mc.csv", ["d", "psi_deg", "eps", "hits", "n", "mu_mc", "mu_closed", "z"], r.mc),
                    ("prop53_is.csv", ["d", "psi_deg", "eps", "mu_is", "se", "mu_closed", "z"], r.imp),
                    ("prop53_slopes.csv", ["d1", "d2", "slope_is", "slope_closed", "const_is", "const_limit"],
                     r.slopes)]),
)


def write_theory(
    out: Path,
    model: str | None = None,
    quick: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> TheoryReport:
    """Run Thm 5.1, Prop 5.2, Prop 5.3 (and Fig 7 if `model`), write everything to `out`.

    Each part draws from its own seeded stream, so results do not depend on which parts run.
    """
    say = progress or (lambda _msg: None)
    if out.exists() and not out.is_dir():
        raise DriftlabError(f"--out {out} exists and is not a directory.", hint="Choose another path.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DriftlabError(
            f"Cannot create output directory {out}: {err.strerror}.", hint="Choose a writable --out path."
        ) from err
    rep = TheoryReport(out=out)
    configs: dict[str, object] = {}

    emb_res = None
    if model is not None:  # resolve first: a bad --model should fail before minutes of simulation
        say(f"Fig 7: reading embeddings of {model}")
        t0 = time.perf_counter()
        emb_res = embeddings.run(model)
        rep.timings["fig7"] = time.perf_counter() - t0

    for part in PARTS:
        say(part.title)
        t0 = time.perf_counter()
        cfg = part.config.quick() if quick else part.config()
        res = part.module.run(cfg, seed)
        rep.checks += part.module.checks(res)
        rep.files.append(part.figure(res, out / part.png))
        rep.files += [_write_csv(out / name, header, rows) for name, header, rows in part.tables(res)]
        configs[part.key] = asdict(cfg)
        rep.timings[part.key] = time.perf_counter() - t0

    if emb_res is not None:
        rep.checks += embeddings.checks(emb_res)
        rep.files.append(embedding_figure(emb_res, out / "fig7_embedding_norms.png"))
        counts, edges = np.histogram(emb_res.norms, bins=120)
        rep.files.append(
            _write_csv(
                out / "fig7_histogram.csv",
                ["bin_left", "bin_right", "count"],
                list(zip(edges[:-1], edges[1:], counts, strict=True)),
            )
        )
        configs["fig7"] = {"model": model, "key": emb_res.key, "dtype": emb_res.dtype}

    rep.files.append(
        _write_csv(
            out / "checks.csv",
            ["id", "claim", "measured", "expected", "status", "detail"],
            [tuple(c.row().values()) for c in rep.checks],
        )
    )
    (out / "checks.md").write_text(_markdown(rep.checks))
    rep.files.append(out / "checks.md")
    summary = {
        "seed": seed,
        "quick": quick,
        "all_passed": rep.ok,
        "checks": [asdict(c) for c in rep.checks],
        "config": configs,
        "timings_s": rep.timings,
        "versions": {"python": platform.python_version(), "numpy": np.__version__},
    }
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=2))
    rep.files.append(out / "summary.json")
    return rep
