"""`driftlab decay`: pi(t) across a dialog (persona-drift paper Fig. 4) and base-vs-chat (Fig. 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from driftlab.chat.spec import BackendSpec
from driftlab.cli.options import backend_options, build


def _shape(model: str) -> tuple[int, int]:
    """(layers, heads) of a model from its config.json, without loading weights."""
    import json

    from driftlab.assets import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    text = config.get("text_config", config)
    return int(text["num_hidden_layers"]), int(text["num_attention_heads"])


@backend_options()
def decay(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory: decay.npz/json, the figures, the traces.")],
    backend: BackendSpec,
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
    seed: Annotated[int, typer.Option(help="Seed of the fresh self-chat.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Dialogs replayed together in one forward pass.")] = 4,
) -> None:
    """Trace pi(t), the attention mass on the system prompt, per layer and head, across a dialog.

    Re-running the same command on the same --out resumes: traced dialogs are kept.
    """
    from rich.console import Console
    from rich.table import Table

    from driftlab.api.runs import execute
    from driftlab.errors import DriftlabError
    from driftlab.protocol.decay import Decay, DecayConfig

    console = Console(stderr=True)
    # Cheap checks first: nothing is loaded, traced or written with a bad option.
    config = build(DecayConfig, backend=backend, compare=compare or [], from_run=str(from_run) if from_run else None,
                   pairs=pairs, rounds=rounds, max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size)
    if (layer is None) != (head is None):
        raise DriftlabError("Give both --layer and --head, or neither.")
    if layer is not None:
        n_layers, n_heads = _shape(backend.model)
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise DriftlabError(
                f"--layer {layer} --head {head} is outside {backend.model} ({n_layers} layers x {n_heads} heads).",
                hint=f"Layers are 0..{n_layers - 1}, heads 0..{n_heads - 1}.",
            )
    for other in config.compare:
        _shape(other)  # a compare model that is not there fails before anything runs

    rundir = execute(Decay(config), out)
    from driftlab.report.decay_figures import write_decay_figures  # matplotlib: only once the run is done
    drawn = write_decay_figures(rundir.path, layer, head)
    from driftlab.cli.finish import say_results
    say_results(rundir.path)

    table = Table(title="mean pi (attention on the system prompt) per round")
    table.add_column("model")
    means = {name: t.round_means() for name, t in drawn.traces.items()}
    n_rounds = max(m.shape[0] for m in means.values())
    for r in range(1, n_rounds + 1):
        table.add_column(f"round {r}", justify="right")
    for name, m in means.items():
        table.add_row(name, *[f"{m[i].mean():.3f}" for i in range(m.shape[0])])
    console.print(table)
    console.print(f"single-head panel: layer {drawn.layer}, head {drawn.head}")
    for note in drawn.notes:
        console.print(f"[yellow]note:[/] {note}")
    for f in drawn.files:
        typer.echo(str(f))
