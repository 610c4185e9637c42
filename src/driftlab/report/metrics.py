"""From the records of a self-chat run to the numbers of Figure 3 (the persona-drift and instruction-stability papers, Sec. 3.3).

Two steps, both tidy pandas frames:

    probe_scores(records, manifest)  one row per (pair, condition, round, target): the probe
                                     repeats averaged, because the conversation, not the
                                     sample, is the unit the paper averages over.
    summarize(scores)                per condition x target x round x category (and "all"):
                                     n conversations, mean, std, 95% CI of the mean and
                                     the CI's method (`driftlab.stats.mean_interval`).
    summarize_overall(scores)        the same per conversation averaged over probe rounds.

Targets: "agent" is instruction stability f_B(b'_i | a_i = p_B); "user" is adoption of the
user's persona f_A(b'_i | a_i = p_A); "user-excess" is that adoption above the conversation's
own baseline, f_A at round i minus f_A at round 1. At round 1 the agent has seen only its
system prompt and p_A, no word of the user LM, so round 1 is "the same probe answered by the
agent with no user persona": a format persona whose measure any reply satisfies (e.g. a
length or language measure the agent meets anyway) then scores high at every round but
shows no excess. It exists only when round 1 is a probe round. The CI is over conversations,
chosen by n (`driftlab.stats.mean_interval`): a t-interval below 30 conversations, where a
bootstrap is too narrow; the BCa bootstrap (conversations resampled) from 30 on; Wilson
where every value is 0 or 1. Its method is the `ci_method` column. With n < 2 it is
undefined and reported as NaN, like the std.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from driftlab.errors import DriftlabError
from driftlab.protocol.registry import protocol_of
from driftlab.stats import CONFIDENCE, N_RESAMPLES, agreement, mean_interval, paired_test, with_holm

ALL = "all"  # the category label of rows that pool every category
TARGETS = ("agent", "user", "user-excess")
TARGET_LABELS = {"agent": "agent stability", "user": "user-persona adoption",
                 "user-excess": "adoption above round 1"}
SCORE_COLUMNS = ["pair", "condition", "round", "target", "persona", "category", "score", "n_repeats"]
SUMMARY_COLUMNS = ["condition", "target", "category", "round", "n", "mean", "std", "ci_low", "ci_high", "ci_method"]
OVERALL_COLUMNS = ["condition", "target", "category", "rounds", "n", "mean", "std", "ci_low", "ci_high", "ci_method"]
def _group_rng(seed: int, key: Iterable[Any]) -> np.random.Generator:
    """One generator per summary cell, so a cell's CI does not depend on which other cells exist."""
    return np.random.default_rng([seed, zlib.crc32(repr(tuple(key)).encode())])


def _stats(values: np.ndarray, rng: np.random.Generator, n_resamples: int, confidence: float) -> dict:
    x = values[np.isfinite(values)]
    iv = mean_interval(x, confidence=confidence, rng=rng, n_resamples=n_resamples)
    return {
        "n": int(x.size),
        "mean": float(x.mean()) if x.size else float("nan"),
        "std": float(x.std(ddof=1)) if x.size > 1 else float("nan"),
        "ci_low": iv.low,
        "ci_high": iv.high,
        "ci_method": iv.method,
    }


# -- scores -----------------------------------------------------------------------------------
def _category_of(manifest: dict[str, Any]) -> dict[str, str]:
    """persona id -> category, from the manifest's personas (falling back to its pairs)."""
    out: dict[str, str] = {}
    for pair in manifest.get("pairs", []):
        out.setdefault(pair.get("agent"), pair.get("agent_category") or "unknown")
        out.setdefault(pair.get("user"), pair.get("user_category") or "unknown")
    for pid, persona in (manifest.get("personas") or {}).items():
        out[pid] = persona.get("category") or out.get(pid, "unknown")
    return out


def probe_scores(records: Iterable[dict[str, Any]], manifest: dict[str, Any]) -> pd.DataFrame:
    """One row per (pair, condition, round, target): the probe score averaged over repeats.

    Repeats are re-samples of the same probe in the same conversation, so they are averaged
    first; the bootstrap then resamples conversations. A missing or null score is NaN and
    ignored in the average; `n_repeats` counts the finite scores behind each row.
    """
    cats = _category_of(manifest)
    rows = [
        {
            "pair": int(r["pair"]),
            "condition": r["condition"],
            "round": int(r["round"]),
            "target": r["target"],
            "persona": r.get("persona", ""),
            "score": float("nan") if r.get("score") is None else float(r["score"]),
        }
        for r in records
        if r.get("kind") == "probe"
    ]
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in SCORE_COLUMNS})
    df = pd.DataFrame(rows)
    df["category"] = df["persona"].map(lambda p: cats.get(p, "unknown"))
    keys = ["pair", "condition", "round", "target", "persona", "category"]
    out = df.groupby(keys, sort=False, dropna=False)["score"].agg(["mean", "count"]).reset_index()
    out = out.rename(columns={"mean": "score", "count": "n_repeats"})
    order = _condition_order(manifest, out["condition"])
    out = pd.concat([out, _excess(out)], ignore_index=True)
    out["_c"] = out["condition"].map(order.index)
    out = out.sort_values(["_c", "target", "pair", "round"]).drop(columns="_c").reset_index(drop=True)
    return out[SCORE_COLUMNS]


def _excess(scores: pd.DataFrame) -> pd.DataFrame:
    """'user-excess' rows: each conversation's adoption at round i > 1 minus its own round-1 adoption."""
    user = scores[scores["target"] == "user"]
    base = user[user["round"] == 1].set_index(["pair", "condition"])["score"]
    later = user[(user["round"] > 1) & user.set_index(["pair", "condition"]).index.isin(base.index)].copy()
    if later.empty:
        return later
    later["score"] = later["score"].to_numpy(float) - base.loc[list(zip(later["pair"], later["condition"]))].to_numpy()
    later["target"] = "user-excess"
    return later


def _condition_order(manifest: dict[str, Any], seen: Iterable[str]) -> list[str]:
    order = list(manifest.get("conditions") or [])
    return order + sorted(set(seen) - set(order))


def category_order(categories: Iterable[str]) -> list[str]:
    """ "all" first, then the benchmark's order, then anything else alphabetically."""
    from driftlab.bench import CATEGORIES

    present = set(categories) - {ALL}
    known = [c for c in CATEGORIES if c in present]
    return [ALL, *known, *sorted(present - set(known))]


def _cells(scores: pd.DataFrame):
    """(condition, target, category, sub-frame) for every category and the pooled "all"."""
    for (cond, target), grp in scores.groupby(["condition", "target"], sort=False):
        for cat in category_order(grp["category"]):
            yield cond, target, cat, grp if cat == ALL else grp[grp["category"] == cat]


# -- summaries --------------------------------------------------------------------------------
def summarize(
    scores: pd.DataFrame, n_resamples: int = N_RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0
) -> pd.DataFrame:
    """Per condition x target x category x round: n, mean, std (ddof=1), CI of the mean and its method."""
    rows = []
    for cond, target, cat, sub in _cells(scores):
        for rnd, cell in sub.groupby("round", sort=True):
            rng = _group_rng(seed, (cond, target, cat, int(rnd)))
            stats = _stats(cell["score"].to_numpy(float), rng, n_resamples, confidence)
            rows.append({"condition": cond, "target": target, "category": cat, "round": int(rnd), **stats})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def common_rounds(scores: pd.DataFrame) -> list[int]:
    """The probe rounds every conversation in `scores` has a score for.

    A complete run gives all probe rounds. A killed run gives the rounds everyone reached,
    so the overall mean is never biased upwards by conversations that stopped early
    (stability falls with rounds).
    """
    finite = scores[np.isfinite(scores["score"].to_numpy(float))]
    if finite.empty:
        return []
    per_pair = finite.groupby("pair")["round"].agg(lambda r: frozenset(int(x) for x in r))
    return sorted(frozenset.intersection(*per_pair))


def summarize_overall(
    scores: pd.DataFrame, n_resamples: int = N_RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0
) -> pd.DataFrame:
    """Stability over the whole dialog: each conversation's mean over probe rounds, then the
    n / mean / std / CI of those per-conversation means (per condition x target x category).

    The rounds are `common_rounds` of the pooled (condition, target) cell, shared by its
    categories; they are listed in the `rounds` column.
    """
    rows = []
    rounds_of: dict[tuple[str, str], list[int]] = {}
    for cond, target, cat, sub in _cells(scores):
        if cat == ALL:
            rounds_of[(cond, target)] = common_rounds(sub)
        rounds = rounds_of[(cond, target)]
        per_conv = sub[sub["round"].isin(rounds)].groupby("pair")["score"].mean().to_numpy(float)
        rng = _group_rng(seed, (cond, target, cat, "overall"))
        stats = _stats(per_conv, rng, n_resamples, confidence)
        rows.append(
            {
                "condition": cond,
                "target": target,
                "category": cat,
                "rounds": ",".join(map(str, rounds)),
                **stats,
            }
        )
    return pd.DataFrame(rows, columns=OVERALL_COLUMNS)


COMPARISON_COLUMNS = ["target", "condition", "versus", "rounds", "n", "better", "worse", "tied", "diff",
                      "diff_ci_low", "diff_ci_high", "ci_method", "p", "p_holm", "method", "warning"]


def compare_conditions(scores: pd.DataFrame) -> pd.DataFrame:
    """Each condition against the first (e.g. the empty-user ablation against the persona run),
    paired by conversation: per target, each conversation's mean over the rounds both
    conditions reached, `condition - versus` tested by the Wilcoxon signed-rank test (exact at
    these n, ties included), with the mean difference, its interval (t below 30 pairs) and
    the counts better / worse / tied; Holm over the run's comparisons; a plain `warning`
    where n does not support a difference. Empty with one condition.
    """
    conditions = list(dict.fromkeys(scores["condition"]))
    rows, tests = [], []
    for target in [t for t in TARGETS if t in set(scores["target"])]:
        sub = scores[scores["target"] == target]
        base = sub[sub["condition"] == conditions[0]] if conditions else sub
        for cond in conditions[1:]:
            other = sub[sub["condition"] == cond]
            if other.empty or base.empty:
                continue
            rounds = sorted(set(common_rounds(base)) & set(common_rounds(other)))
            per = {c: d[d["round"].isin(rounds)].groupby("pair")["score"].mean().to_dict()
                   for c, d in ((cond, other), (conditions[0], base))}
            tests.append(paired_test(per[cond], per[conditions[0]], method="wilcoxon"))
            rows.append({"target": target, "condition": cond, "versus": conditions[0],
                         "rounds": ",".join(map(str, rounds))})
    for row, t in zip(rows, with_holm(tests), strict=True):
        row.update(t.as_dict(), warning=t.warning() or "")
    return pd.DataFrame(rows, columns=COMPARISON_COLUMNS)


DRIFT_COLUMNS = ["target", "condition", "first", "last", "n", "better", "worse", "tied", "diff", "diff_ci_low",
                 "diff_ci_high", "ci_method", "p", "p_holm", "method", "warning"]


def drift_tests(scores: pd.DataFrame) -> pd.DataFrame:
    """Does a score change over the dialog? Per condition and target (agent stability,
    user-persona adoption): each conversation's score at the last probe round every
    conversation reached minus its score at the first (repeated probes averaged), paired by
    conversation: exact McNemar when all scores are 0/1, else the Wilcoxon signed-rank test;
    Holm over the run's drift tests; a plain `warning` where n does not support a change.

    Why a test of its own: "the agent drifts" is the protocol's headline claim, and a falling
    curve of means over a few conversations does not show it. `user-excess` is left out: it
    is already a difference from round 1.
    """
    rows, tests = [], []
    for target in [t for t in ("agent", "user") if t in set(scores["target"])]:
        for cond in dict.fromkeys(scores["condition"]):
            sub = scores[(scores["target"] == target) & (scores["condition"] == cond)]
            rounds = common_rounds(sub)
            if len(rounds) < 2:
                continue
            first, last = rounds[0], rounds[-1]
            per = {r: sub[sub["round"] == r].groupby("pair")["score"].mean().to_dict() for r in (first, last)}
            tests.append(paired_test(per[last], per[first]))
            rows.append({"target": target, "condition": cond, "first": first, "last": last})
    for row, t in zip(rows, with_holm(tests), strict=True):
        row.update(t.as_dict(), warning=t.warning() or "")
    return pd.DataFrame(rows, columns=DRIFT_COLUMNS)


# -- a whole run ------------------------------------------------------------------------------
def truncation(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Per condition x round: how many dialog turns and probe replies hit --max-new-tokens.

    A reply cut at the token limit can fail a measure for being cut (a JSON object without
    its closing brace, a list without its last item), not for drifting; probes whose measure
    needs a complete reply are then left unscored (score None) rather than counted as 0.
    `probes_error` counts probes whose measure failed (raised, or gave no score in [0, 1]).
    """
    rows = [
        {"condition": r["condition"], "round": int(r["round"]), "kind": r["kind"],
         "cut": r.get("finish_reason") == "length",
         "unscored": r["kind"] == "probe" and r.get("score") is None and not r.get("error"),
         "error": r["kind"] == "probe" and bool(r.get("error"))}
        for r in records if r.get("kind") in ("turn", "probe")
    ]
    columns = ["condition", "round", "turns", "turns_cut", "probes", "probes_cut", "probes_unscored", "probes_error"]
    if not rows:
        return pd.DataFrame(columns=columns)
    df = pd.DataFrame(rows)
    out = []
    for (cond, rnd), g in df.groupby(["condition", "round"], sort=False):
        turns, probes = g[g.kind == "turn"], g[g.kind == "probe"]
        out.append({"condition": cond, "round": rnd, "turns": len(turns),
                    "turns_cut": float(turns.cut.mean()) if len(turns) else float("nan"),
                    "probes": len(probes), "probes_cut": float(probes.cut.mean()) if len(probes) else float("nan"),
                    "probes_unscored": int(probes.unscored.sum()), "probes_error": int(probes.error.sum())})
    return pd.DataFrame(out, columns=columns).sort_values(["condition", "round"], kind="stable").reset_index(drop=True)


CUT_FLAG = 0.10  # a condition whose share of cut replies differs from the first's by more is flagged
CUT_COLUMNS = ["condition", "turns", "turns_cut", "probes", "probes_cut", "flag"]


def is_cut(record: dict[str, Any]) -> bool:
    """A reply that hit its token limit (finish_reason 'length')."""
    return record.get("finish_reason") == "length"


def cut_shares(records: Iterable[dict[str, Any]], base: dict[str, float] | None = None) -> pd.DataFrame:
    """Per condition: the share of dialog turns and of agent probes cut at their token limit, and
    a `flag` where either share differs from the base's (the first condition's, or `base`: plain's
    {"turns_cut", "probes_cut"} in a sweep) by more than CUT_FLAG.

    Why: a cut probe is scored on what it holds, so a condition whose replies are cut more often
    can score lower (or higher) for that alone: a confound of any stability comparison. The flag
    says where to read the comparison without cut probes (`uncut_scores`).
    """
    rows: dict[str, dict[str, list[bool]]] = {}
    for r in records:
        if r.get("kind") == "turn" or (r.get("kind") == "probe" and r.get("target") == "agent"):
            rows.setdefault(r["condition"], {"turn": [], "probe": []})[r["kind"]].append(is_cut(r))
    out = []
    for cond, kinds in rows.items():
        share = {k: float(np.mean(v)) if v else float("nan") for k, v in kinds.items()}
        out.append({"condition": cond, "turns": len(kinds["turn"]), "turns_cut": share["turn"],
                    "probes": len(kinds["probe"]), "probes_cut": share["probe"]})
    ref = base or ({"turns_cut": out[0]["turns_cut"], "probes_cut": out[0]["probes_cut"]} if out else {})
    for row in out:
        row["flag"] = any(abs(row[k] - ref[k]) > CUT_FLAG for k in ("turns_cut", "probes_cut")
                          if np.isfinite(row[k]) and np.isfinite(ref[k]))
    return pd.DataFrame(out, columns=CUT_COLUMNS)


def uncut_scores(records: Iterable[dict[str, Any]], manifest: dict[str, Any]) -> pd.DataFrame:
    """`probe_scores` without the probes cut at their token limit: the sensitivity analysis of any
    stability figure (does it hold when only complete replies are scored?)."""
    return probe_scores([r for r in records if not (r.get("kind") == "probe" and is_cut(r))], manifest)


JUDGE_COLUMNS = ["target", "n", "measure_mean", "judge_mean", "spearman", "spearman_p", "agree", "agree_low",
                 "agree_high", "agree_method", "kappa", "mad", "judge_errors"]


def judge_agreement(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Per probe target: how the run's judge (`--judge`) agrees with the personas' own measures on
    the replies both scored (Spearman rho, pass/fail agreement at 0.5 with its Wilson interval,
    Cohen's kappa, mean absolute difference), and how many replies the judge could not rate.
    Empty for a run without a judge. Read it before trusting a judge where no measure exists."""
    probes = [r for r in records if r.get("kind") == "probe" and (r.get("judge") is not None or r.get("judge_error"))]
    rows = []
    for target in sorted({r["target"] for r in probes}):
        mine = [r for r in probes if r["target"] == target]
        both = [r for r in mine if r.get("score") is not None and r.get("judge") is not None]
        a = agreement([r["score"] for r in both], [r["judge"] for r in both])
        rows.append({"target": target, "n": a.n,
                     "measure_mean": float(np.mean([r["score"] for r in both])) if both else float("nan"),
                     "judge_mean": float(np.mean([r["judge"] for r in both])) if both else float("nan"),
                     "spearman": a.spearman, "spearman_p": a.spearman_p, "agree": a.agree.estimate,
                     "agree_low": a.agree.low, "agree_high": a.agree.high, "agree_method": a.agree.method,
                     "kappa": a.kappa, "mad": a.mad,
                     "judge_errors": sum(1 for r in mine if r.get("judge_error"))})
    return pd.DataFrame(rows, columns=JUDGE_COLUMNS)


class RunSummary(NamedTuple):
    """Everything the report, the figures and the CLI table are made from."""

    manifest: dict[str, Any]
    records: list[dict[str, Any]]
    scores: pd.DataFrame
    per_round: pd.DataFrame
    overall: pd.DataFrame
    truncation: pd.DataFrame
    comparisons: pd.DataFrame  # `compare_conditions`: each condition against the first, paired
    drift: pd.DataFrame  # `drift_tests`: the last probe round against the first, paired
    cut: pd.DataFrame  # `cut_shares`: replies cut at their token limit, per condition, flagged
    overall_uncut: pd.DataFrame  # `summarize_overall` of `uncut_scores`: cut probes left out
    comparisons_uncut: pd.DataFrame  # `compare_conditions` of `uncut_scores`
    judge: pd.DataFrame  # `judge_agreement`: the run's judge against each persona's measure (empty without one)


def summarize_run(run_dir: str | Path, n_resamples: int = N_RESAMPLES, seed: int = 0) -> RunSummary:
    """Load a run directory and summarise it; a DriftlabError if it has no probe records yet."""
    from driftlab.records.rundir import RunDir

    rd = RunDir(run_dir)
    if not rd.path.is_dir():
        raise DriftlabError(
            f"{rd.path} does not exist.", hint="Give the --out directory of a `driftlab run`."
        )
    manifest = rd.read_manifest()
    protocol = protocol_of(manifest)
    if protocol.name != "selfchat":
        raise DriftlabError(f"{rd.path} holds a '{protocol.name}' run; this report is for self-chat runs.",
                            hint=f"Re-run the same `driftlab {protocol.name}` command to print its summary.")
    records = [r.model_dump() for r in rd.records(protocol.records)]
    scores = probe_scores(records, manifest)
    uncut = uncut_scores(records, manifest)
    if scores.empty:
        raise DriftlabError(
            f"{rd.path} has no probe records yet ({len(records)} records in all).",
            hint="Probes are scored at each probe round; wait for round "
            f"{(manifest.get('probe_rounds') or [1])[0]} to finish, or resume the run with the same command.",
        )
    return RunSummary(
        manifest=manifest,
        records=records,
        scores=scores,
        per_round=summarize(scores, n_resamples=n_resamples, seed=seed),
        overall=summarize_overall(scores, n_resamples=n_resamples, seed=seed),
        truncation=truncation(records),
        comparisons=compare_conditions(scores),
        drift=drift_tests(scores),
        cut=cut_shares(records),
        overall_uncut=summarize_overall(uncut, n_resamples=n_resamples, seed=seed),
        comparisons_uncut=compare_conditions(uncut),
        judge=judge_agreement(records),
    )
