"""A run directory: the unit a user keeps, shares and re-reports.

    DIR/manifest.json   full config, the sampled persona pairs, versions, seeds
    DIR/records.jsonl   append-only: one JSON object per dialog turn or probe reply

Records are appended after each batch of generations, flushed and fsynced, so a killed
run (even `kill -9`) loses at most the batch in flight. A torn last line is dropped on
load. Re-running the same command finds the manifest, checks the config is the same and
skips every record that exists: nothing is recomputed, nothing duplicated.

Record kinds (every record has `kind`, `pair`, `condition`, `round`):
    turn   speaker ("user" | "agent"), text, n_tokens, finish_reason
    probe  target ("agent" | "user"), persona, repeat, text, score, n_tokens, finish_reason
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from driftlab.errors import DriftlabError

MANIFEST = "manifest.json"
RECORDS = "records.jsonl"


def record_key(rec: dict[str, Any]) -> tuple:
    """Identity of a record: what makes two records the same piece of work."""
    if rec["kind"] == "turn":
        return ("turn", rec["pair"], rec["condition"], rec["round"], rec["speaker"])
    return ("probe", rec["pair"], rec["condition"], rec["round"], rec["target"], rec["repeat"])


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("driftlab", "torch", "transformers", "langdetect", "vaderSentiment", "wordfreq", "textblob"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


class RunDir:
    """Manifest + append-only JSONL records of one run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest_path = self.path / MANIFEST
        self.records_path = self.path / RECORDS

    # -- manifest ------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def read_manifest(self) -> dict[str, Any]:
        if not self.exists():
            raise DriftlabError(
                f"{self.path} is not a driftlab run directory (no {MANIFEST}).",
                hint="Point at the --out directory of a `driftlab run`.",
            )
        try:
            return json.loads(self.manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise DriftlabError(f"{self.manifest_path} is not valid JSON: {err}.") from err

    def start(self, config: dict[str, Any], plan: dict[str, Any], compare_keys: Iterable[str]) -> bool:
        """Write the manifest of a new run, or check it against an existing one.

        Returns True when resuming. `compare_keys` are the config fields that must match
        for a resume to continue the same experiment (seeds, model, rounds, ...).
        """
        if self.exists():
            old = self.read_manifest()
            diffs = [
                f"{k}: {old['config'].get(k)!r} -> {config.get(k)!r}"
                for k in compare_keys
                if old["config"].get(k) != config.get(k)
            ]
            if diffs:
                raise DriftlabError(
                    f"{self.path} holds a run with a different configuration ({'; '.join(diffs)}).",
                    hint="Re-run with the original options to resume it, or choose a new --out directory.",
                )
            return True
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = {
            "driftlab_run": 1,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config,
            "versions": versions(),
            **plan,
        }
        self._write_manifest(manifest)
        return False

    def update_manifest(self, **fields: Any) -> None:
        self._write_manifest({**self.read_manifest(), **fields})

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        """Atomically: a reader never sees a half-written manifest."""
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
        os.replace(tmp, self.manifest_path)

    # -- records -------------------------------------------------------------------------------
    def append(self, records: list[dict[str, Any]]) -> None:
        """Append records durably: one write, flush, fsync."""
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with self.records_path.open("a", encoding="utf-8") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def records(self) -> list[dict[str, Any]]:
        """All complete records; a torn last line (killed mid-write) is cut off the file."""
        if not self.records_path.is_file():
            return []
        raw = self.records_path.read_bytes()
        out: list[dict[str, Any]] = []
        good = 0
        for line in raw.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DriftlabError(
                    f"{self.records_path} is corrupt at byte {good}: {err}.",
                    hint="Remove the broken line (or the run directory) and run again.",
                ) from err
            good += len(line)
        if good < len(raw):
            with self.records_path.open("r+b") as fh:
                fh.truncate(good)
        return out
