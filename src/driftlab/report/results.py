"""One results contract for every protocol: `summarize(run_dir) -> Results`.

Each protocol's own summary has the shape its report needs (a self-chat's `RunSummary` of
DataFrames, MMLU's dict, a sweep's table, PASTA's metric intervals). `Results` is what they
have in common, in one typed shape: a list of `Estimate`s, each a number with the n behind
it, its interval and the interval's method, and, for a difference, its test and p-value (Holm-
corrected where the family was), keyed by what it is about (`group`: condition, target, round,
point, metric, ...). Beside them, the run's identity: protocol, model, revision, dtype, steer
and seed. `Results.to_pandas()` is long format with those identity columns on every row, so
the results of many runs concatenate into one frame (`pd.concat`) and compare in one page
(`compare_page`). `driftlab report` writes `results.json` and `results.csv` for any run;
`driftlab.Run.results` returns the same in memory.

The numbers are those each protocol's report prints (this module converts, it never
recomputes a statistic differently); a protocol from another package summarises itself with a
`summarize(run_dir) -> Results` classmethod, or gets only its identity and record counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from driftlab.errors import DriftlabError
from driftlab.protocol.registry import protocol_of
from driftlab.records.rundir import RunDir, jsonable

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
IDENTITY = ["protocol", "model", "revision", "dtype", "steer", "seed", "run"]
NAN = float("nan")


@dataclass(frozen=True)
class Estimate:
    """One number of a run's results, with what it rests on."""

    metric: str  # "stability", "drift", "accuracy", "drop", "gain", "pi", a PASTA metric, ...
    value: float
    n: int  # conversations, questions, examples or dialogs behind it
    low: float = NAN
    high: float = NAN
    interval: str = ""  # how [low, high] was made ("t", "wilson", "bca", "newcombe", ...)
    test: str = ""  # for a difference: its paired test
    p: float = NAN
    p_holm: float = NAN
    group: dict[str, Any] = field(default_factory=dict)  # what it is about: condition, round, point, ...


@dataclass(frozen=True)
class Results:
    """A run's results: its identity and its estimates (see the module docstring)."""

    protocol: str
    identity: dict[str, Any]
    estimates: tuple[Estimate, ...]
    complete: bool

    def to_pandas(self) -> pd.DataFrame:
        """Long format: one row per estimate, the run's identity on every row, group keys as columns."""
        rows = [{**self.identity, **e.group, **{k: v for k, v in asdict(e).items() if k != "group"}}
                for e in self.estimates]
        groups = list(dict.fromkeys(k for e in self.estimates for k in e.group))
        columns = [*IDENTITY, "metric", *groups, "value", "n", "low", "high", "interval", "test", "p", "p_holm"]
        return pd.DataFrame(rows, columns=columns)

    def to_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "identity": self.identity, "complete": self.complete,
                "estimates": [jsonable(asdict(e)) for e in self.estimates]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Results:
        return cls(data["protocol"], data["identity"],
                   tuple(Estimate(**{k: NAN if v is None and k in ("value", "low", "high", "p", "p_holm") else v
                                     for k, v in e.items()}) for e in data["estimates"]), bool(data["complete"]))

    def write(self, run_dir: str | Path) -> list[Path]:
        """results.json and results.csv in the run directory."""
        run_dir = Path(run_dir)
        (run_dir / RESULTS_JSON).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
        self.to_pandas().to_csv(run_dir / RESULTS_CSV, index=False)
        return [run_dir / RESULTS_JSON, run_dir / RESULTS_CSV]


def summarize(run_dir: str | Path) -> Results:
    """The `Results` of any run directory, by the protocol its manifest names."""
    rd = RunDir(run_dir)
    if not rd.path.is_dir():
        raise DriftlabError(f"{rd.path} does not exist.", hint="Give the --out directory of a driftlab run.")
    manifest = rd.read_manifest()
    name = manifest.get("protocol", "selfchat")
    convert = _CONVERTERS.get(name)
    if convert is None:
        own = getattr(protocol_of(manifest), "summarize", None)
        if callable(own):
            return own(rd.path)
        convert = _counts
    return Results(name, identity(rd.path, manifest), tuple(convert(rd.path)), bool(manifest.get("completed")))


def identity(run_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What makes runs comparable: the columns every row of `to_pandas` carries."""
    from driftlab.protocol.runner import config_of

    config = config_of(manifest)
    backend = config.get("backend") or (config.get("mmlu") or {}).get("backend") or {}
    agent = (manifest.get("models") or {}).get("agent") or {}
    steer = config.get("steer")
    return {"protocol": manifest.get("protocol", "selfchat"), "model": backend.get("model", agent.get("name")),
            "revision": ((agent.get("hub") or {}).get("sha") or (agent.get("preset") or {}).get("gguf_sha256")),
            "dtype": agent.get("dtype", backend.get("dtype")),
            "steer": ";".join(steer) if isinstance(steer, list) else steer, "seed": config.get("seed"),
            "run": str(run_dir)}


# -- one converter per built-in protocol --------------------------------------------------------
def _frame(df: pd.DataFrame | None, metric: str | Callable[[Any], str], value: str, groups: Iterable[str], *,
           low: str = "ci_low", high: str = "ci_high", interval: str = "ci_method", test: str | None = None,
           p: str | None = None, p_holm: str | None = None, n: str = "n") -> list[Estimate]:
    """Estimates from a summary DataFrame's rows (the columns named)."""
    out = []
    for row in ([] if df is None else df.to_dict("records")):
        out.append(Estimate(metric if isinstance(metric, str) else metric(row), _num(row.get(value)),
                            int(row.get(n) or 0), _num(row.get(low)), _num(row.get(high)),
                            str(row.get(interval) or ""), str(row.get(test) or "") if test else "",
                            _num(row.get(p)) if p else NAN, _num(row.get(p_holm)) if p_holm else NAN,
                            {g: row[g] for g in groups if g in row}))
    return out


def _selfchat(run_dir: Path) -> list[Estimate]:
    from driftlab.report.metrics import summarize_run

    s = summarize_run(run_dir)
    keys = ["condition", "target", "category"]
    return [*_frame(s.overall, "stability", "mean", keys),
            *_frame(s.per_round, "stability", "mean", [*keys, "round"]),
            *_frame(s.drift, "drift", "diff", ["condition", "target", "first", "last"], low="diff_ci_low",
                    high="diff_ci_high", test="method", p="p", p_holm="p_holm"),
            *_frame(s.comparisons, "difference", "diff", ["condition", "versus", "target"], low="diff_ci_low",
                    high="diff_ci_high", test="method", p="p", p_holm="p_holm"),
            *_frame(s.judge, "judge_agreement", "agree", ["target"], low="agree_low", high="agree_high",
                    interval="agree_method")]


def _mmlu(run_dir: Path) -> list[Estimate]:
    from driftlab.protocol.mmlu import summarize as mmlu_summary

    s = mmlu_summary(run_dir)
    out = [Estimate("accuracy", s[c]["accuracy"], s[c]["n"], *s[c]["ci"], s[c]["ci_method"], group={"condition": c})
           for c in ("plain", "steered") if c in s]
    if "drop" in s:
        d = s["drop"]
        out.append(Estimate("drop", d["mean"], d["n"], *d["ci"], d["ci_method"], d["method"], d["p"],
                            group={"condition": "steered", "versus": "plain"}))
    return out


def _sweep(run_dir: Path) -> list[Estimate]:
    from driftlab.report.sweep import sweep_table

    table = sweep_table(run_dir)
    keys = ["method", "spec"]
    c = "mmlu" if "mmlu_drop" in table.columns else "bench"  # a sweep priced by an lm-eval task: bench_* (its drop)
    steered = table[table.method != "plain"]  # each point against plain: plain has no difference of its own
    return [*_frame(table, "stability", "stability", keys, low="stability_ci_low", high="stability_ci_high",
                    interval="stability_ci_method", n="n_conversations"),
            *_frame(steered[steered.gain_n.notna()], "gain", "stability_gain", keys, low="stability_gain_ci_low",
                    high="stability_gain_ci_high", interval="gain_ci_method", test="gain_method", p="gain_p",
                    p_holm="gain_p_holm", n="gain_n"),
            *_frame(steered[steered[f"{c}_drop"].notna()], f"{c}_drop", f"{c}_drop", keys, low=f"{c}_drop_ci_low",
                    high=f"{c}_drop_ci_high", interval=f"{c}_ci_method", test=f"{c}_method", p=f"{c}_p",
                    p_holm=f"{c}_p_holm", n=f"{c}_n")]


def _calibrate(run_dir: Path) -> list[Estimate]:
    from driftlab.protocol.calibrate import summary

    return [Estimate("mmlu_drop", p["drop"], p.get("n") or 0, *p["ci"], p.get("ci_method") or "",
                     p.get("method") or "", _num(p.get("p")), group={"steer": p["steer"], "strength": p["strength"],
                                                                      "within": p["within"]})
            for p in summary(run_dir)["points"]]


def _pasta_eval(run_dir: Path) -> list[Estimate]:
    from driftlab.pasta.evaluate import RECORDS, metric_intervals

    found = metric_intervals(RunDir(run_dir).records(RECORDS), lambda r: r.baseline)
    return [Estimate(metric, iv.estimate, iv.n, iv.low, iv.high, iv.method, group={"baseline": baseline})
            for baseline, metrics in found.items() for metric, iv in metrics.items()]


def _pasta_tune(run_dir: Path) -> list[Estimate]:
    from driftlab.pasta.evaluate import metric_intervals
    from driftlab.pasta.tune import RECORDS

    found = metric_intervals(RunDir(run_dir).records(RECORDS), lambda r: r.topk)
    return [Estimate(metric, iv.estimate, iv.n, iv.low, iv.high, iv.method, group={"topk": topk})
            for topk, metrics in found.items() for metric, iv in metrics.items()]


def _decay(run_dir: Path) -> list[Estimate]:
    """Mean pi per round over every layer and head, one value per dialog (the interval's unit)."""
    from driftlab.protocol.decay import traces
    from driftlab.stats import mean_interval

    out = []
    for model, trace in traces(run_dir).items():
        per_token = trace.pi.mean(axis=(1, 2))
        for r in sorted(set(trace.round.tolist())):
            dialogs = sorted(set(trace.dialog[trace.round == r].tolist()))
            values = [float(per_token[(trace.round == r) & (trace.dialog == d)].mean()) for d in dialogs]
            iv = mean_interval(values)
            out.append(Estimate("pi", iv.estimate, iv.n, iv.low, iv.high, iv.method,
                                group={"traced_model": model, "round": r}))
    return out


def _counts(run_dir: Path) -> list[Estimate]:
    """For a protocol with no summary of its own: how many records of each kind it holds."""
    kinds: dict[str, int] = {}
    for r in RunDir(run_dir).records():
        kind = str(r.get("kind", "record")) if isinstance(r, dict) else "record"
        kinds[kind] = kinds.get(kind, 0) + 1
    return [Estimate("records", float(n), n, group={"kind": k}) for k, n in kinds.items()]


def _replay(run_dir: Path) -> list[Estimate]:
    from driftlab.report.replay import compliance_frame, drift, per_round

    frame = compliance_frame(run_dir)
    out = _frame(per_round(frame), "compliance", "mean", ["round"])
    d = drift(frame)
    if d is not None:
        out.append(Estimate("drift", d["diff"], d["n"], d["diff_ci_low"], d["diff_ci_high"], d["ci_method"],
                            d["method"], d["p"], group={"first": d["first"], "last": d["last"]}))
    steered = frame["steered"].dropna()
    if len(steered):  # under when-drifting: the share of agent turns the gate steered
        out.append(Estimate("steered", float(steered.mean()), len(steered)))
    return out


_CONVERTERS: dict[str, Callable[[Path], list[Estimate]]] = {
    "replay": _replay, "selfchat": _selfchat, "mmlu": _mmlu, "sweep": _sweep, "calibrate": _calibrate, "decay": _decay,
    "pasta-eval": _pasta_eval, "pasta-tune": _pasta_tune, "pasta-profile": _counts,
}


def _num(v: Any) -> float:
    try:
        return float(v) if v is not None else NAN
    except (TypeError, ValueError):
        return NAN
