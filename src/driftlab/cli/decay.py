"""`driftlab decay`: pi(t) across a dialog (seed 000 Fig. 4) and base-vs-chat (Fig. 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.cli.chat import DeviceOpt, DtypeOpt, ModelOpt

CAVEAT = (
    "Caveat: the models are different families, so the contrast mixes instruction tuning with "
    "architecture and training data."
)


def sliding_note(name: str, backend) -> str | None:
    """Sliding-window layers stop seeing the system prompt once it leaves the window: say so."""
    cfg = backend.model.config.get_text_config()
    types = getattr(cfg, "layer_types", None) or []
    n = sum(t == "sliding_attention" for t in types)
    if not n:
        return None
    return (f"{name}: {n} of {len(types)} layers attend within a {cfg.sliding_window}-token window; "
            "their pi is 0 once the system prompt is further back, which lowers its mean mechanically.")


def decay(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for decay.npz/json and the figures.")],
    model: ModelOpt = "smollm2-135m",
    rounds: Annotated[int, typer.Option(min=1, help="Rounds of the fresh self-chat.")] = 6,
    pairs: Annotated[int, typer.Option(min=1, help="Dialogs (persona pairs) to trace.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per turn of the fresh self-chat.")] = 64,
    from_run: Annotated[
        Path | None, typer.Option(help="Replay the dialogs of a saved run instead of a fresh self-chat.")
    ] = None,
    compare: Annotated[
        list[str] | None, typer.Option(help="Also trace the same dialogs on this model (Fig. 8), repeatable.")
    ] = None,
    layer: Annotated[int | None, typer.Option(help="Layer of the single-head panel (default: steepest).")] = None,
    head: Annotated[int | None, typer.Option(help="Head of the single-head panel (default: steepest).")] = None,
    span: Annotated[str, typer.Option(help="System-prompt tokens: 'prefix' or 'content'.")] = "prefix",
    seed: Annotated[int, typer.Option(help="Seed of the fresh self-chat.")] = 0,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
) -> None:
    """Trace pi(t), the attention mass on the system prompt, per layer and head, across a dialog."""
    from rich.console import Console
    from rich.table import Table

    from driftlab.chat.hf import HFChatBackend
    from driftlab.errors import DriftlabError
    from driftlab.protocol.decay import dialogs_from_run, fresh_dialogs, trace_dialogs
    from driftlab.report.decay_figures import compare_figure, drop_heatmap, figure4, round_profile

    console = Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    backend = HFChatBackend(model, dtype=dtype, device=device, span_mode=span)
    if from_run is not None:
        dialogs = dialogs_from_run(from_run, max_dialogs=pairs)
    else:
        dialogs = fresh_dialogs(backend, pairs, rounds, max_new_tokens, seed, out)
    with console.status(f"tracing {len(dialogs)} dialog(s) on {model}"):
        trace = trace_dialogs(backend, dialogs)
    trace.save(out)
    if (layer is None) != (head is None):
        raise DriftlabError("Give both --layer and --head, or neither.")
    if layer is None:
        layer, head = trace.steepest_head()
    if not (0 <= layer < trace.n_layers and 0 <= head < trace.n_heads):
        raise DriftlabError(
            f"--layer {layer} --head {head} is outside {model} ({trace.n_layers} layers x {trace.n_heads} heads)."
        )
    files = [figure4(trace, layer, head, out / "decay_fig4.png"),
             round_profile(trace, layer, head, out / "decay_rounds.png"),
             drop_heatmap(trace, out / "decay_heatmap.png")]
    traces = {model: trace}
    notes = [n for n in [sliding_note(model, backend)] if n]
    for other in compare or []:
        del backend
        backend = HFChatBackend(other, dtype=dtype, device=device, span_mode=span)
        with console.status(f"tracing the same dialogs on {other}"):
            traces[other] = trace_dialogs(backend, dialogs)
        traces[other].save(out, name=f"decay_{Path(other).name}")
        notes += [n for n in [sliding_note(other, backend)] if n]
    if len(traces) > 1:
        files.append(compare_figure(traces, out / "decay_compare.png", " ".join([CAVEAT, *notes])))

    table = Table(title="mean pi (attention on the system prompt) per round")
    table.add_column("model")
    means = {name: t.round_means() for name, t in traces.items()}
    n_rounds = max(m.shape[0] for m in means.values())
    for r in range(1, n_rounds + 1):
        table.add_column(f"round {r}", justify="right")
    for name, m in means.items():
        table.add_row(name, *[f"{m[i].mean():.3f}" for i in range(m.shape[0])])
    console.print(table)
    console.print(f"single-head panel: layer {layer}, head {head}")
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    for f in files:
        typer.echo(str(f))
