"""`driftlab personas ...`: browse the benchmark's system prompts and score replies."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path

import typer

app = typer.Typer(help="The benchmark's 100 system prompts, probes and measures.", no_args_is_help=True)

FileOption = typer.Option(
    None, "--file", "-f", help="Also load user personas from this .jsonl or .toml file.", dir_okay=False
)


class Format(str, Enum):
    table = "table"
    json = "json"


@app.command("list")
def list_personas(
    category: str | None = typer.Option(
        None,
        "--category",
        "-c",
        help="Only this category: multiple_choice, persona, pattern, memorization, language.",
    ),
    fmt: Format = typer.Option(Format.table, "--format", help="table (for people) or json (for programs)."),
    file: Path | None = FileOption,
) -> None:
    """List personas: id, category, system prompt and probe (JSON adds the measure and its params)."""
    from driftlab.bench import load_personas

    personas = load_personas(category=category, extra=file)
    if fmt is Format.json:
        typer.echo(json.dumps([p.model_dump() for p in personas], ensure_ascii=False, indent=2))
        return

    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # One line per field, clipped to the terminal (the full text is in --format json); ids
    # are never clipped, since `score` needs them.
    console = Console()
    id_width = max((len(p.id) for p in personas), default=2)
    room = max(20, console.width - id_width - 6)
    table = Table(title=f"{len(personas)} personas", box=box.SIMPLE_HEAD)
    table.add_column("id / category", no_wrap=True, min_width=id_width)
    table.add_column("system prompt / probe", no_wrap=True)
    for p in personas:
        table.add_row(
            f"[bold]{escape(p.id)}[/]\n[dim]{escape(p.category)}[/]",
            f"{escape(_clip(p.system_prompt, room))}\n[dim]{escape(_clip(p.probe, room))}[/]",
        )
    console.print(table)


@app.command("score")
def score(
    persona_id: str = typer.Argument(..., metavar="ID", help="Persona id, e.g. reply-in-french."),
    text: str = typer.Argument(..., help="The reply to score; '-' reads it from standard input."),
    file: Path | None = FileOption,
) -> None:
    """Score a reply to the persona's probe: prints a number in [0, 1] (higher = better followed)."""
    from driftlab.bench import get_persona

    persona = get_persona(persona_id, extra=file)
    reply = _read_stdin() if text == "-" else text
    typer.echo(f"{persona.score(reply):.4f}")


@app.command("measures")
def measures() -> None:
    """List the measure ids and their parameters (for user persona files)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from driftlab.bench.judge import JUDGE, JudgeParams
    from driftlab.bench.measures import MEASURES, measure_params, plugin_measures

    plugins = set(plugin_measures())
    table = Table(title=f"{len(MEASURES)} measures and the judge", show_lines=True)
    table.add_column("measure", no_wrap=True, style="bold")
    table.add_column("parameters")
    table.add_column("what it scores", overflow="fold")
    for name, fn in sorted(MEASURES.items()):
        params = "\n".join(f"{k}: {v}" for k, v in measure_params(name).items()) or "-"
        summary = (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        table.add_row(name + (" (plugin)" if name in plugins else ""), escape(params), escape(summary))
    judge = "\n".join(f"{k}: {f.description}" for k, f in JudgeParams.model_fields.items())
    table.add_row(JUDGE, escape(judge), "rated 0-10 by a judge model against the rubric (score = rating / 10), "
                  "greedy, its verdicts cached in the run directory; e.g. judge:model=qwen2.5-coder-1.5b,rubric=...")
    Console().print(table)


def _read_stdin() -> str:
    binary = getattr(sys.stdin, "buffer", None)
    if binary is None:  # a text-only stream (already decoded)
        return sys.stdin.read()
    data = binary.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        from driftlab.errors import DriftlabError

        raise DriftlabError(
            f"standard input is not UTF-8 text (invalid byte at offset {err.start})",
            hint="convert the reply to UTF-8 first, e.g. `iconv -t UTF-8`",
        ) from None


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
