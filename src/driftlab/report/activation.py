"""Drift three ways on the same dialogs: probe scores, pi, and the projection onto the persona's
direction, per round; and the three tests of the projection as a drift signal.

Input is a run's records: a self-chat run with `--directions` (and `--steer trace` for pi), or a
`driftlab project` run of a recorded self-chat (its probe scores read from that run). The
projection of a record is its band mean: the mean over the direction's default layers of the
normalised projection (0: like without the system prompt, 1: like with it).

The tests, per conversation (the unit; turns and probes of one dialog are not independent):
* does the projection fall (and pi, where traced)? round 1's agent turn against the last round's
  (exact Wilcoxon signed-rank over conversations, mean difference with its t-interval);
* does it track the probe score? Spearman's rho of each agent probe reply's projection and its
  score (interval: bootstrap over conversations);
* does the last prompt token predict the probe? AUROC of the projection at the probe prompt's
  last token for a probe that passes (score >= 0.5), interval by bootstrap over conversations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from driftlab.protocol.dialog import RECORDS as DIALOG_RECORDS
from driftlab.protocol.runner import config_of
from driftlab.records.rundir import RunDir
from driftlab.report.figures import save_png
from driftlab.report.tables import TextTable, fmt_cell
from driftlab.stats import Interval, PairedTest, auroc_interval, mean_interval, paired_test, spearman_interval

PASS = 0.5  # a probe passes with a score at least this
FIGURE = "three_ways.png"


def _band(values: list[float] | None, band: list[int] | None) -> float:
    if not values:
        return float("nan")
    picked = [values[i] for i in band] if band else values
    return float(np.mean(picked))


def measures_frame(run_dir: str | Path) -> pd.DataFrame:
    """One row per agent turn and agent probe reply (repeat 0, condition persona): pair, round,
    what (turn|probe), score (probes), pi (mean over layers, where traced), projection and
    prompt_projection (band means, where measured)."""
    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    if manifest.get("protocol") == "project":
        return _projected(rd, manifest)
    rows = []
    for r in rd.records(DIALOG_RECORDS):
        if r.condition != "persona" or (r.kind == "turn" and r.speaker != "agent") or \
                (r.kind == "probe" and (r.target != "agent" or r.repeat)):
            continue
        act = r.activation or {}
        rows.append({"pair": r.pair, "round": r.round, "what": r.kind,
                     "score": getattr(r, "score", None) if r.kind == "probe" else None,
                     "pi": float(np.mean(r.pi)) if r.pi else float("nan"),
                     "projection": _band(act.get("reply"), act.get("band")),
                     "prompt_projection": _band(act.get("prompt"), act.get("band"))})
    return pd.DataFrame(rows, columns=["pair", "round", "what", "score", "pi", "projection", "prompt_projection"])


def _projected(rd: RunDir, manifest: dict[str, Any]) -> pd.DataFrame:
    """A `driftlab project` run's records, with the probe scores of the run it projected."""
    from driftlab.protocol.project import Project

    source = measures_frame(config_of(manifest)["from_run"])
    scores = {(r.pair, r.round): r.score for r in source.itertuples() if r.what == "probe"}
    pis = {(r.pair, r.round, r.what): r.pi for r in source.itertuples()}
    rows = [{"pair": r.pair, "round": r.round, "what": r.what, "score": scores.get((r.pair, r.round))
             if r.what == "probe" else None, "pi": pis.get((r.pair, r.round, r.what), float("nan")),
             "projection": _band(r.reply, r.band), "prompt_projection": _band(r.prompt, r.band)}
            for r in rd.records(Project.records)]
    return pd.DataFrame(rows, columns=source.columns)


@dataclass(frozen=True)
class Checks:
    """The projection as a drift signal, tested per conversation (see the module docstring)."""

    fall: PairedTest | None  # round 1 vs the last round, agent turns
    first_round: int
    last_round: int
    pi_fall: PairedTest | None  # the same for pi, where traced
    track: Interval  # Spearman of probe projection and probe score
    predict: Interval  # AUROC of the probe prompt's last-token projection for a pass
    n_conversations: int


def checks(frame: pd.DataFrame) -> Checks:
    """The three tests on a measures frame (needs projections)."""
    probes = frame[(frame.what == "probe") & frame.projection.notna() & frame.score.notna()]
    fall, first, last = _fall(frame, "projection")
    pi_fall, _, _ = _fall(frame, "pi")
    scores = probes.score.astype(float).to_numpy()
    track = spearman_interval(probes.projection.to_numpy(), scores, probes.pair.to_numpy())
    predict = auroc_interval(probes.prompt_projection.to_numpy(), scores >= PASS, probes.pair.to_numpy())
    return Checks(fall, first, last, pi_fall, track, predict, int(frame.pair.nunique()))


def _fall(frame: pd.DataFrame, value: str) -> tuple[PairedTest | None, int, int]:
    """`value` of the agent turns at the first round against the last, per conversation (Wilcoxon)."""
    turns = frame[(frame.what == "turn") & frame[value].notna()]
    if turns.empty:
        return None, 1, 1
    per = turns.pivot_table(index="pair", columns="round", values=value)
    first, last = int(per.columns.min()), int(per.columns.max())
    both = per[[first, last]].dropna()
    if last == first or not len(both):
        return None, first, last
    return paired_test(both[first].to_dict(), both[last].to_dict(), method="wilcoxon"), first, last


def round_table(frame: pd.DataFrame) -> TextTable:
    """Per round: the agent probe score (stability), pi and the projection of agent turns and probe
    replies, each a mean over conversations with its interval."""
    columns = [("score", "probe", "stability (probe score)"), ("pi", "turn", "pi (agent turns)"),
               ("projection", "turn", "projection (agent turns)"), ("projection", "probe", "projection (probe replies)")]
    shown = [c for c in columns if frame[frame.what == c[1]][c[0]].notna().any()]
    rows = []
    for rnd in sorted(frame["round"].unique()):
        row = [str(rnd)]
        for value, what, _ in shown:
            cell = mean_interval(frame[(frame["round"] == rnd) & (frame.what == what)][value].astype(float).dropna())
            row.append(fmt_cell(*cell.as_tuple()) + f" (n={cell.n})")
        rows.append(row)
    return TextTable("drift three ways, per round", ["round", *[c[2] for c in shown]], rows,
                     "Means over conversations with their 95% intervals. Projection: band mean of the normalised "
                     "projection onto the agent persona's direction (0: like without its system prompt, 1: like "
                     "with it). pi: attention mass on the system prompt, mean over layers, heads and reply tokens.")


def checks_table(result: Checks) -> TextTable:
    rows = [_fall_row("the projection", result.fall, result),
            *([_fall_row("pi", result.pi_fall, result)] if result.pi_fall is not None else []),
        ["does the projection track the probe score?", f"Spearman {result.track.cell(2)}",
         f"n = {result.track.n} probes in {result.n_conversations} conversations"],
        ["does the last prompt token's projection predict a passing probe?", f"AUROC {result.predict.cell(2)}",
         f"n = {result.predict.n}; 0.5 is chance"],
    ]
    return TextTable("drift signals, tested per conversation", ["question", "estimate [95% CI]", "test"], rows,
                     "Intervals and tests count conversations as the unit (bootstrap over conversations for rho "
                     "and AUROC).")


def _fall_row(what: str, fall: PairedTest | None, result: Checks) -> list[str]:
    digits = 3 if what == "pi" else 2
    return [f"does {what} fall from round {result.first_round} to {result.last_round}?",
            "-" if fall is None else f"{fall.diff.cell(digits, sign=True)} (round {result.first_round} minus "
                                     f"{result.last_round}; {fall.better} fell / {fall.worse} rose)",
            "-" if fall is None else f"p = {fall.p:.3g} ({fall.method}, n = {fall.n})"]


def three_ways_figure(frame: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Probe score, pi and projection per round, side by side: each conversation a thin line, their
    mean with its 95% interval as a band (clipped to [0, 1] for the score and pi, which live there)."""
    panels = [("score", "probe", "stability (probe score)", True),
              ("pi", "turn", "pi: attention on the system prompt", True),
              ("projection", "turn", "projection on the persona direction", False)]
    panels = [p for p in panels if frame[frame.what == p[1]][p[0]].notna().any()]
    fig = Figure(figsize=(3.3 * len(panels), 3.0), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (value, what, label, unit) in zip(axes, panels, strict=True):
        part = frame[(frame.what == what) & frame[value].notna()]
        rounds = sorted(part["round"].unique())
        for _, one in part.groupby("pair"):
            one = one.groupby("round")[value].mean()
            ax.plot(one.index, one.to_numpy(dtype=float), color="0.75", lw=0.7)
        cells = [mean_interval(part[part["round"] == r][value].astype(float)).as_tuple() for r in rounds]
        mean, low, high = (np.array(x, dtype=float) for x in zip(*cells, strict=True))
        if unit:
            low, high = np.clip(low, 0, 1), np.clip(high, 0, 1)
        ax.plot(rounds, mean, marker="o", color="#1f77b4", label="mean over conversations")
        ax.fill_between(rounds, low, high, alpha=0.2, color="#1f77b4", label="95% interval")
        ax.set(title=label, xlabel="round", xticks=rounds)
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_png(fig, path)
