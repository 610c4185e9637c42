"""One self-contained report.html per run: header, Figure 3, tables, browsable transcripts.

Self-contained so a run directory can be mailed or attached as it is: figures are base64
PNGs, the CSS is inline, nothing is fetched. All model text goes through Jinja's
autoescape, since replies can contain anything, `<script>` included.

    write_report(run_dir)  -> run_dir/report.html  (+ summary.csv, overall.csv, the PNGs)
"""

from __future__ import annotations

import base64
import datetime as _dt
import math
import os
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd

from driftlab.protocol.registry import protocol_of
from driftlab.protocol.runner import config_of
from driftlab.report.figures import Errors, error_note, model_title, write_figures
from driftlab.report.metrics import (
    CUT_FLAG,
    N_RESAMPLES,
    SUMMARY_COLUMNS,
    TARGET_LABELS,
    RunSummary,
    summarize_run,
)
from driftlab.report.tables import (
    CONDITION_LABELS,
    TextTable,
    category_table,
    comparison_table,
    drift_table,
    fmt,
    round_table,
)

REPORT = "report.html"
SUMMARY_CSV = "summary.csv"
OVERALL_CSV = "overall.csv"
CONFIG_KEYS = (
    "rounds",
    "probe_every",
    "probe_repeats",
    "user_probe",
    "ablation",
    "fold_first_exchange",
    "max_new_tokens",
    "temperature",
    "top_p",
    "greedy",
    "seed",
    "dtype",
    "span",
    "categories",
    "persona_file",
)


def score_color(score: float | None) -> str:
    """Background for a score: red (0) through yellow to green (1); grey when missing."""
    if score is None or not math.isfinite(score):
        return "#e5e5e5"
    hue = 120 * min(1.0, max(0.0, score))
    return f"hsl({hue:.0f}, 70%, 82%)"


# -- header -----------------------------------------------------------------------------------
def _model_line(meta: dict[str, Any] | None, fallback: str) -> str:
    if not meta:
        return fallback
    preset = meta.get("preset") or {}
    parts = [meta.get("name", fallback)]
    if preset.get("model"):
        parts.append(f"({preset['model']})")
    parts += [str(meta[k]) for k in ("architecture", "dtype", "device") if meta.get(k)]
    return " · ".join(parts)


def header_rows(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows for the header: models, config, steering, versions, dates."""
    cfg = config_of(manifest)
    cfg = {**cfg, **(cfg.get("sampling") or {}), **(cfg.get("backend") or {})}  # nested settings, flat
    models = manifest.get("models") or {}
    rows = [("agent model", _model_line(models.get("agent"), cfg.get("model", "?")))]
    user_line = _model_line(models.get("user"), cfg.get("user_model") or cfg.get("model", "?"))
    if user_line != rows[0][1]:
        rows.append(("user model", user_line))
    rows.append(
        (
            "conversations",
            f"{len(manifest.get('pairs', []))} persona pairs × conditions "
            f"{', '.join(manifest.get('conditions', []))}",
        )
    )
    rows.append(("probe rounds", ", ".join(map(str, manifest.get("probe_rounds", [])))))
    rows.append(
        ("config", ", ".join(f"{k}={cfg[k]}" for k in CONFIG_KEYS if k in cfg and cfg[k] is not None))
    )
    steer = ", ".join(cfg.get("steer") or []) or "none"
    rows.append(("steering", steer))
    rows.append(("versions", ", ".join(f"{k} {v}" for k, v in (manifest.get("versions") or {}).items())))
    rows.append(("created", str(manifest.get("created", "?"))))
    rows.append(("report written", _dt.datetime.now().astimezone().strftime("%Y-%m-%dT%H:%M:%S%z")))
    return rows


def progress(summary: RunSummary) -> dict[str, Any]:
    """Records present vs. expected, for the 'incomplete' banner."""
    expected = protocol_of(summary.manifest).expected(summary.manifest)
    present = {"turn": 0, "probe": 0}
    for r in summary.records:
        if r.get("kind") in present:
            present[r["kind"]] += 1
    # A manifest marked completed whose records are short (lines removed or lost) is incomplete too.
    complete = summary.manifest.get("completed") is True and all(present[k] >= n for k, n in expected.items())
    return {"complete": complete, "expected": expected, "present": present}


# -- transcripts ------------------------------------------------------------------------------
def _reply(rec: dict[str, Any]) -> dict[str, Any]:
    score = rec.get("score")
    score = float("nan") if score is None else float(score)
    return {
        "text": rec.get("text", ""),
        "score": fmt(score),
        "color": score_color(score),
        "repeat": rec.get("repeat", 0),
        "truncated": rec.get("finish_reason") == "length",
        "n_tokens": rec.get("n_tokens"),
    }


def transcripts(summary: RunSummary, max_pairs: int | None = None) -> list[dict[str, Any]]:
    """One entry per conversation (pair × condition), in manifest order, ready for the template.

    The template places each round's probes where the run asked them (`probe_placement`).
    `max_pairs` keeps the first pairs only (all their conditions), to bound the page size.
    """
    manifest = summary.manifest
    personas = manifest.get("personas") or {}
    turns: dict[tuple, dict[tuple[int, str], dict]] = defaultdict(dict)
    probes: dict[tuple, dict[int, dict[str, list]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for r in summary.records:
        key = (r.get("pair"), r.get("condition"))
        if r.get("kind") == "turn":
            turns[key][(r["round"], r["speaker"])] = r
        elif r.get("kind") == "probe":
            probes[key][r["round"]][r["target"]].append(r)
    conv_scores = summary.scores.set_index(["pair", "condition", "round", "target"])["score"]
    out = []
    for cond in manifest.get("conditions", []):
        for pair in manifest.get("pairs", [])[:max_pairs]:
            key = (pair["pair"], cond)
            if key not in turns and key not in probes:
                continue
            agent = personas.get(pair["agent"], {"id": pair["agent"]})
            user = _as_asked(personas.get(pair["user"], {"id": pair["user"]}), config_of(manifest))
            out.append(
                {
                    "id": f"pair{pair['pair']}-{cond}",
                    "pair": pair["pair"],
                    "condition": cond,
                    "condition_label": CONDITION_LABELS.get(cond, cond),
                    "agent": agent,
                    "user": user,
                    "user_system": user.get("system_prompt", "") if cond == "persona" else None,
                    "starter": pair.get("starter", ""),
                    "chips": _chips(conv_scores, key),
                    "rounds": _rounds(pair, turns[key], probes[key], agent, user),
                }
            )
    return out


def probe_placement(manifest: dict[str, Any]) -> str:
    """Where the run's probes went: 'agent' (after b_i, today's default) or 'user' (in place of
    a_i; also every run recorded before `probe_after` existed, as such manifests resume)."""
    return config_of(manifest).get("probe_after", "user")


def _as_asked(user: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The user persona with the p_A the run asked (the instruction-stability paper's probe where the
    run used user-probe version 'crafted-or-generic')."""
    version = config.get("user_probe_version", "own")
    if version == "own" or "probe" not in user:
        return user
    from driftlab.bench import Persona, user_probe

    return {**user, "probe": user_probe(Persona.model_validate(user), version, seed=config.get("seed", 0)).probe}


def _chips(conv_scores: pd.Series, key: tuple) -> list[dict[str, Any]]:
    """Per-round repeat-averaged scores of one conversation, grouped by target, for its <summary>."""
    groups = []
    for target in ("agent", "user"):
        try:
            series = conv_scores.xs((key[0], key[1]), level=["pair", "condition"]).xs(target, level="target")
        except KeyError:
            continue
        chips = [
            {"round": int(rnd), "score": fmt(score), "color": score_color(score)}
            for rnd, score in series.sort_index().items()
        ]
        groups.append(
            {"target": target, "label": "stability" if target == "agent" else "adoption", "chips": chips}
        )
    return groups


def _rounds(pair: dict, turns: dict, probes: dict, agent: dict, user: dict) -> list[dict[str, Any]]:
    rounds = sorted({r for r, _ in turns} | set(probes))
    out = []
    for i in rounds:
        probe_blocks = []
        for target in ("agent", "user"):
            recs = sorted(probes.get(i, {}).get(target, []), key=lambda r: r.get("repeat", 0))
            if not recs:
                continue
            persona = agent if target == "agent" else user
            replies = [_reply(r) for r in recs]
            scores = [float(r["score"]) for r in recs if r.get("score") is not None]
            mean = sum(scores) / len(scores) if scores else float("nan")
            probe_blocks.append(
                {
                    "target": target,
                    "label": TARGET_LABELS[target],
                    "symbol": "p_B" if target == "agent" else "p_A",
                    "persona": persona.get("id", ""),
                    "question": persona.get("probe", ""),
                    "mean": fmt(mean),
                    "color": score_color(mean),
                    "replies": replies,
                }
            )
        dialog = []
        if i == 1:
            dialog.append(
                {
                    "speaker": "user",
                    "label": "a_1 (starter)",
                    "text": pair.get("starter", ""),
                    "truncated": False,
                }
            )
        for speaker, sym in (("user", "a"), ("agent", "b")):
            rec = turns.get((i, speaker))
            if rec is not None:
                dialog.append(
                    {
                        "speaker": speaker,
                        "label": f"{sym}_{i}",
                        "text": rec.get("text", ""),
                        "truncated": rec.get("finish_reason") == "length",
                    }
                )
        out.append({"round": i, "probes": probe_blocks, "turns": dialog})
    return out


def cut_tables(summary: RunSummary) -> list[TextTable]:
    """Cut replies per condition (flagged where a condition differs from the first by more than
    CUT_FLAG), and the overall stability again without the cut probes: the sensitivity analysis."""
    uncut = summary.overall_uncut
    both = summary.overall.merge(uncut, on=["condition", "target", "category"], suffixes=("", "_uncut"))
    both = both[both.category == "all"][["condition", "target", "n", "mean", "n_uncut", "mean_uncut",
                                          "ci_low_uncut", "ci_high_uncut"]]
    return [
        _frame_table(summary.cut, "Replies cut at their token limit, per condition",
                     f"turns_cut: share of dialog turns; probes_cut: share of agent probes; flag: a share differs "
                     f"from the first condition's by more than {CUT_FLAG:.0%} points, so a comparison of the two "
                     "may reflect cutting: read it without the cut probes (next table)."),
        _frame_table(both, "Overall scores without cut probes (sensitivity)",
                     "mean: every probe scored; mean_uncut: probes cut at their token limit left out (a conversation "
                     "whose probes were all cut drops out, n_uncut). A conclusion that holds in both does not rest "
                     "on cutting."),
    ]


# -- page -------------------------------------------------------------------------------------
def judge_tables(summary: RunSummary) -> list[TextTable]:
    """The run's judge against the personas' measures (none for a run without `--judge`)."""
    if summary.judge.empty:
        return []
    return [_frame_table(summary.judge, "Judge model against the deterministic measures",
                         "Per probe target, on the replies both scored: Spearman rho of the two scores, the share "
                         "both put on the same side of 0.5 (agree, Wilson 95% interval), Cohen's kappa of those "
                         "pass/fail calls, the mean absolute difference (mad); judge_errors: replies whose verdict "
                         "held no rating. A judge that disagrees here should not be trusted where no measure exists.")]


def _png_data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _frame_table(df: pd.DataFrame, title: str, note: str) -> TextTable:
    cols = list(df.columns)
    rows = [
        [fmt(v, 3) if isinstance(v, float) else str(v) for v in row] for row in df.itertuples(index=False)
    ]
    return TextTable(title=title, columns=cols, rows=rows, note=note)


def render_html(
    summary: RunSummary,
    figures: dict[str, Path],
    run_dir: Path,
    errors: Errors = "ci",
    max_pairs: int | None = None,
    measured: list[TextTable] = (),
) -> str:
    """The report page as a string (figures read from `figures` and embedded); `measured` are the
    tables of the other measures (`three_ways`), shown first where the run measured pi, the
    projection or the KLs."""
    import jinja2

    env = jinja2.Environment(
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True
    )
    template = env.from_string(
        resources.files("driftlab.report").joinpath("template.html").read_text("utf-8")
    )
    note = error_note(errors)
    return template.render(
        title=f"driftlab report · {run_dir.name}",
        model=model_title(summary.manifest),
        run_dir=str(run_dir),
        header=header_rows(summary.manifest),
        progress=progress(summary),
        figures=[
            *([{"title": "Drift measured side by side: the probe score with pi, the projection on the persona's "
                         "direction and the KLs, those the run measured",
                "src": _png_data_uri(figures["three_ways"]), "caption": measured[0].note}]
              if "three_ways" in figures else []),
            {"title": "Figure 3: drift over rounds", "src": _png_data_uri(figures["drift"]), "caption": note},
            {"title": "By persona category", "src": _png_data_uri(figures["categories"]), "caption": note},
        ],
        tables=[*measured,
                *(t for t in (round_table(summary), drift_table(summary), comparison_table(summary)) if t is not None)]
        + [category_table(summary), _frame_table(
            summary.truncation,
            "Replies cut at --max-new-tokens, per round",
            "turns_cut / probes_cut: share of replies that hit the token limit (finish_reason 'length'); "
            "probes_unscored: cut probes whose measure needs a complete reply (left out of the means, not "
            "counted as drift); probes_error: probes whose measure failed (raised, or gave no score in [0, 1]; "
            "each record's error field says why). Many cuts mean --max-new-tokens is too small for these personas.",
        ), *cut_tables(summary), *judge_tables(summary)],
        full_table=_frame_table(
            summary.per_round,
            "Every cell (summary.csv)",
            "std: across conversations (ddof=1); CI of the mean by ci_method: t (t-interval, below 30 "
            "conversations), bca (BCa bootstrap, scipy, from 30), wilson (0/1 values, at any n); NaN (–) for "
            "graded values when n < 2.",
        ),
        conversations=transcripts(summary, max_pairs),
        probe_after=probe_placement(summary.manifest),
        n_pairs=len(summary.manifest.get("pairs", [])),
        max_pairs=max_pairs,
    )


def three_ways(run_dir: Path, figures: dict[str, Path]) -> list[TextTable]:
    """Where the run measured pi (`--steer trace`), projections (`--directions`) or KLs (`--kl`): the
    measures figure (added to `figures`), and `report.activation.measure_tables`."""
    from driftlab.report.activation import FIGURE, measure_tables, measured, measures_frame, three_ways_figure

    frame = measures_frame(run_dir)
    if not measured(frame):
        return []
    figures["three_ways"] = three_ways_figure(frame, run_dir / FIGURE)
    return measure_tables(frame)


def write_report(
    run_dir: str | Path,
    errors: Errors = "ci",
    n_resamples: int = N_RESAMPLES,
    summary: RunSummary | None = None,
    max_pairs: int | None = None,
) -> Path:
    """Write report.html, summary.csv (per round), overall.csv and the figures into the run dir.

    Works on partial runs (the page says so). Raises DriftlabError if the directory is not a
    run or has no probe records yet. Pass `summary` (from summarize_run) to skip re-reading;
    `max_pairs` limits the transcripts to the first pairs (the statistics always use all).
    """
    run_dir = Path(run_dir)
    if summary is None:
        summary = summarize_run(run_dir, n_resamples=n_resamples)
    summary.per_round.to_csv(run_dir / SUMMARY_CSV, index=False, columns=SUMMARY_COLUMNS)
    summary.overall.to_csv(run_dir / OVERALL_CSV, index=False)
    figures = write_figures(summary, run_dir, errors)
    measured = three_ways(run_dir, figures)
    page = render_html(summary, figures, run_dir, errors, max_pairs, measured)
    path = run_dir / REPORT
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)  # a browser tab never sees half a page
    return path
