"""Run one benchmark: `python benchmarks/run.py NAME [--quick | --full]`.

Each benchmark is a module `benchmarks/<name>.py` with `run(quick: bool, full: bool) -> Result`:
a table (title, columns, rows) printed for people, then `RESULT key=value` lines for
programs. Ratios are measured within one run, on one machine, so they compare like with
like; absolute numbers depend on the machine and are printed for context only.

Sizes: by default every benchmark finishes in under 5 minutes on this project's 2-core CPU
while other jobs share it (each module's docstring says what it runs and what that took);
`--full` runs the long sizes (tens of minutes for some); `--quick` is a smoke test of the
benchmark itself, too small for its figures to mean much. On a CPU, torch runs on 1 thread
unless BENCH_THREADS says otherwise (see `common.pin_threads`).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in {"run", "common"} and not p.stem.startswith("_"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=available(), help="benchmark to run")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smallest settings: a smoke test of the benchmark")
    size.add_argument("--full", action="store_true", help="the long sizes (can take tens of minutes on a CPU)")
    size.add_argument("--paper", action="store_true",
                      help="gpu only: the persona-drift paper's experiment at full scale (minutes per mode on an H100)")
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="also write everything printed to FILE, after a header of the command, date, commit, "
                             "machine and versions (docs/results/bench/ holds the committed ones)")
    args = parser.parse_args()
    if args.paper and args.name != "gpu":
        parser.error("--paper is a size of the gpu benchmark only")
    sys.path.insert(0, str(HERE))
    from common import unwritable

    if args.record is not None and (why := unwritable(args.record)):  # a bad path fails now, not after the run
        parser.error(f"--record {args.record} {why}")

    spec = importlib.util.spec_from_file_location(args.name, HERE / f"{args.name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    import torch
    from common import pin_threads
    from rich.console import Console
    from rich.table import Table

    from driftlab.errors import DriftlabError

    console = Console(record=args.record is not None)
    try:
        threads, default = pin_threads()
    except DriftlabError as err:
        console.print(f"Error: {err}", markup=False)
        return 2
    console.print(
        f"[dim]{platform.processor() or platform.machine()}, {threads} torch threads (process default {default}), "
        f"torch {torch.__version__}, cuda={torch.cuda.is_available()}, size "
        f"{'quick' if args.quick else 'full' if args.full else 'paper' if args.paper else 'default'}[/]"
    )

    try:
        result = module.run(quick=args.quick, full=args.full, **({"paper": True} if args.paper else {}))
    except DriftlabError as err:  # bad settings (a model name, an env var): one line, not a traceback
        console.print(f"Error: {err}", markup=False)  # and its "Hint:" line
        return 2
    for part in [result, *getattr(result, "tables", [])]:
        table = Table(title=part.title)
        for col in part.columns:
            table.add_column(col)
        for row in part.rows:
            table.add_row(*[str(x) for x in row])
        console.print(table)
    for note in result.notes:
        console.print(f"[dim]{note}[/]")
    for key, value in result.results.items():
        print(f"RESULT {key}={value}")
    if args.record is not None:
        write_record(args.record, console.export_text(), result.results)
    return 0


def write_record(path: Path, printed: str, results: dict[str, str]) -> None:
    """The run as a reader re-derives a sentence from it: the command and where it ran, then the
    tables and notes as printed, then the RESULT lines."""
    import datetime
    import os
    import subprocess

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=HERE).stdout.strip()
    commit = f"{commit.strip()} (with uncommitted changes)" if commit.strip() and dirty else commit
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    header = [f"command: python benchmarks/run.py {' '.join(sys.argv[1:])}",
              f"date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
              f"commit: {commit.strip() or 'unknown'}",
              f"machine: {os.cpu_count()} cores, {cpu}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, cuda={torch.cuda.is_available()}",
              "n: one run", ""]
    path.write_text("\n".join(header) + printed + "".join(f"RESULT {k}={v}\n" for k, v in results.items()))


if __name__ == "__main__":
    raise SystemExit(main())
