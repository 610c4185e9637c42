"""Drift five ways on the same dialogs: probe scores, pi, the projection onto the persona's direction,
the reminded KL and the prompt's influence, per round; how far they agree; and the three tests of the
projection as a drift signal.

Input is a run's records: a self-chat run with `--directions`, `--steer trace` (pi) or `--kl`, a
`driftlab project`, `driftlab kl` or `driftlab decay --from-run` run of a recorded self-chat (the rest
read from that run), or several of these over the same dialogs, joined (`measures_frame(run,
its_kl_run, ...)`). The projection of a record is its band mean: the mean over the direction's default
layers of the normalised projection (0: like without the system prompt, 1: like with it).

Agreement, over agent turns (a conversation's round is an item, the conversation the unit of the
bootstrap): Spearman's rho of every two measures, the probe score being that of the next probe (the
first whose view holds the turn); and how well each turn measure predicts that probe's pass (AUROC,
oriented so that 0.5 is chance and 1 means "more faithful by the measure, passes": pi, the projection
and the prompt's influence as they are, the reminded KL negated, since a larger one means more drift).

The tests, per conversation (the unit; turns and probes of one dialog are not independent):
* does the projection fall (and pi, where traced)? round 1's agent turn against the last round's
  (exact Wilcoxon signed-rank over conversations, mean difference with its t-interval);
* does it track the probe score? Spearman's rho of each agent probe reply's projection and its
  score (interval: bootstrap over conversations);
* does the last prompt token predict the probe? AUROC of the projection at the probe prompt's
  last token for a probe that passes (score >= 0.5), interval by bootstrap over conversations.
A replay scores every agent turn and asks no probe: there the last two ask the same of each agent turn
(its projection against its own compliance; the projection where its prompt ends, before the reply).
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
from driftlab.report.figures import round_ticks, save_png
from driftlab.report.tables import TextTable, fmt_cell
from driftlab.stats import Interval, PairedTest, auroc_interval, mean_interval, paired_test, spearman_interval

PASS = 0.5  # a probe passes with a score at least this
FIGURE = "three_ways.png"


def _band(values: list[float] | None, band: list[int] | None) -> float:
    if not values:
        return float("nan")
    picked = [values[i] for i in band] if band else values
    return float(np.mean(picked))


KEY = ["pair", "round", "what"]
COLUMNS = [*KEY, "score", "pi", "projection", "prompt_projection", "reminded", "influence", "repeated", "gate"]
#: The measures per agent turn: column, label, and the sign that makes larger mean more faithful.
TURN_MEASURES = (("pi", "pi", 1), ("projection", "projection", 1), ("reminded", "reminded KL", -1),
                 ("influence", "prompt influence", 1))


def measures_frame(*run_dirs: str | Path) -> pd.DataFrame:
    """One row per agent turn and agent probe reply (repeat 0, condition persona): pair, round,
    what (turn|probe), score (probes, and a replay's turns), pi (mean over layers, where traced), projection and
    prompt_projection (band means, where measured), reminded and influence (KL, nats per token, where
    measured), gate (`when-drifting`'s reading, where a gate read one: `gate_reading`), repeated
    (agent turns: 1 where the text is an earlier agent turn's of the same dialog,
    word for word: a dialog in a loop, where a flat measure reads the same text again). Several runs
    over the same dialogs (a self-chat, its `project` and `kl` runs) are joined: each value from the
    first run that has it. `attrs["probe_after"]`: the self-chat's."""
    frames = [_frame(RunDir(path)) for path in run_dirs]
    joined = frames[0]
    for frame in frames[1:]:
        joined = joined.set_index(KEY).combine_first(frame.set_index(KEY)).reset_index()
    joined = joined[COLUMNS].sort_values(KEY, kind="stable").reset_index(drop=True)
    joined.attrs["probe_after"] = frames[0].attrs["probe_after"]
    return joined


def _frame(rd: RunDir) -> pd.DataFrame:
    """One run's measures: a self-chat's own, or a `project` / `kl` / `decay` run's joined to its self-chat's."""
    manifest = rd.read_manifest()
    protocol = manifest.get("protocol")
    if protocol in READERS:
        source = _frame(RunDir(config_of(manifest).get("from_run") or rd.path / "selfchat"))
        own = READERS[protocol](rd).set_index(KEY)
        frame = own.combine_first(source.set_index(KEY)).reset_index()[COLUMNS]
        frame.attrs["probe_after"] = source.attrs["probe_after"]
        return frame
    rows, texts = [], {}
    for r in rd.records(DIALOG_RECORDS):
        if r.condition != "persona" or (r.kind == "turn" and r.speaker != "agent") or \
                (r.kind == "probe" and (r.target != "agent" or r.repeat)):
            continue
        if r.kind == "turn":
            texts[r.pair, r.round] = r.text
        act, kl = r.activation or {}, getattr(r, "kl", None) or {}
        rows.append({"pair": r.pair, "round": r.round, "what": r.kind,
                     "score": getattr(r, "score", None),  # probes'; a replay's turns have theirs too
                     "pi": float(np.mean(r.pi)) if r.pi else float("nan"),
                     "projection": _band(act.get("reply"), act.get("band")),
                     "prompt_projection": _band(act.get("prompt"), act.get("band")),
                     "reminded": kl.get("reminded", float("nan")), "influence": kl.get("prompt", float("nan")),
                     "repeated": float("nan"), "gate": gate_reading(getattr(r, "gate", None))})
    frame = pd.DataFrame(rows, columns=COLUMNS).astype({c: float for c in COLUMNS[3:]})
    seen = repeated_turns(texts)
    turns = frame.what == "turn"
    frame.loc[turns, "repeated"] = [seen[p, r] for p, r in zip(frame.pair[turns], frame["round"][turns], strict=True)]
    frame.attrs["probe_after"] = config_of(manifest).get("probe_after", "user")
    return frame


def gate_reading(gate: dict[str, Any] | None) -> float:
    """`when-drifting`'s reading at a reply (its signal over the first turn's: pi's, or the projection's),
    NaN where no gate read one."""
    if not gate:
        return float("nan")
    value = gate.get("pi_ratio", gate.get("projection_ratio"))
    return float("nan") if value is None else float(value)


def repeated_turns(texts: dict[tuple[int, int], str]) -> dict[tuple[int, int], float]:
    """Per (pair, round) agent turn: 1.0 where its text (stripped) is that of an earlier round's turn of
    the same pair, else 0.0."""
    out, earlier = {}, {}
    for pair, rnd in sorted(texts):
        text = texts[pair, rnd].strip()
        out[pair, rnd] = float(text in earlier.setdefault(pair, set()))
        earlier[pair].add(text)
    return out


def _projected(rd: RunDir) -> pd.DataFrame:
    """A `driftlab project` run's projections (the other measures come from the run it projected)."""
    from driftlab.protocol.project import Project

    return pd.DataFrame([{"pair": r.pair, "round": r.round, "what": r.what, "projection": _band(r.reply, r.band),
                          "prompt_projection": _band(r.prompt, r.band)} for r in rd.records(Project.records)],
                        columns=[*KEY, "projection", "prompt_projection"])


def _divergences(rd: RunDir) -> pd.DataFrame:
    """A `driftlab kl` run's divergences (the other measures come from the run it read)."""
    from driftlab.protocol.kl import KL

    return pd.DataFrame([{"pair": r.pair, "round": r.round, "what": r.what, "reminded": r.reminded,
                          "influence": r.prompt} for r in rd.records(KL.records)],
                        columns=[*KEY, "reminded", "influence"])


def _attended(rd: RunDir) -> pd.DataFrame:
    """A `driftlab decay` run's pi per agent turn: the mean over the turn's tokens, the layers and the
    heads, as a live `--steer trace` record's (its per-layer means, averaged); none until every dialog
    is traced."""
    from driftlab.protocol.decay import traces

    main = config_of(rd.read_manifest())["backend"]["model"]
    trace = traces(rd.path).get(main)
    if trace is None:
        return pd.DataFrame(columns=[*KEY, "pi"])
    pairs = [d["pair"] for d in trace.meta["dialogs"]]
    frame = pd.DataFrame({"pair": [pairs[d] for d in trace.dialog], "round": trace.round, "what": "turn",
                          "pi": trace.pi.astype("float64").mean(axis=(1, 2))})
    return frame.groupby(KEY, as_index=False).pi.mean()


#: The runs that measure a recorded self-chat again, by protocol: each one's own measures.
READERS = {"project": _projected, "kl": _divergences, "decay": _attended}


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
    unit: str = "probe"  # what is scored: probes, or (a replay's) agent turns


def checks(frame: pd.DataFrame) -> Checks:
    """The three tests on a measures frame (needs projections). The projection is checked against the
    probes' scores, or where a run scored no probe but every agent turn (a replay), against the turns'."""
    scored = frame[frame.projection.notna() & frame.score.notna()]
    what = "probe" if (scored.what == "probe").any() or not (scored.what == "turn").any() else "turn"
    rows, unit = scored[scored.what == what], "probe" if what == "probe" else "agent turn"
    fall, first, last = _fall(frame, "projection")
    pi_fall, _, _ = _fall(frame, "pi")
    scores = rows.score.astype(float).to_numpy()
    track = spearman_interval(rows.projection.to_numpy(), scores, rows.pair.to_numpy())
    predict = auroc_interval(rows.prompt_projection.to_numpy(), scores >= PASS, rows.pair.to_numpy())
    return Checks(fall, first, last, pi_fall, track, predict, int(frame.pair.nunique()), unit)


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
    columns = [("score", "probe", "stability (probe score)"), ("score", "turn", "compliance (every agent turn)"),
               ("pi", "turn", "pi (agent turns)"),
               ("projection", "turn", "projection (agent turns)"), ("projection", "probe", "projection (probe replies)"),
               ("reminded", "turn", "reminded KL (agent turns)"), ("influence", "turn", "prompt influence (agent turns)"),
               ("repeated", "turn", "repeated (agent turns)")]
    shown = [c for c in columns if frame[frame.what == c[1]][c[0]].notna().any()]
    rows = []
    for rnd in sorted(frame["round"].unique()):
        row = [str(rnd)]
        for value, what, _ in shown:
            cell = mean_interval(frame[(frame["round"] == rnd) & (frame.what == what)][value].astype(float).dropna(),
                                 graded=value not in ("score", "repeated"))
            digits = 4 if value in ("reminded", "influence") else 2  # KLs of a few thousandths of a nat
            row.append(fmt_cell(*cell.as_tuple(), digits=digits) + f" (n={cell.n})")
        rows.append(row)
    ways = len({c[0] for c in shown} - {"repeated"})
    return TextTable(f"drift measured {ways} way{'s' if ways != 1 else ''}, per round", ["round", *[c[2] for c in shown]],
                     rows,
                     "Means over conversations with their 95% intervals. Projection: band mean of the normalised "
                     "projection onto the agent persona's direction (0: like without its system prompt, 1: like "
                     "with it). pi: attention mass on the system prompt, mean over layers, heads and reply tokens. "
                     "Reminded KL: KL(dialog as it was || system prompt restated before the turn); prompt "
                     "influence: KL(dialog as it was || system prompt emptied), nats per reply token. Repeated: "
                     "the share of agent turns whose text is an earlier turn's of the same dialog, word for word "
                     "(a loop: a flat measure there reads the same text again).")


def turn_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per agent turn: its measures and the score of the next probe (the first whose view holds
    the turn: the same round's where probes follow the agent's turn, the next round's where they replace
    the user's), as `next_score`."""
    lag = 0 if frame.attrs.get("probe_after") == "agent" else 1
    scores = frame[frame.what == "probe"].set_index(["pair", "round"])["score"]
    turns = frame[frame.what == "turn"].copy()
    probe_rounds = np.array(sorted(scores.index.get_level_values("round").unique()))
    nxt = [probe_rounds[probe_rounds >= r + lag].min(initial=np.iinfo(int).max) for r in turns["round"]]
    turns["next_score"] = [scores.get((p, r), np.nan) for p, r in zip(turns.pair, nxt, strict=True)]
    return turns


def agreement_table(frame: pd.DataFrame) -> TextTable | None:
    """Spearman's rho of every two measures over agent turns, and each turn measure's AUROC for the next
    probe's pass (module docstring); None where fewer than two measures were taken."""
    turns = turn_frame(frame)
    probed = bool(turns.next_score.notna().any())  # a replay without probes: its turns' own scores are `driftlab warn`'s
    measures = [("next_score", "probe score (next probe)", 1)] * probed + \
        [m for m in TURN_MEASURES if turns[m[0]].notna().any()]
    if len(measures) < 2:
        return None
    rows = []
    for i, (a, label_a, _) in enumerate(measures):
        for b, label_b, _ in measures[i + 1 :]:
            both = turns[[a, b, "pair"]].dropna()
            rho = spearman_interval(both[a].to_numpy(), both[b].to_numpy(), both.pair.to_numpy())
            rows.append([f"{label_a} ~ {label_b}", f"Spearman {rho.cell(2)}", f"n = {rho.n} turns"])
    for column, label, sign in measures[1:] if probed else []:
        both = turns[[column, "next_score", "pair"]].dropna()
        auc = auroc_interval(sign * both[column].to_numpy(), both.next_score.to_numpy() >= PASS, both.pair.to_numpy())
        rows.append([f"{label} predicts the next probe's pass", f"AUROC {auc.cell(2)}", f"n = {auc.n} turns"])
    return TextTable("how far the measures agree", ["pair of measures / question", "estimate [95% CI]", "n"], rows,
                     "Over agent turns, each conversation a unit of the bootstrap (interval over conversations). "
                     f"A probe passes with a score of at least {PASS}. AUROC is oriented so 0.5 is chance and 1 "
                     "means the measure's more faithful turns pass: the reminded KL enters negated (larger is more "
                     "drift), the prompt influence as it is (larger: the prompt still matters).")


def measured(frame: pd.DataFrame) -> bool:
    """Whether the frame holds any measure beside the probe score (pi, a projection, a KL)."""
    return not frame.empty and frame[[m[0] for m in TURN_MEASURES]].notna().any().any()


def measure_tables(frame: pd.DataFrame) -> list[TextTable]:
    """What a report and the terminal show of a frame's measures: per round, how far they agree, and
    with projections, the projection's checks."""
    tables = [round_table(frame)]
    if (agree := agreement_table(frame)) is not None:
        tables.append(agree)
    if frame.projection.notna().any():
        tables.append(checks_table(checks(frame)))
    return tables


def checks_table(result: Checks) -> TextTable:
    rows = [_fall_row("the projection", result.fall, result),
            *([_fall_row("pi", result.pi_fall, result)] if result.pi_fall is not None else []),
        [f"does the projection track the {'probe score' if result.unit == 'probe' else 'turn compliance'}?",
         f"Spearman {result.track.cell(2)}",
         f"n = {result.track.n} {result.unit}s in {result.n_conversations} conversations"],
        [f"does the last prompt token's projection predict a passing {result.unit}?",
         f"AUROC {result.predict.cell(2)}", f"n = {result.predict.n}; 0.5 is chance"],
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


def round_bands(part: pd.DataFrame, value: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per round of `part` (sorted): the mean of `value` over its rows and the 95% interval's ends, the
    probe score's and the share of repeated turns as proportions, every other measure as graded."""
    cells = [mean_interval(part[part["round"] == r][value].astype(float),
                           graded=value not in ("score", "repeated")).as_tuple() for r in sorted(part["round"].unique())]
    mean, low, high = (np.array(x, dtype=float) for x in zip(*cells, strict=True))
    return mean, low, high


def three_ways_figure(frame: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Probe score, pi, projection and the two KLs per round, side by side (those measured): each
    conversation a thin line, their mean with its 95% interval as a band (clipped to [0, 1] for the
    score and pi, which live there, and at 0 for the KLs); and, where any agent turn repeats an earlier
    one, the share that do (a flat measure in those rounds reads the same text again)."""
    panels = [("score", "probe", "stability (probe score)", (0, 1)),
              ("score", "turn", "compliance (every agent turn)", (0, 1)),
              ("pi", "turn", "pi: attention on the system prompt", (0, 1)),
              ("projection", "turn", "projection on the persona direction", None),
              ("reminded", "turn", "reminded KL (nats/token)", (0, None)),
              ("influence", "turn", "prompt influence, KL (nats/token)", (0, None)),
              ("repeated", "turn", "repeated: an earlier turn's text", (0, 1))]
    panels = [p for p in panels if frame[frame.what == p[1]][p[0]].notna().any()
              and (p[0] != "repeated" or frame.repeated.gt(0).any())]
    fig = Figure(figsize=(3.3 * len(panels), 3.0), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (value, what, label, bounds) in zip(axes, panels, strict=True):
        part = frame[(frame.what == what) & frame[value].notna()]
        rounds = sorted(part["round"].unique())
        for _, one in part.groupby("pair"):
            one = one.groupby("round")[value].mean()
            ax.plot(one.index, one.to_numpy(dtype=float), color="0.75", lw=0.7)
        mean, low, high = round_bands(part, value)
        if bounds:  # where the measure lives: a probability, a divergence
            low, high = np.clip(low, *bounds), np.clip(high, *bounds)
        ax.plot(rounds, mean, marker="o", color="#1f77b4", label="mean over conversations")
        ax.fill_between(rounds, low, high, alpha=0.2, color="#1f77b4", label="95% interval")
        ax.set(title=label, xlabel="round")
        round_ticks(ax, rounds)
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_png(fig, path)
