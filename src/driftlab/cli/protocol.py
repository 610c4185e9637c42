"""`driftlab protocol list|run`: every protocol by name, plugins' included, run from a config file.

The commands of driftlab's own protocols (`driftlab run`, `mmlu`, `sweep`, ...) give each
option a flag; a protocol another package declares (entry point `driftlab.protocols`) has
none, so this command runs any registered protocol from its config written as a JSON or TOML
file (the fields of its config class, as a manifest's `config` records them). `driftlab
report` then reads the run directory like any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from driftlab.errors import DriftlabError

app = typer.Typer(help="Protocols by name (driftlab's and plugins'): list them, run one from a config file.",
                  no_args_is_help=True)


@app.command("list")
def list_protocols() -> None:
    """List every protocol with its config fields (plugins' marked)."""
    from rich.console import Console
    from rich.table import Table

    from driftlab.protocol.registry import MODULES, all_protocols

    table = Table(title="protocols", show_lines=True)
    for col in ("protocol", "from", "config fields"):
        table.add_column(col, overflow="fold")
    for name, cls in sorted(all_protocols().items()):
        origin = "driftlab" if cls.__module__ in MODULES else f"plugin ({cls.__module__})"
        fields = ", ".join(cls.config_type().model_fields)
        table.add_row(name, origin, fields)
    Console().print(table)


def read_config(path: Path) -> dict[str, Any]:
    """A config file's fields: JSON, or TOML by its suffix; a one-line error for a bad file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise DriftlabError(f"Cannot read --config {path}: {err.strerror or err}.",
                            hint="Give a JSON or TOML file of the protocol's config fields.") from None
    try:
        if path.suffix.lower() == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as err:
        raise DriftlabError(f"--config {path} is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: "
                            f"{err}.", hint="JSON by default; a .toml file is read as TOML.") from None
    if not isinstance(data, dict):
        raise DriftlabError(f"--config {path} holds a {type(data).__name__}, not an object of config fields.",
                            hint='e.g. {"backend": {"model": "smollm2-135m"}, "n": 4}')
    return data


@app.command("run")
def run(
    name: Annotated[str, typer.Argument(help="The protocol's name (`driftlab protocol list`).")],
    config: Annotated[Path, typer.Option("--config", "-c", help="Its config: a JSON or TOML file of fields.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created, or resumed if it exists).")],
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Run (or resume) any registered protocol from a config file; `driftlab report OUT` reads it."""
    from pydantic import ValidationError

    from driftlab.api.runs import execute
    from driftlab.protocol.registry import protocol_class

    cls = protocol_class(name)
    schema = cls.config_type()
    try:
        cfg = schema.model_validate(read_config(config))
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"]) or "config"
        raise DriftlabError(f"--config {config}: {where}: {e['msg'].removeprefix('Value error, ')}.",
                            hint=f"{name}'s config fields: {', '.join(schema.model_fields)}.") from None
    rundir = execute(cls(cfg), out, progress=progress)
    from driftlab.cli.finish import say_results
    say_results(rundir.path)
    typer.echo(f"records: {rundir.records_path}")
