"""The table, figures and page of a sweep (seed 000 Fig. 5 and Fig. 6), from its point directories.

`sweep_table` reads every point's self-chat and MMLU runs and writes RUN/sweep.csv: each
point's stability with its CI, its gain over the plain model paired by conversation (every
point runs the same pairs, starters and seeds) with a bootstrap CI over conversations, and
its MMLU accuracy and drop with a paired CI over questions.

Fig. 5: stability (mean agent probe score over rounds and conversations) against the MMLU
drop, one curve per method through its strengths, all starting at the plain model.
Fig. 6: stability per round for each method at a matched MMLU drop: for each method the
point whose drop is closest to `match_drop` (default: the median drop of the grid points),
beside the plain model.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from driftlab.errors import DriftlabError
from driftlab.protocol.mmlu import correctness, drop
from driftlab.protocol.runner import config_of
from driftlab.protocol.sweep import point_dir
from driftlab.records.rundir import RunDir
from driftlab.report.figures import save_png
from driftlab.report.metrics import summarize_run
from driftlab.stats import bootstrap_mean_ci

COLORS = {"plain": "0.2", "split-softmax": "tab:blue", "spr": "tab:orange", "cfg": "tab:green",
          "instaboost": "tab:purple", "bias": "tab:brown"}


def sweep_table(out: str | Path) -> pd.DataFrame:
    """One row per point of a finished sweep (plain first, then grid order); also RUN/sweep.csv."""
    out = Path(out)
    manifest = RunDir(out).read_manifest()
    if manifest.get("protocol") != "sweep" or manifest.get("completed") is not True:
        raise DriftlabError(f"{out} is not a finished sweep.", hint="Run (or resume) the same `driftlab sweep` command.")
    grid = config_of(manifest).get("grid", {})
    rows: list[dict] = []
    plain_correct: dict[int, float] = {}
    plain_stability = pd.Series(dtype=float)
    for spec in manifest["points"]:
        method = spec.split(":", 1)[0] if spec else "plain"
        where = point_dir(out, spec)
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
            "method": method, "spec": spec or "plain", "strength_rank": grid[method].index(spec) + 1 if spec else 0,
            "stability": agent["mean"], "stability_ci_low": agent["ci_low"], "stability_ci_high": agent["ci_high"],
            "stability_gain": float(gain.mean()) if len(gain) else float("nan"),
            "stability_gain_ci_low": gain_ci[0], "stability_gain_ci_high": gain_ci[1],
            "mmlu_accuracy": sum(steered.values()) / len(steered), "mmlu_drop": d["mean"],
            "mmlu_drop_ci_low": d["ci"][0], "mmlu_drop_ci_high": d["ci"][1], "n_conversations": int(agent["n"]),
        })
    table = pd.DataFrame(rows)
    table.to_csv(out / "sweep.csv", index=False)
    return table


def _per_conversation(scores: pd.DataFrame) -> pd.Series:
    """Each conversation's agent stability (mean probe score over rounds), indexed by pair."""
    agent = scores[(scores.target == "agent") & (scores.condition == "persona")]
    return agent.groupby("pair")["score"].mean()


def matched_points(table: pd.DataFrame, match_drop: float | None = None) -> tuple[float, pd.DataFrame]:
    """(target drop, one row per method: the point whose MMLU drop is closest to the target)."""
    grid = table[table.method != "plain"]
    target = float(grid.mmlu_drop.median()) if match_drop is None else match_drop
    rows = grid.loc[(grid.mmlu_drop - target).abs().groupby(grid.method).idxmin()]
    return target, rows


def tradeoff_figure(table: pd.DataFrame, path: Path) -> Path:
    fig = Figure(figsize=(6.4, 4.2), dpi=130)
    ax = fig.subplots()
    plain = table[table.method == "plain"].iloc[0]
    for method, rows in table[table.method != "plain"].groupby("method", sort=False):
        rows = pd.concat([plain.to_frame().T, rows.sort_values("strength_rank")])
        x, y = rows.mmlu_drop.astype(float), rows.stability.astype(float)
        yerr = [y - rows.stability_ci_low.astype(float), rows.stability_ci_high.astype(float) - y]
        ax.errorbar(x, y, yerr=yerr, marker="o", ms=4, capsize=2, lw=1.5, color=COLORS.get(method), label=method)
        for _, r in rows.iloc[1:].iterrows():
            ax.annotate(str(r.spec).split(":", 1)[1].split(",")[0], (r.mmlu_drop, r.stability),
                        textcoords="offset points", xytext=(3, 3), fontsize=6, color=COLORS.get(method))
    ax.scatter([plain.mmlu_drop], [plain.stability], color="black", zorder=5, label="plain")
    ax.set_xlabel("MMLU drop at the question turn (plain - steered)")
    ax.set_ylabel("persona stability (mean probe score)")
    ax.set_title("Stability vs cost (seed 000 Fig. 5); bars: 95% CI over conversations", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path)


def rounds_figure(out: Path, table: pd.DataFrame, match_drop: float | None, path: Path) -> Path:
    target, matched = matched_points(table, match_drop)
    chosen = [("plain", "")] + [(r.method, r.spec) for r in matched.itertuples()]
    fig = Figure(figsize=(6.4, 4.2), dpi=130)
    ax = fig.subplots()
    for method, spec in chosen:
        per = summarize_run(point_dir(out, spec) / "selfchat").per_round
        cells = per[(per.target == "agent") & (per.category == "all")].sort_values("round")
        label = "plain" if not spec else spec
        ax.plot(cells["round"], cells["mean"], marker="o", ms=3, color=COLORS.get(method), label=label)
        ax.fill_between(cells["round"], cells["ci_low"], cells["ci_high"], color=COLORS.get(method), alpha=0.12)
    ax.set_xlabel("round")
    ax.set_ylabel("persona stability (mean probe score)")
    ax.set_title(f"Stability per round at a matched MMLU drop of ~{target:.3f} (seed 000 Fig. 6)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, path)


def write_sweep_report(out: str | Path, match_drop: float | None = None) -> Path:
    """sweep.csv (`sweep_table`), sweep_tradeoff.png, sweep_rounds.png and a self-contained
    sweep.html with the table."""
    out = Path(out)
    table = sweep_table(out)
    figs = [tradeoff_figure(table, out / "sweep_tradeoff.png"),
            rounds_figure(out, table, match_drop, out / "sweep_rounds.png")]
    target, matched = matched_points(table, match_drop)
    best = matched.sort_values("stability", ascending=False).iloc[0]
    imgs = "".join(f'<img src="data:image/png;base64,{base64.b64encode(f.read_bytes()).decode()}" '
                   f'style="max-width:48%">' for f in figs)
    cols = ["method", "spec", "stability", "stability_ci_low", "stability_ci_high", "stability_gain",
            "stability_gain_ci_low", "stability_gain_ci_high", "mmlu_accuracy", "mmlu_drop", "mmlu_drop_ci_low",
            "mmlu_drop_ci_high", "n_conversations"]
    cols = [c for c in cols if c in table]  # sweeps written before the paired gain lack it
    body = table[cols].to_html(index=False, float_format=lambda v: f"{v:.3f}", border=0)
    page = (f"<!doctype html><meta charset='utf-8'><title>driftlab sweep</title>"
            f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'>"
            f"<h1>Mitigation trade-off</h1>{imgs}"
            f"<p>At a matched MMLU drop of about {target:.3f}, the most stable method is "
            f"<b>{html.escape(str(best.spec))}</b> (stability {best.stability:.3f}, "
            f"95% CI [{best.stability_ci_low:.3f}, {best.stability_ci_high:.3f}], MMLU drop {best.mmlu_drop:+.3f}). "
            f"Compare the CIs before calling a winner: <i>stability_gain</i> is the gain over the plain model "
            f"paired by conversation (same pairs, starters and seeds at every point), with its bootstrap CI."
            f"</p>{body}</body>")
    (out / "sweep.html").write_text(page, encoding="utf-8")
    return out / "sweep.html"
