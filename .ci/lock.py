#!/usr/bin/env python3
"""The locked test environments: `test-lock.txt` and `vllm-lock.txt`, pip constraints files CI installs with.

    python3 .ci/lock.py check      # are the locks current with pyproject.toml? (CI's first step)
    python3 .ci/lock.py refresh    # resolve again in new virtualenvs and rewrite the locks
    python3 .ci/lock.py refresh --lock vllm-lock.txt   # one of them
    python3 .ci/lock.py refresh --keep  # add new dependencies, every locked version kept

Two environments because vLLM 0.32 (the `vllm` extra) pins transformers below 5.20, and the main
suite runs on 5.23: `test-lock.txt` is `.[test]`, `vllm-lock.txt` is `.[vllm,test]` (CI runs the
vLLM tests there, `pytest -m vllm`).

Why a lock: `pip install -e ".[test]"` takes whatever the registries serve on the day, so a
release of any of ~150 transitive dependencies could break CI with no change here, and no one
could tell which versions a green run used (pytest 9.2 did: issue "make CI reproducible").

`refresh` installs exactly as the README says (torch==2.13.0 first, then `-e ".[test]"`) into a
throwaway virtualenv and writes `pip freeze` of it, so the lock is what pip resolves, nothing
hand-written. torch and driftlab itself are left out: torch is installed first, as the build
the machine needs (the CPU file here, a CUDA build on a GPU), and the lock constrains the rest.
The lock's header holds a digest of pyproject's dependency lists; `check` recomputes it, so a
dependency changed without a refresh fails CI with one line.

Standard library only: `check` runs before anything is installed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "test-lock.txt"
LOCKS = {"test-lock.txt": "test", "vllm-lock.txt": "vllm,test"}  # lock file -> the extras it installs
PYPROJECT = ROOT / "pyproject.toml"
TORCH = "torch==2.13.0"  # the README's first install step (the CPU build on these machines)
DIGEST_KEY = "# pyproject-dependencies-sha256: "
LEFT_OUT = {"torch", "driftlab"}  # installed by their own steps, see the module docstring


class LockError(Exception):
    """A one-line reason the lock cannot be checked or written."""


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    if not path.is_file():
        raise LockError(f"{path} is missing: pass the project's pyproject.toml (--pyproject)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise LockError(f"{path} is not valid TOML ({err}): fix it, then check again") from None


def dependency_digest(pyproject: Path) -> str:
    """sha256 of pyproject's dependencies and optional dependencies, each requirement with its
    whitespace and case normalised and the lists sorted, so only a real change alters it."""
    project = _toml(pyproject).get("project", {})

    def norm(reqs: list[str]) -> list[str]:
        return sorted(re.sub(r"\s+", "", r).lower() for r in reqs)

    data = {"dependencies": norm(project.get("dependencies", [])),
            "optional": {k: norm(v) for k, v in sorted(project.get("optional-dependencies", {}).items())},
            "requires-python": project.get("requires-python", "")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def recorded_digest(lock: Path) -> str | None:
    """The digest written in the lock's header, or None if the lock has none."""
    for line in lock.read_text().splitlines():
        if line.startswith(DIGEST_KEY):
            return line[len(DIGEST_KEY):].strip()
    return None


def check(pyproject: Path = PYPROJECT, lock: Path = LOCK) -> str | None:
    """None if the lock is current; else the one-line reason it is not."""
    refresh = f"run `python3 .ci/lock.py refresh --lock {lock.name}` and commit {lock.name}"
    if not lock.is_file():
        return f"{lock.name} is missing: {refresh}"
    recorded = recorded_digest(lock)
    if recorded is None:
        return f"{lock.name} has no '{DIGEST_KEY.strip('# :')}' line: {refresh}"
    if recorded != dependency_digest(pyproject):
        return (f"{lock.name} is stale: pyproject.toml's dependencies changed since it was resolved; "
                f"{refresh}")
    return None


def _pinned(freeze: str) -> list[str]:
    """`name==version` lines of `pip freeze`, sorted, without torch and driftlab."""
    pins = []
    for line in freeze.splitlines():
        name = re.split(r"[=<>@ ]", line.strip(), maxsplit=1)[0]
        if line and not line.startswith(("#", "-e")) and re.sub(r"[-_.]+", "-", name.lower()) not in LEFT_OUT:
            pins.append(line.strip())
    return sorted(pins, key=str.lower)


def extras_of(lock: Path) -> str:
    """The extras a lock file installs (by its name; an unknown name locks the test extra)."""
    return LOCKS.get(lock.name, "test")


def refresh(pyproject: Path = PYPROJECT, lock: Path = LOCK, keep: bool = False) -> None:
    """Resolve the lock's extras in a new virtualenv (the README's install) and write the lock.

    `keep`: resolve under the lock as it is (pip's `-c`), so a dependency added to pyproject comes in
    and no locked version moves (a refresh without it takes what the registries serve on the day)."""
    digest = dependency_digest(pyproject)  # a missing or broken pyproject fails before any install
    extras = extras_of(lock)
    with tempfile.TemporaryDirectory(prefix="driftlab-lock-") as tmp:
        py = str(Path(tmp) / "bin" / "python")
        subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
        kept = ["-c", str(lock)] if keep else []
        for args in (["install", TORCH], ["install", "-e", f"{pyproject.parent}[{extras}]", *kept]):
            print(f"pip {' '.join(args)}", file=sys.stderr, flush=True)
            if subprocess.run([py, "-m", "pip", "-q", *args]).returncode:
                raise LockError(f"`pip {' '.join(args)}` failed (its output is above); the lock is unchanged")
        freeze = subprocess.run([py, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                                capture_output=True, text=True).stdout
        pip_version = subprocess.run([py, "-m", "pip", "--version"], check=True, capture_output=True,
                                     text=True).stdout.split()[1]
    pins = _pinned(freeze)
    header = [
        f"# A test environment CI installs (.ci/run): what `pip install -e \".[{extras}]\"` resolved to",
        f"# after `pip install {TORCH}`, in a new virtualenv on {datetime.date.today().isoformat()}:",
        f"# Python {platform.python_version()}, {platform.system()} {platform.machine()}, pip {pip_version}.",
        "# torch and driftlab are not pinned here (each has its own install step).",
        f"# Use:     pip install -e \".[{extras}]\" -c {lock.name}",
        f"# Refresh: python3 .ci/lock.py refresh --lock {lock.name}   (after any change to pyproject.toml's dependencies)",
        f"{DIGEST_KEY}{digest}",
    ]
    lock.write_text("\n".join(header + pins) + "\n")
    print(f"wrote {lock} ({len(pins)} packages)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "refresh"])
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    parser.add_argument("--lock", type=Path, default=None, help="one lock file (default: every lock)")
    parser.add_argument("--keep", action="store_true", help="refresh: keep every locked version, add what is new")
    args = parser.parse_args(argv)
    locks = [args.lock] if args.lock is not None else [args.pyproject.parent / name for name in LOCKS]
    try:
        if args.command == "refresh":
            for lock in locks:
                refresh(args.pyproject, lock, keep=args.keep)
            return 0
        reasons = [reason for lock in locks if (reason := check(args.pyproject, lock))]
    except LockError as err:
        reasons = [str(err)]
    if reasons:
        print(f"error: {reasons[0]}", file=sys.stderr)
        return 1
    print(f"{', '.join(lock.name for lock in locks)} {'is' if len(locks) == 1 else 'are'} current with "
          f"{args.pyproject.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
