"""`driftlab decay`: pi(t) across a dialog (seed 000 Fig. 4) and base-vs-chat (Fig. 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.cli.options import DeviceOpt, DtypeOpt, ModelOpt, SpanOpt, build

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


def _shape(model: str) -> tuple[int, int]:
    """(layers, heads) of a model from its config.json, without loading weights."""
    import json

    from driftlab.assets import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text["num_hidden_layers"]), int(text["num_attention_heads"])


def _make_out(out: Path) -> None:
    from driftlab.errors import DriftlabError

    if out.exists() and not out.is_dir():
        raise DriftlabError(f"--out {out} is a file.", hint="Give a directory for the trace and figures.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise DriftlabError(f"Cannot write to --out {out}: {err.strerror or err}.",
                            hint="Choose a directory you can write to.") from None


def decay(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for decay.npz/json and the figures.")],
    model: ModelOpt = "smollm2-135m",
    rounds: Annotated[int, typer.Option(help="Rounds of the fresh self-chat.")] = 6,
    pairs: Annotated[int, typer.Option(help="Dialogs (persona pairs) to trace.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per turn of the fresh self-chat.")] = 64,
    from_run: Annotated[
        Path | None, typer.Option(help="Replay the dialogs of a saved run instead of a fresh self-chat.")
    ] = None,
    compare: Annotated[
        list[str] | None, typer.Option(help="Also trace the same dialogs on this model (Fig. 8), repeatable.")
    ] = None,
    layer: Annotated[int | None, typer.Option(help="Layer of the single-head panel (default: steepest).")] = None,
    head: Annotated[int | None, typer.Option(help="Head of the single-head panel (default: steepest).")] = None,
    span: SpanOpt = "content",
    seed: Annotated[int, typer.Option(help="Seed of the fresh self-chat.")] = 0,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
) -> None:
    """Trace pi(t), the attention mass on the system prompt, per layer and head, across a dialog."""
    from rich.console import Console
    from rich.table import Table

    from driftlab.chat import BackendSpec, Sampling, make_backend
    from driftlab.errors import DriftlabError
    from driftlab.protocol.decay import dialogs_from_run, fresh_dialogs, trace_dialogs
    from driftlab.protocol.selfchat import SelfChatConfig
    from driftlab.report.decay_figures import compare_figure, drop_heatmap, figure4, round_profile

    console = Console(stderr=True)
    # Cheap checks first: nothing is loaded, traced or written with a bad option.
    spec = build(BackendSpec, model=model, dtype=dtype, device=device, span=span)
    sampling = build(Sampling, max_new_tokens=max_new_tokens)
    build(SelfChatConfig, rounds=rounds, pairs=pairs, seed=seed, sampling=sampling)
    if (layer is None) != (head is None):
        raise DriftlabError("Give both --layer and --head, or neither.")
    if pairs < 1:
        raise DriftlabError(f"Invalid --pairs {pairs}: trace at least 1 dialog.")
    shapes = {m: _shape(m) for m in [model, *(compare or [])]}
    if layer is not None:
        n_layers, n_heads = shapes[model]
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise DriftlabError(
                f"--layer {layer} --head {head} is outside {model} ({n_layers} layers x {n_heads} heads).",
                hint=f"Layers are 0..{n_layers - 1}, heads 0..{n_heads - 1}.",
            )
    dialogs = dialogs_from_run(from_run, max_dialogs=pairs) if from_run is not None else None
    _make_out(out)

    backend = make_backend(spec)
    if dialogs is None:
        dialogs = fresh_dialogs(backend, pairs, rounds, max_new_tokens, seed, out)
    with console.status(f"tracing {len(dialogs)} dialog(s) on {model}"):
        trace = trace_dialogs(backend, dialogs)
    trace.save(out)
    if layer is None:
        layer, head = trace.steepest_head()
    files = [figure4(trace, layer, head, out / "decay_fig4.png"),
             round_profile(trace, layer, head, out / "decay_rounds.png"),
             drop_heatmap(trace, out / "decay_heatmap.png")]
    traces = {model: trace}
    notes = [n for n in [sliding_note(model, backend)] if n]
    for other in compare or []:
        del backend
        backend = make_backend(spec.model_copy(update={"model": other}))
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
