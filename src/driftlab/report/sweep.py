"""The table, figures and page of a sweep (the persona-drift paper, Fig. 5 and Fig. 6), from its point directories.

`sweep_table` reads every point's self-chat and MMLU runs and writes RUN/sweep.csv: each
point's stability with its CI, its gain over the plain model paired by conversation (every
point runs the same pairs, starters and seeds) with the Wilcoxon signed-rank test, and its
MMLU accuracy and drop paired by question (`driftlab.protocol.mmlu.drop_test`: the exact
McNemar test over one dialog's questions, the cluster sign-flip test over several dialogs);
the p-values are Holm-corrected over the sweep's points, and every test carries its n and
method (`driftlab.stats`). Beside them, what could confound them: the share of turns and
probes cut at their token limit (flagged where it differs from plain's by more than
CUT_FLAG), the stability gain again without cut probes (sensitivity), and MMLU answers that
collapsed onto one letter or tied. `power_notes` says how many pairs and questions a given
effect needs.

A sweep priced by an lm-eval task (`--benchmark lm-eval:<task>`) pairs its items the same way
(`driftlab.protocol.lmeval`: the task's 0/1 metric per item, the same McNemar / cluster test,
Newcombe interval and Holm family); its columns are named `bench_*` where an MMLU sweep's are
`mmlu_*` (`bench_top_choice` for `mmlu_top_letter`: the option index chosen most), beside
`benchmark` (e.g. "lm-eval:arc_easy") and `bench_metric` (e.g. "acc"), so an MMLU sweep's table
is as it always was and no lm-eval figure is read as MMLU's. The figures and pages read
either (`cost_view`) and name the benchmark.

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
from driftlab.protocol import lmeval
from driftlab.protocol.mmlu import answer_health, answers, dialogs_of, drop_test
from driftlab.protocol.runner import config_of
from driftlab.protocol.sweep import PLAIN, check_points, point_dir
from driftlab.records.rundir import RunDir
from driftlab.report.figures import save_png
from driftlab.report.metrics import CUT_FLAG, cut_shares, summarize_run, uncut_scores
from driftlab.stats import PairedTest, paired_test, pairs_needed_means, pairs_needed_proportions, with_holm

POWER_GAIN = 0.1  # the stability gain whose needed pairs the sweep states
POWER_DROP = 0.05  # the MMLU drop whose needed questions the sweep states
COLORS = {"plain": "0.2", "split-softmax": "tab:blue", "spr": "tab:orange", "cfg": "tab:green",
          "instaboost": "tab:purple", "bias": "tab:brown", "vector": "tab:red", "cap": "tab:olive",
          "pi-floor": "tab:cyan"}


def sweep_table(out: str | Path, *, write: bool = True) -> pd.DataFrame:
    """One row per point of a finished sweep (plain first, then grid order); also RUN/sweep.csv
    (unless `write` is False: a reader that only wants the numbers, from the records).

    Each steered point is compared with the plain point on the same pairs and questions:
    its stability gain by the Wilcoxon signed-rank test over conversations (`gain_*`), its
    MMLU drop by the exact McNemar test over questions (`mmlu_*`); each family (the sweep's
    points) is Holm-corrected (`*_p_holm`). `warning` says where n does not support a
    difference. Intervals follow `driftlab.stats.mean_interval`'s rule (t below 30 values).
    A sweep whose points differ in anything but the intervention is refused (`check_points`).
    """
    out = Path(out)
    manifest = RunDir(out).read_manifest()
    if manifest.get("protocol") != "sweep" or manifest.get("completed") is not True:
        raise DriftlabError(f"{out} is not a finished sweep.", hint="Run (or resume) the same `driftlab sweep` command.")
    check_points(out)  # points that differ in more than the intervention are never combined
    config = config_of(manifest)
    grid = config.get("grid", {})
    task = lmeval.task_of(config.get("benchmark") or "mmlu")
    label = "MMLU" if task is None else f"{task} {_bench_plan(out)['metric']}"
    rows: list[dict] = []
    gains: list[PairedTest | None] = []
    gains_uncut: list[PairedTest | None] = []
    drops: list[PairedTest | None] = []
    plain_correct: dict[int, float] = {}
    plain_stability = plain_uncut = pd.Series(dtype=float)
    plain_cut: dict[str, float] = {}
    dialogs = dialogs_of(point_dir(out, "") / "mmlu") if task is None else lmeval.dialogs_of(
        point_dir(out, "") / "benchmark")
    for spec in manifest["points"]:
        method = spec.split(":", 1)[0] if spec else "plain"
        where = point_dir(out, spec)
        if task is None:
            answered = answers(where / "mmlu")["steered" if spec else "plain"]
            steered = {i: float(r.correct) for i, r in answered.items()}
            health = answer_health(answered)
        else:  # the task's 0/1 metric per item, paired by doc_id
            items = lmeval.answers(where / "benchmark")["steered" if spec else "plain"]
            steered = {i: r.value for i, r in items.items()}
            health = lmeval.answer_health(items)
        summary = summarize_run(where / "selfchat")
        ov = summary.overall
        agent = ov[(ov.target == "agent") & (ov.category == "all")].iloc[0]
        per_conv = _per_conversation(summary.scores)
        uncut = _per_conversation(uncut_scores(summary.records, summary.manifest))
        cut = cut_shares(summary.records, plain_cut or None).iloc[0]
        if not spec:
            plain_correct, plain_stability, plain_uncut = steered, per_conv, uncut
            plain_cut = {"turns_cut": cut.turns_cut, "probes_cut": cut.probes_cut}
        gains.append(paired_test(per_conv.to_dict(), plain_stability.to_dict(), method="wilcoxon") if spec else None)
        gains_uncut.append(paired_test(uncut.to_dict(), plain_uncut.to_dict(), method="wilcoxon") if spec else None)
        diffs = (per_conv - plain_stability).dropna()
        drops.append(drop_test(plain_correct, steered, dialogs) if spec else None)
        rows.append({
            "method": method, "spec": spec or "plain", "strength_rank": grid[method].index(spec) + 1 if spec else 0,
            "stability": agent["mean"], "stability_ci_low": agent["ci_low"], "stability_ci_high": agent["ci_high"],
            "stability_ci_method": agent.get("ci_method", "bca"),
            "mmlu_accuracy": sum(steered.values()) / len(steered), "n_conversations": int(agent["n"]),
            "gain_sd": float(diffs.std(ddof=1)) if spec and len(diffs) > 1 else NAN,
            "turns_cut": cut.turns_cut, "probes_cut": cut.probes_cut, "cut_flag": bool(cut.flag),
            "stability_uncut": float(uncut.mean()) if len(uncut) else NAN, "uncut_n": len(uncut),
            "mmlu_dialogs": health["dialogs"], "mmlu_top_letter": health["top_letter"],
            "mmlu_top_share": health["top_share"], "mmlu_collapsed": health["collapsed"], "mmlu_tied": health["tied"],
        })
    gains, gains_uncut, drops = with_holm(gains), with_holm(gains_uncut), with_holm(drops)
    for row, gain, gain_uncut, d in zip(rows, gains, gains_uncut, drops, strict=True):
        row.update(_gain_columns(gain, row["n_conversations"]))
        row.update(_drop_columns(d, len(plain_correct)))
        row.update({"gain_uncut": gain_uncut.diff.estimate if gain_uncut else 0.0,
                    "gain_uncut_p": gain_uncut.p if gain_uncut else NAN,
                    "gain_uncut_p_holm": gain_uncut.p_adjusted if gain_uncut else NAN})
        row["warning"] = "; ".join(_warnings(row, gain, gain_uncut, d, label))
    table = pd.DataFrame(rows)[COLUMNS]
    if task is not None:
        table = table.rename(columns=BENCH_NAMES)
        table.insert(table.columns.get_loc("bench_accuracy"), "benchmark", config["benchmark"])
        table.insert(table.columns.get_loc("bench_accuracy"), "bench_metric", _bench_plan(out)["metric"])
    if config.get("when_drifting") is not None:  # every steered point acted only once its conversation drifted
        table.insert(table.columns.get_loc("spec") + 1, "when_drifting",
                     [None if m == PLAIN else config["when_drifting"] for m in table["method"]])
        if config.get("when_drifting_by", "pi") != "pi":  # by projection; pi, the default, adds no column
            table.insert(table.columns.get_loc("when_drifting") + 1, "when_drifting_by",
                         [None if m == PLAIN else config["when_drifting_by"] for m in table["method"]])
    if write:
        table.to_csv(out / "sweep.csv", index=False)
    return table


def _bench_plan(out: Path) -> dict:
    """The lm-eval benchmark a sweep's points ran (task, metric, filter, ...), as the plain point recorded it."""
    return RunDir(point_dir(out, "") / "benchmark").read_manifest()["benchmark"]


COLUMNS = ["method", "spec", "strength_rank", "stability", "stability_ci_low", "stability_ci_high",
           "stability_ci_method", "stability_gain", "stability_gain_ci_low", "stability_gain_ci_high", "gain_ci_method",
           "gain_n", "gain_better", "gain_worse", "gain_tied", "gain_sd", "gain_method", "gain_p", "gain_p_holm",
           "turns_cut", "probes_cut", "cut_flag", "stability_uncut", "uncut_n", "gain_uncut", "gain_uncut_p",
           "gain_uncut_p_holm",
           "mmlu_accuracy", "mmlu_drop", "mmlu_drop_ci_low", "mmlu_drop_ci_high", "mmlu_ci_method", "mmlu_n",
           "mmlu_dialogs", "mmlu_lost", "mmlu_gained", "mmlu_method", "mmlu_p", "mmlu_p_holm", "mmlu_top_letter",
           "mmlu_top_share", "mmlu_collapsed", "mmlu_tied", "n_conversations", "warning"]
NAN = float("nan")
#: An lm-eval sweep's names of the MMLU columns (`sweep_table`); `cost_view` reads them back.
BENCH_NAMES = {c: "bench_top_choice" if c == "mmlu_top_letter" else "bench_" + c.removeprefix("mmlu_")
               for c in COLUMNS if c.startswith("mmlu_")}


def cost_view(table: pd.DataFrame) -> tuple[pd.DataFrame, str, str]:
    """(the table with the MMLU column names, what prices it, what its items are called): an MMLU
    sweep's as it is, "MMLU", "questions"; an lm-eval sweep's renamed back (`BENCH_NAMES`), e.g.
    "arc_easy acc", "items"."""
    if "bench_drop" not in table.columns:
        return table, "MMLU", "questions"
    view = table.rename(columns={v: k for k, v in BENCH_NAMES.items()})
    task = lmeval.task_of(str(view.benchmark.iloc[0])) if len(view) else "lm-eval"
    metric = str(view.bench_metric.iloc[0]) if len(view) else ""
    return view, f"{task} {metric}".strip(), "items"


def _warnings(row: dict, gain: PairedTest | None, gain_uncut: PairedTest | None, d: PairedTest | None,
              label: str = "MMLU") -> list[str]:
    """What a reader must know before reading a point's row: where n does not support a difference,
    where the gain does not hold without cut probes, where cutting or collapsed answers confound."""
    out = []
    if gain and gain.warning():
        out.append(f"stability gain: {gain.warning()}")
    if gain and gain_uncut and gain.significant != gain_uncut.significant:
        out.append(f"stability gain {'holds' if gain_uncut.significant else 'does not hold'} without cut probes "
                   f"(Holm p {gain_uncut.p_adjusted:.3g} vs {gain.p_adjusted:.3g})")
    if row["cut_flag"]:
        out.append(f"cut at the token limit: {row['turns_cut']:.0%} of turns and {row['probes_cut']:.0%} of probes, "
                   f"more than {CUT_FLAG:.0%} points from plain's")
    if row["mmlu_collapsed"]:
        top = row["mmlu_top_letter"] if label == "MMLU" else f"option {row['mmlu_top_letter']}"
        items = "questions" if label == "MMLU" else "items"
        out.append(f"{label} answers collapsed: {row['mmlu_top_share']:.0%} are {top}, so its accuracy "
                   f"is the share of {items} whose answer is {top}, not knowledge")
    if d and d.warning():
        out.append(f"{label} drop: {d.warning()}")
    return out


def _gain_columns(t: PairedTest | None, n: int) -> dict:
    """The stability gain of a point over plain (steered - plain, per conversation); plain itself: 0, no test."""
    if t is None:
        return {"stability_gain": 0.0, "stability_gain_ci_low": 0.0, "stability_gain_ci_high": 0.0,
                "gain_ci_method": "", "gain_n": n, "gain_better": 0, "gain_worse": 0, "gain_tied": n,
                "gain_method": "", "gain_p": NAN, "gain_p_holm": NAN}
    return {"stability_gain": t.diff.estimate, "stability_gain_ci_low": t.diff.low,
            "stability_gain_ci_high": t.diff.high, "gain_ci_method": t.diff.method, "gain_n": t.n,
            "gain_better": t.better, "gain_worse": t.worse, "gain_tied": t.tied, "gain_method": t.method,
            "gain_p": t.p, "gain_p_holm": t.p_adjusted}


def _drop_columns(t: PairedTest | None, n: int) -> dict:
    """The MMLU drop of a point (plain - steered, per question); plain itself: 0, no test."""
    if t is None:
        return {"mmlu_drop": 0.0, "mmlu_drop_ci_low": 0.0, "mmlu_drop_ci_high": 0.0, "mmlu_ci_method": "",
                "mmlu_n": n, "mmlu_lost": 0, "mmlu_gained": 0, "mmlu_method": "", "mmlu_p": NAN, "mmlu_p_holm": NAN}
    return {"mmlu_drop": t.diff.estimate, "mmlu_drop_ci_low": t.diff.low, "mmlu_drop_ci_high": t.diff.high,
            "mmlu_ci_method": t.diff.method, "mmlu_n": t.n, "mmlu_lost": t.better, "mmlu_gained": t.worse,
            "mmlu_method": t.method, "mmlu_p": t.p, "mmlu_p_holm": t.p_adjusted}


def _drop_basis(table: pd.DataFrame) -> str:
    """How many dialogs (an lm-eval sweep: personas) the drop rests on, and the test that follows from it."""
    table, label, _ = cost_view(table)
    k = int(table.mmlu_dialogs.max()) if len(table) else 1
    if label != "MMLU":
        if k <= 1:
            return ("exact McNemar test over the items, all asked under one persona's system prompt: the drop rests "
                    "on that one prompt (--histories N spreads them over the agents of the first N pairs)")
        return f"the items spread over {k} personas' system prompts, which are the unit of the exact cluster sign-flip test"
    if k <= 1:
        return ("exact McNemar test over the questions, all asked after one dialog: the drop rests on that one "
                "context (--histories N spreads them over N dialogs)")
    return f"the questions spread over {k} dialogs, which are the unit of the exact cluster sign-flip test"


def power_notes(table: pd.DataFrame, gain: float = POWER_GAIN, mmlu_drop: float = POWER_DROP) -> list[str]:
    """What the sweep's n can detect, from its table (`sweep_table`): the pairs a stability gain of
    `gain` needs (paired t, from the sd of the paired differences) and the MMLU questions a drop of
    `mmlu_drop` needs (exact McNemar, from the share of questions answered differently), each at
    alpha 0.05 and power 0.8, with the median over the steered points as the spread."""
    table, label, items = cost_view(table)
    steered = table[table.method != "plain"]
    if steered.empty:
        return []
    notes = []
    sds = steered.gain_sd[steered.gain_sd > 0].dropna()
    if len(sds):
        sd = float(sds.median())
        notes.append(f"A stability gain of {gain:g} needs about {pairs_needed_means(gain, sd)} pairs (paired t, "
                     f"alpha 0.05, power 0.8, sd of the paired differences {sd:.3f}, the median over the points); "
                     f"this sweep has {int(table.n_conversations.max())}.")
    shares = ((steered.mmlu_lost + steered.mmlu_gained) / steered.mmlu_n).dropna()
    # As `driftlab.protocol.mmlu.questions_needed`: the measured disagreement, never below 2 |drop|.
    share = min(1.0, max(2 * mmlu_drop, float(shares.median()) if len(shares) else 0.0))
    shared = "dialogs" if label == "MMLU" else "system prompts"
    lower = (f" if {items} were independent (they are not: they share their {shared}, so this is a lower bound)"
             if int(table.mmlu_dialogs.max()) > 1 else "")
    notes.append(f"{'An' if label == 'MMLU' else 'A'} {label} drop of {mmlu_drop:g} needs about "
                 f"{pairs_needed_proportions(mmlu_drop, share)} {items} "
                 f"(exact McNemar, alpha 0.05, power 0.8, {share:.1%} of {items} answered differently, the median "
                 f"over the points){lower}; this sweep has {int(table.mmlu_n.max())}.")
    return notes


def _per_conversation(scores: pd.DataFrame) -> pd.Series:
    """Each conversation's agent stability (mean probe score over rounds), indexed by pair."""
    agent = scores[(scores.target == "agent") & (scores.condition == "persona")]
    return agent.groupby("pair")["score"].mean()


def matched_points(table: pd.DataFrame, match_drop: float | None = None) -> tuple[float, pd.DataFrame]:
    """(target drop, one row per method: the point whose MMLU (or lm-eval) drop is closest to the target)."""
    table, _, _ = cost_view(table)
    grid = table[table.method != "plain"]
    target = float(grid.mmlu_drop.median()) if match_drop is None else match_drop
    rows = grid.loc[(grid.mmlu_drop - target).abs().groupby(grid.method).idxmin()]
    return target, rows


def tradeoff_figure(table: pd.DataFrame, path: Path) -> Path:
    """Fig. 5 with both uncertainties drawn: stability's CI over conversations (vertical) and the
    paired CI of the MMLU drop over questions (horizontal), so a reader sees at a glance which
    costs the sweep's n can tell apart. A filled marker is a point whose gain over plain holds
    after Holm; a hollow one is not shown to differ."""
    table, label, _ = cost_view(table)
    fig = Figure(figsize=(7.2, 4.6), dpi=130)
    ax = fig.subplots()
    plain = table[table.method == "plain"].iloc[0]
    for method, rows in table[table.method != "plain"].groupby("method", sort=False):
        rows = pd.concat([plain.to_frame().T, rows.sort_values("strength_rank")])
        x, y = rows.mmlu_drop.astype(float), rows.stability.astype(float)
        yerr = [y - rows.stability_ci_low.astype(float), rows.stability_ci_high.astype(float) - y]
        xerr = [x - rows.mmlu_drop_ci_low.astype(float), rows.mmlu_drop_ci_high.astype(float) - x]
        color = COLORS.get(method)
        ax.errorbar(x, y, yerr=yerr, xerr=xerr, marker="none", capsize=2, lw=1.5, elinewidth=0.7, color=color,
                    label=method)
        shown = (rows.gain_p_holm.astype(float) < 0.05).to_numpy()
        ax.scatter(x[shown], y[shown], s=22, color=color, zorder=4)
        ax.scatter(x[~shown], y[~shown], s=22, facecolor="white", edgecolor=color, zorder=4)
        for _, r in rows.iloc[1:].iterrows():
            ax.annotate(str(r.spec).split(":", 1)[1].split(",")[0], (r.mmlu_drop, r.stability),
                        textcoords="offset points", xytext=(4, 4), fontsize=6, color=color)
    ax.scatter([plain.mmlu_drop], [plain.stability], color="black", zorder=5, label="plain")
    ax.axvline(0, color="0.7", lw=0.6, zorder=0)
    ax.set_xlabel("MMLU drop at the question turn (plain - steered; bars: paired 95% CI)" if label == "MMLU" else
                  f"{label} drop, lm-eval (plain - steered; bars: paired 95% CI)")
    ax.set_ylabel("persona stability (mean probe score)")
    ax.set_title("Stability vs cost (persona-drift paper, Fig. 5); vertical bars: 95% CI over conversations;\n"
                 "filled: stability gain over plain shown (Holm p < 0.05), hollow: not shown", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return save_png(fig, path)


def rounds_figure(out: Path, table: pd.DataFrame, match_drop: float | None, path: Path) -> Path:
    target, matched = matched_points(table, match_drop)
    label = cost_view(table)[1]
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
    ax.set_title(f"Stability per round at a matched {label} drop of ~{target:.3f} (persona-drift paper, Fig. 6)",
                 fontsize=9)
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
    label = cost_view(table)[1]
    mmlu = label == "MMLU"
    imgs = "".join(f'<img src="data:image/png;base64,{base64.b64encode(f.read_bytes()).decode()}" '
                   f'style="max-width:48%">' for f in figs)
    cols = ["method", "spec", "stability", "stability_ci_low", "stability_ci_high", "stability_gain",
            "stability_gain_ci_low", "stability_gain_ci_high", "gain_n", "gain_better", "gain_worse", "gain_tied",
            "gain_method", "gain_p", "gain_p_holm", "turns_cut", "probes_cut", "gain_uncut", "gain_uncut_p_holm",
            "mmlu_accuracy", "mmlu_drop", "mmlu_drop_ci_low", "mmlu_drop_ci_high", "mmlu_n", "mmlu_dialogs",
            "mmlu_method", "mmlu_p", "mmlu_p_holm", "mmlu_top_share", "mmlu_tied", "n_conversations"]
    if not mmlu:
        cols = [BENCH_NAMES.get(c, c) for c in cols]
    body = table[cols].to_html(index=False, float_format=lambda v: f"{v:.3f}", border=0, na_rep="")
    gain = "" if best.method == "plain" else (
        f" Its stability gain over plain is {best.stability_gain:+.3f} [{best.stability_gain_ci_low:+.3f}, "
        f"{best.stability_gain_ci_high:+.3f}] ({best.gain_better} pairs better, {best.gain_worse} worse, "
        f"{best.gain_tied} tied; {html.escape(str(best.gain_method))} p = {best.gain_p:.3g}, Holm over the "
        f"sweep's points p = {best.gain_p_holm:.3g}).")
    warnings = "".join(f"<li><b>{html.escape(str(r.spec))}</b>: {html.escape(str(r.warning))}</li>"
                       for r in table.itertuples() if isinstance(r.warning, str) and r.warning)
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in power_notes(table))
    page = (f"<!doctype html><meta charset='utf-8'><title>driftlab sweep</title>"
            f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'>"
            f"<h1>Mitigation trade-off</h1>{imgs}"
            f"<p>At a matched {html.escape(label)} drop of about {target:.3f}, the method with the highest mean "
            f"stability is <b>{html.escape(str(best.spec))}</b> (stability {best.stability:.3f}, "
            f"95% CI [{best.stability_ci_low:.3f}, {best.stability_ci_high:.3f}], {html.escape(label)} drop "
            f"{best.mmlu_drop:+.3f})."
            f"{gain} A method wins only where its Holm-corrected p is below 0.05.</p>"
            + (f"<p>Every point runs the same pairs, starters and seeds and is asked the same MMLU questions, so each is "
               f"compared with plain pair by pair: <i>gain_*</i> is the stability gain (steered - plain per "
               f"conversation, Wilcoxon signed-rank test), <i>mmlu_*</i> the MMLU drop (plain - steered per question; "
               f"{_drop_basis(table)}; lost/gained questions in sweep.csv); <i>p_holm</i> corrects each column's p over "
               f"the sweep's points (Holm). Intervals: t below 30 values, BCa bootstrap from 30; "
               f"the MMLU drop: Newcombe's square-and-add interval for paired proportions over one dialog, a "
               f"cluster-robust t-interval over several (the <i>*_ci_method</i> columns of sweep.csv).</p>" if mmlu else
               f"<p>Every point runs the same pairs, starters and seeds and is asked the same items of the lm-eval task "
               f"{html.escape(label)} (lm-eval's own prompts and metric, the model's chat template, an agent "
               f"persona's system prompt), so each is compared with plain pair by pair: <i>gain_*</i> is the "
               f"stability gain (steered - plain per conversation, Wilcoxon signed-rank test), <i>bench_*</i> the "
               f"{html.escape(label)} drop (plain - steered per item; {_drop_basis(table)}; lost/gained items in "
               f"sweep.csv); <i>p_holm</i> corrects each column's p over the sweep's points (Holm). Intervals: t "
               f"below 30 values, BCa bootstrap from 30; the drop: Newcombe's square-and-add interval for paired "
               f"proportions under one system prompt, a cluster-robust t-interval over several (the "
               f"<i>*_ci_method</i> columns of sweep.csv).</p>")
            + f"<p>What could confound these: <i>turns_cut</i> / <i>probes_cut</i> are the shares of dialog turns and "
            f"agent probes cut at their token limit (a cut probe is scored on what it holds); a point more than "
            f"{CUT_FLAG:.0%} points from plain's is flagged below, and <i>gain_uncut</i> is the stability gain again "
            f"with cut probes left out (Holm p in <i>gain_uncut_p_holm</i>). "
            + ("<i>mmlu_top_share</i> is the share of "
               "answers that are the point's most chosen letter (above 60%: collapsed, its accuracy is that letter's "
               "share of answers, not knowledge); <i>mmlu_tied</i> counts questions whose top letters tied.</p>" if mmlu
               else "<i>bench_top_share</i> is the share of multiple-choice answers that are the point's most chosen "
                    "option (above 60%: collapsed, its accuracy is that option's share of answers, not knowledge); "
                    "<i>bench_tied</i> counts items whose top options tied (both empty for generated answers).</p>")
            + (f"<h2>Where n does not support a difference</h2><ul>{warnings}</ul>" if warnings else "")
            + (f"<h2>What this n can detect</h2><ul>{notes}</ul>" if notes else "")
            + f"{body}</body>")
    (out / "sweep.html").write_text(page, encoding="utf-8")
    return out / "sweep.html"
