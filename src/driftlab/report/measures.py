"""The distribution-space measures of a `driftlab kl` run, as tables: the reminded KL and the prompt's
influence per round, each a mean over conversations with its interval."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from driftlab.protocol.kl import KL
from driftlab.records.rundir import RunDir
from driftlab.report.tables import TextTable, fmt_cell
from driftlab.stats import mean_interval


def kl_frame(run_dir: str | Path) -> pd.DataFrame:
    """One row per agent turn or probe reply: pair, round, what, reminded, prompt, positions."""
    records = RunDir(run_dir).records(KL.records)
    return pd.DataFrame([r.model_dump() for r in records],
                        columns=["kind", "pair", "round", "what", "reminded", "prompt", "positions"])


def kl_round_table(run_dir: str | Path) -> TextTable:
    """Per round: the mean reminded KL and prompt influence of agent turns, over conversations."""
    frame = kl_frame(run_dir)
    turns = frame[frame.what == "turn"]
    rows = []
    for rnd in sorted(turns["round"].unique()):
        at = turns[turns["round"] == rnd]
        cells = [mean_interval(at[name].astype(float)) for name in ("reminded", "prompt")]
        rows.append([str(rnd), *(fmt_cell(*c.as_tuple()) + f" (n={c.n})" for c in cells)])
    return TextTable("drift in next-token distributions, per round (agent turns)",
                     ["round", "reminded KL", "prompt influence"], rows,
                     "Means over conversations with their 95% intervals, in nats per reply token. Reminded KL: "
                     "KL(dialog as it was || system prompt restated before the turn). Prompt influence: KL(dialog "
                     "as it was || system prompt emptied); 0 is the no-persona baseline.")
