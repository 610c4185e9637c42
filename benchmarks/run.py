"""Run one benchmark: `python benchmarks/run.py NAME [--quick]`.

Each benchmark is a module `benchmarks/<name>.py` with `run(quick: bool) -> Result`: a
table (title, columns, rows) printed for people, then `RESULT key=value` lines for
programs. Ratios are measured within one run, on one machine, so they compare like with
like; absolute numbers depend on the machine and are printed for context only.
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
    parser.add_argument("--quick", action="store_true", help="smaller settings, for a smoke test")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(args.name, HERE / f"{args.name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[dim]{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, cuda={torch.cuda.is_available()}[/]"
    )
    from driftlab.errors import DriftlabError

    try:
        result = module.run(quick=args.quick)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
