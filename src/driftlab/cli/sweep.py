"""`driftlab sweep`: stability vs MMLU (or lm-eval task) cost for each mitigation over a grid of strengths (Fig. 5/6)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import (
    HistoriesOpt,
    MaxNewTokensOpt,
    MMLUDataOpt,
    ProbeAfterOpt,
    ProbeTokensOpt,
    TiesOpt,
    TurnCountingOpt,
    backend_options,
)

DEFAULT_METHODS = "split-softmax,spr,cfg,instaboost"


@backend_options(remote=True, ray=True)
def sweep(
    out: Annotated[Path, typer.Option("--out", "-o", help="Sweep directory (created, or resumed if it exists).")],
    backend: BackendSpec,
    methods: Annotated[str | None, typer.Option(help=f"Comma-separated methods with their default grids (default: "
                                                     f"{DEFAULT_METHODS}; without spr for --benchmark lm-eval:TASK).")] = None,
    point: Annotated[list[str] | None, typer.Option(
        "--point", help="A grid point as a --steer spec (repeatable); replaces the default grids; more points than a sweep recorded are added to it.")] = None,
    pairs: Annotated[int, typer.Option(help="Use the first N of the 20 ordered pairs of the 5 sweep personas.")] = 20,
    personas: Annotated[str, typer.Option(
        help="The 5 sweep personas: 'table2' (the first of each category in driftlab's data) or 'reference' "
             "(index 0 of each category, as the reference code likenneth/persona_drift does).")] = "table2",
    probe_after: ProbeAfterOpt = "agent",
    rounds: Annotated[int, typer.Option(help="Dialog rounds per self-chat (paper: 8 rounds, i.e. 16 turns).")] = 8,
    max_new_tokens: MaxNewTokensOpt = 400,
    probe_tokens: ProbeTokensOpt = "400",
    starters: Annotated[str, typer.Option(
        help="Conversation starters a_1: 'reference' (the reference code's 45 topics) or 'driftlab'.")] = "reference",
    mmlu_n: Annotated[int, typer.Option(help="MMLU questions per point.")] = 100,
    mmlu_turn: Annotated[int, typer.Option(
        help="Ask MMLU at this turn of the point's dialog (paper: 4), counted as --mmlu-turn-counting says.")] = 4,
    mmlu_turn_counting: TurnCountingOpt = "paper",
    mmlu_history: Annotated[str, typer.Option(
        help="The dialog before the MMLU question: 'dialog' (the point's own self-chat, its first pair) or "
             "'selfchat' (a separate probe-free self-chat; sweeps recorded before this option).")] = "dialog",
    histories: HistoriesOpt = 1,
    ties: TiesOpt = "random",
    match_drop: Annotated[float | None, typer.Option(
        help="Fig. 6 compares methods at this MMLU drop (default: the median drop of the grid).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of dialogs, samples and questions.")] = 0,
    data: MMLUDataOpt = None,
    batch_size: Annotated[int, typer.Option(help="Most conversations generated together in one batch.")] = 32,
    benchmark: Annotated[str, typer.Option(
        help="What prices each point: 'mmlu' (MMLU at --mmlu-turn of the point's dialog) or 'lm-eval:TASK', an "
             "lm-evaluation-harness task (a registered name, or one from --benchmark-include) run on the local "
             "model under the point's steer, with an agent persona's system prompt; needs `pip install lm-eval`, "
             "and offline the task's dataset in the Hugging Face cache.")] = "mmlu",
    benchmark_include: Annotated[Path | None, typer.Option(
        help="A folder of lm-eval task YAMLs (lm-eval's --include_path) that --benchmark lm-eval:TASK may name.")] = None,
    benchmark_n: Annotated[int | None, typer.Option(
        help="Items of the lm-eval task per point, a seeded sample (default 100; all where the task has fewer).")] = None,
    when_drifting: Annotated[float | None, typer.Option(
        help="Adaptive control: every steered point acts only once a conversation has drifted, where its pi has "
             "fallen below this share of its first turn's (--steer when-drifting:r=R).")] = None,
    when_drifting_by: Annotated[str, typer.Option(
        help="What --when-drifting compares with the first turn: 'pi' (attention on the system prompt) or "
             "'projection' (the persona's projection; needs --directions).")] = "pi",
    kl: Annotated[bool, typer.Option(
        "--kl", help="Also measure every agent reply's reminded KL and prompt influence as it is generated, at every "
                     "point but CFG's and when-drifting's (docs/measures.md).")] = False,
) -> None:
    """Measure persona stability and MMLU drop for every (method, strength), then plot the trade-off.

    --benchmark lm-eval:TASK prices the points by an lm-eval task instead of MMLU (columns
    bench_* instead of mmlu_*; spr, which edits the conversation, cannot be priced so and is
    left out of the default methods).

    One model load serves every point; each point's self-chat and MMLU runs are resumable
    run directories under OUT/points/. Writes sweep.csv, sweep_tradeoff.png (Fig. 5),
    sweep_rounds.png (Fig. 6) and sweep.html. Each point is tested against plain on the same
    pairs and questions (Holm over the points); the end says where n is too small and how many
    pairs and questions a stability gain of 0.1 and an MMLU drop of 0.05 would need.
    """
    options = {k: v for k, v in locals().items() if k not in ("out", "backend", "match_drop")}  # the run's options
    import pandas as pd
    from rich.console import Console

    from driftlab.api.options import FLAGS, sweep_config
    from driftlab.api.runs import execute
    from driftlab.cli.finish import say_results
    from driftlab.protocol.sweep import Sweep

    execute(Sweep(sweep_config(backend, FLAGS, options)), out)
    from driftlab.report.sweep import power_notes, write_sweep_report  # matplotlib: only once the run is done
    page = write_sweep_report(out, match_drop)
    say_results(Path(out))
    table = pd.read_csv(Path(out) / "sweep.csv")
    console = Console(stderr=True)
    cost = "mmlu" if "mmlu_drop" in table.columns else "bench"  # an lm-eval sweep's columns: bench_*
    cols = ["spec", "stability", "stability_gain", "gain_n", "gain_p", "gain_p_holm", "mmlu_accuracy", "mmlu_drop",
            "mmlu_n", "mmlu_p", "mmlu_p_holm"]
    cols = [c.replace("mmlu_", f"{cost}_") for c in cols]
    console.print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}", na_rep="-"),
                  highlight=False, markup=False)
    units = "dialog(s)" if cost == "mmlu" else f"persona(s); {table.benchmark.iloc[0]} {table.bench_metric.iloc[0]}"
    console.print(f"gain: Wilcoxon signed-rank over conversations; drop: {table[f'{cost}_method'].dropna().iloc[-1]} "
                  f"({int(table[f'{cost}_dialogs'].max())} {units}); p_holm: Holm over the sweep's points.",
                  highlight=False, markup=False)
    for row in table.itertuples():
        if isinstance(row.warning, str) and row.warning:
            console.print(f"Warning: {row.spec}: {row.warning}", highlight=False, markup=False)
    for note in power_notes(table):
        console.print(f"Power: {note}", highlight=False, markup=False)
    typer.echo(str(page))
