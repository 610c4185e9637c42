"""Running a protocol to completion, the one way every verb and command does it.

`execute(protocol, out)` is `run_protocol` (lock, plan, resume, progress, records) followed by
the run's results.json and results.csv (the one results contract, `driftlab.report.results`).
The completion step sits here, above report, because protocols never import the statistics
that summarise them; `dl.selfchat/mmlu/sweep/calibrate/run` and every CLI command that runs a
protocol go through it, so every completed run directory reads the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from driftlab.errors import DriftlabError

if TYPE_CHECKING:
    from driftlab.protocol.runner import Protocol
    from driftlab.records.rundir import RunDir
    from driftlab.report.results import Results


def execute(protocol: Protocol, out: str | Path, *, progress: bool = True) -> RunDir:
    """Run (or resume) `protocol` into `out`; once complete, write its results.json/csv."""
    from driftlab.protocol.runner import run_protocol

    rundir = run_protocol(protocol, out, progress=progress)
    write_results(rundir.path)
    return rundir


def write_results(run_dir: str | Path) -> Path | None:
    """results.json / results.csv of a run; None (said in one line on stderr) where its summary
    cannot be made (an incomplete run may lack what it needs; its own report says more)."""
    from driftlab.report.results import RESULTS_CSV, RESULTS_JSON, summarize

    try:
        return summarize(run_dir).write(run_dir)[0]
    except (DriftlabError, OSError, KeyError, ValueError) as err:
        for name in (RESULTS_JSON, RESULTS_CSV):  # an earlier completion's would now be stale
            (Path(run_dir) / name).unlink(missing_ok=True)
        from driftlab.console import err_console

        note = f"note: no results.json for {run_dir} ({type(err).__name__}: {err})".splitlines()[0]
        err_console().print(note, highlight=False, markup=False)
        return None


def read_results(run_dir: str | Path) -> Results:
    """The Results `execute` wrote (read back, not summarised again: a sweep's takes a while), or
    the summary itself where none was written (its error is then the one to see)."""
    import json

    from driftlab.report.results import RESULTS_JSON, Results, summarize

    path = Path(run_dir) / RESULTS_JSON
    return Results.from_dict(json.loads(path.read_text())) if path.exists() else summarize(run_dir)


@dataclass
class Run:
    """A finished run: its manifest, records and summary, in memory.

    `summary` is what the protocol's report is drawn from: a `RunSummary` for a self-chat
    (`.overall`, `.per_round`, `.comparisons`), a dict for MMLU (accuracy per condition, the drop
    with its paired test), a DataFrame for a sweep (one row per point), the calibration's findings
    (`best`, `points`, `note`) for a calibration. `path` is the run directory, or None when it was a
    temporary one. `results` is the same run in the one shape every protocol shares (`Results`:
    estimates with n, interval and test; `.to_pandas()` concatenates across runs), what results.json
    holds.
    """

    protocol: str
    path: Path | None
    manifest: dict[str, Any]
    records: list[dict[str, Any]]
    summary: Any
    results: Results

    def to_pandas(self):
        """The records as a DataFrame, with the run's protocol, model, revision, dtype, steer and
        run_seed as columns, so the frames of several runs concatenate (`seed`, where records have
        one, is each generation's own)."""
        import pandas as pd

        config = self.manifest.get("config") or {}
        agent = (self.manifest.get("models") or {}).get("agent") or {}
        steer = config.get("steer") or []
        columns = {"protocol": self.protocol, "model": (config.get("backend") or {}).get("model"),
                   "revision": (agent.get("hub") or {}).get("sha"), "dtype": agent.get("dtype"),
                   "steer": ",".join(steer) if isinstance(steer, list) else steer, "run_seed": config.get("seed")}
        return pd.DataFrame(self.records).assign(**columns)

    def __repr__(self) -> str:
        where = self.path or "in memory"
        return f"Run({self.protocol}, {len(self.records)} records, {where})"
