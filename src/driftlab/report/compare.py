"""Several runs in one page: `driftlab report RUN_A RUN_B ...` (or `compare_page`).

Each run's `Results` (any protocol) in long format, concatenated: one table of the headline
estimates (each with its n, interval and test), one figure of them side by side, and every
estimate in `compare.csv`. Runs of different models, steerings or protocols sit in one frame
because every row carries the run's identity (model, revision, dtype, steer, seed).
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd

from driftlab.report.results import IDENTITY, Results, summarize

# The estimate that answers each protocol's question (per_round rows and the like stay in the CSV).
HEADLINE = {"stability": {"category": "all", "round": None}, "accuracy": {}, "drop": {}, "gain": {},
            "mmlu_drop": {}, "drift": {}, "judge_agreement": {}, "pi": {}}


def headline(frame: pd.DataFrame) -> pd.DataFrame:
    """The headline rows of concatenated results (see HEADLINE)."""
    keep = pd.Series(False, index=frame.index)
    for metric, where in HEADLINE.items():
        sel = frame.metric == metric
        for column, value in where.items():
            if column in frame:
                sel &= frame[column].isna() if value is None else frame[column] == value
        keep |= sel
    return frame[keep]


def _value(v: object) -> object:
    """1.0 -> 1 (a concatenated frame turns integer keys with gaps into floats)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _label(row: pd.Series, groups: list[str]) -> str:
    what = ", ".join(f"{g}={_value(row[g])}" for g in groups if g in row and pd.notna(row[g]) and row[g] != "")
    run = f"{row['model']}" + (f" [{row['steer']}]" if isinstance(row["steer"], str) and row["steer"] else "")
    return f"{Path(str(row['run'])).name} · {run} · {row['metric']}" + (f" ({what})" if what else "")


def figure(rows: pd.DataFrame, path: Path) -> Path:
    """The headline estimates with their intervals, one line each, grouped by metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [c for c in rows.columns if c not in (*IDENTITY, "metric", "value", "n", "low", "high", "interval",
                                                   "test", "p", "p_holm")]
    labels = [_label(r, groups) for _, r in rows.iterrows()]
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(rows) + 1.2))
    y = list(range(len(rows)))[::-1]
    low = (rows.value - rows.low).clip(lower=0).fillna(0)
    high = (rows.high - rows.value).clip(lower=0).fillna(0)
    ax.errorbar(rows.value, y, xerr=[low, high], fmt="o", capsize=3)
    ax.set_yticks(y, labels, fontsize=7)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("estimate, 95% interval")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _replay_curves(run_dirs: list[str | Path], results: list[Results], path: Path) -> Path | None:
    """The replays among the runs, their compliance per turn on one axes (each labelled by its run and
    steer); None where fewer than two runs are replays."""
    from driftlab.report.replay import compliance_frame, curves_figure

    replays = [(d, r) for d, r in zip(run_dirs, results, strict=True) if r.protocol == "replay"]
    if len(replays) < 2:
        return None
    labels = [Path(d).name + (f" [{r.identity['steer']}]" if r.identity.get("steer") else "") for d, r in replays]
    return curves_figure({label: compliance_frame(d) for label, (d, _) in zip(labels, replays, strict=True)}, path)


def compare_page(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write OUT/compare.html, compare.csv and compare.png for several run directories (and, where two
    or more are replays, compliance.png: their compliance per turn side by side)."""
    from driftlab.report.html import _png_data_uri

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[Results] = [summarize(d) for d in run_dirs]
    frame = pd.concat([r.to_pandas() for r in results], ignore_index=True)
    frame.to_csv(out / "compare.csv", index=False)
    rows = headline(frame)
    png = figure(rows, out / "compare.png") if len(rows) else None
    curves = _replay_curves(run_dirs, results, out / "compliance.png")
    shown = rows.dropna(axis=1, how="all").drop(columns=["revision"], errors="ignore")
    runs = "".join(f"<li>{html.escape(str(r.identity['run']))}: {html.escape(r.protocol)}, "
                   f"{html.escape(str(r.identity['model']))}, {html.escape(str(r.identity['dtype']))}"
                   f"{'' if r.complete else ' (incomplete)'}</li>" for r in results)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>driftlab: {len(results)} runs</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
            "td,th{border:1px solid #ccc;padding:2px 6px}</style></head><body>"
            f"<h1>{len(results)} runs compared</h1><ul>{runs}</ul>"
            + (f"<img src='{_png_data_uri(png)}' alt='headline estimates'>" if png else "")
            + (f"<h2>Compliance per turn</h2><img src='{_png_data_uri(curves)}' alt='compliance per turn'>"
               if curves else "")
            + "<h2>Headline estimates</h2><p>Each with the n behind it, its interval method and, for a difference, "
              "its paired test and p-value (Holm-corrected within its run's family). Every estimate of every run: "
              "compare.csv.</p>"
            + shown.to_html(index=False, float_format=lambda v: f"{v:.3g}", na_rep="")
            + "</body></html>")
    (out / "compare.html").write_text(page, encoding="utf-8")
    return out / "compare.html"
