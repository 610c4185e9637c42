"""`driftlab warn --from-run RUN`: which measure warns before an agent turn fails."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def warn(
    from_run: Annotated[list[Path], typer.Option(
        "--from-run", help="A run that scores every agent turn (`driftlab replay`); more: its `kl`, `project` or "
                           "`decay` runs, whose measures join it (repeatable; the replay first).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Where warn.json, warn.csv and warn.png go "
                                                                 "(default: RUN/warn).")] = None,
    fail_below: Annotated[float, typer.Option(min=0.0, max=1.0, help="A turn fails with a score below this "
                                                                    "(0 to 1: scores live there).")] = 0.5,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the bootstrap and of the two folds of dialogs.")] = 0,
) -> None:
    """Is each measure a warning? AUROC for 'the next agent turn fails', pooled and within dialogs, against
    the turn index, tokens so far and the last turn's compliance, with lead times (docs/replay.md)."""
    from driftlab.errors import DriftlabError
    from driftlab.records.rundir import RunDir
    from driftlab.report.warn import table, unmeasured, write_warn

    for path in from_run:
        if not (path / "manifest.json").is_file():
            raise DriftlabError(f"--from-run {path} is not a run directory.", hint="Give the --out of `driftlab replay`.")
    first = RunDir(from_run[0]).read_manifest()
    if first.get("protocol") != "replay":
        raise DriftlabError(f"--from-run {from_run[0]} is a {first.get('protocol', 'selfchat')} run; a warning needs "
                            "every agent turn scored.", hint="Run `driftlab replay` first and give its --out here.")
    found, where, gate = write_warn(list(from_run), out or from_run[0] / "warn", fail_below, seed)
    from driftlab.cli.finish import print_text_table

    print_text_table(table(found, fail_below))
    for label, how in unmeasured(found):  # a measure these runs lack: how to read it afterwards
        typer.echo(f"not measured here: {label}: {how}", err=True)
    if gate is not None:  # a warning a gate can act on: the steer that does
        then = "to `driftlab replay`" if gate.endswith("by=score") else "price it with `driftlab sweep`"
        typer.echo(f"gate: --steer {gate}  (add the steer it gates; {then})")
    typer.echo(str(where / "warn.json"))
