"""Run every theory check and write plots, tables and a summary into one directory.

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
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from driftlab.errors import DriftlabError
from driftlab.theory import cone, embeddings, volume, wendel
from driftlab.theory.checks import Check


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


def _jsonable(x: object) -> object:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def run_all(
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

    say("Theorem 5.1: simulating the attention-only model")
    t0 = time.perf_counter()
    ccfg = cone.ConeConfig.quick() if quick else cone.ConeConfig()
    cres = cone.run(ccfg, seed)
    rep.checks += cone.checks(cres)
    cone.plot(cres, str(out / "thm51_cone.png"))
    rep.files.append(out / "thm51_cone.png")
    rep.files.append(
        _write_csv(
            out / "thm51_sweep.csv",
            ["eps", "eps_tilde", "max_generated_rel_orth", "sharpness_rel_orth"],
            cres.sweep,
        )
    )
    configs["thm51"] = asdict(ccfg)
    rep.timings["thm51"] = time.perf_counter() - t0

    say("Proposition 5.2: Wendel's formula vs LP Monte Carlo")
    t0 = time.perf_counter()
    wcfg = wendel.WendelConfig.quick() if quick else wendel.WendelConfig()
    wres = wendel.run(wcfg, seed)
    rep.checks += wendel.checks(wres)
    wendel.plot(wres, str(out / "prop52_wendel.png"))
    rep.files.append(out / "prop52_wendel.png")
    rep.files.append(
        _write_csv(
            out / "prop52_wendel.csv",
            ["D", "n", "trials", "p_span_mc", "p_span_wendel", "z", "p_span_proof_index", "z_proof_index"],
            wres.grid,
        )
    )
    rep.files.append(
        _write_csv(
            out / "prop52_bounds.csv",
            ["D", "eta", "n_bound_2log", "n_bound_1log", "n_min", "p_fail_at_2log", "p_fail_at_1log"],
            wres.bounds,
        )
    )
    configs["prop52"] = asdict(wcfg)
    rep.timings["prop52"] = time.perf_counter() - t0

    say("Proposition 5.3: cone volumes (closed form, Monte Carlo, importance sampling)")
    t0 = time.perf_counter()
    vcfg = volume.VolumeConfig.quick() if quick else volume.VolumeConfig()
    vres = volume.run(vcfg, seed)
    rep.checks += volume.checks(vres)
    volume.plot(vres, str(out / "prop53_volume.png"))
    rep.files.append(out / "prop53_volume.png")
    rep.files.append(
        _write_csv(
            out / "prop53_mc.csv", ["d", "psi_deg", "eps", "hits", "n", "mu_mc", "mu_closed", "z"], vres.mc
        )
    )
    rep.files.append(
        _write_csv(out / "prop53_is.csv", ["d", "psi_deg", "eps", "mu_is", "se", "mu_closed", "z"], vres.imp)
    )
    rep.files.append(
        _write_csv(
            out / "prop53_slopes.csv",
            ["d1", "d2", "slope_is", "slope_closed", "const_is", "const_limit"],
            vres.slopes,
        )
    )
    configs["prop53"] = asdict(vcfg)
    rep.timings["prop53"] = time.perf_counter() - t0

    if emb_res is not None:
        rep.checks += embeddings.checks(emb_res)
        embeddings.plot(emb_res, str(out / "fig7_embedding_norms.png"))
        rep.files.append(out / "fig7_embedding_norms.png")
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
    (out / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2))
    rep.files.append(out / "summary.json")
    return rep
