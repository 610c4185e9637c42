"""A run directory: the unit a user keeps, shares and re-reports.

    DIR/manifest.json   protocol, full config, the plan (e.g. sampled persona pairs), input
                        hashes, versions, resume guarantee
    DIR/records.jsonl   append-only: one JSON object per unit of work (a turn, a probe, ...)
    DIR/.lock, .owner   held by the one process writing the run

Generic: every protocol (self-chat, MMLU, sweeps, PASTA, decay) writes the same layout and
brings its own record schema; `driftlab.protocol.runner.run_protocol` is its one writer.

Safety rules:
* one writer: `RunDir.writing()` takes an exclusive file lock (filelock) before anything
  expensive; a second writer gets "in use by PID ..." at once;
* readers never modify: a torn last line (a writer killed mid-write) is ignored by
  readers and cut off only by the next writer, under the lock;
* records are appended after each batch, flushed and fsynced, so `kill -9` loses at most
  the batch in flight; a resumed run skips every record that exists.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, TypeAdapter, ValidationError

from driftlab.errors import DriftlabError

MANIFEST = "manifest.json"
RECORDS = "records.jsonl"
LOCK = ".lock"
OWNER = ".owner"
FORMAT = 3  # manifest format; 2 = flat model settings in the config, plans by reference (readable, not resumable)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("driftlab", "torch", "transformers", "langdetect", "vaderSentiment", "wordfreq", "textblob"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


# One FileLock object per directory and process: filelock is re-entrant per object, and
# two objects on one file would block each other inside the same process.
_LOCKS: dict[Path, Any] = {}


class RunDir:
    """Manifest + append-only JSONL records of one run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest_path = self.path / MANIFEST
        self.records_path = self.path / RECORDS
        self._writing = 0

    # -- manifest ------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def read_manifest(self) -> dict[str, Any]:
        if self.path.exists() and not self.path.is_dir():
            raise DriftlabError(f"{self.path} is a file, not a run directory.", hint="Give a directory for --out.")
        if not self.exists():
            raise DriftlabError(
                f"{self.path} is not a driftlab run directory (no {MANIFEST}).",
                hint="Point at the --out directory of a `driftlab run`.",
            )
        try:
            manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DriftlabError(f"{self.manifest_path} is not valid JSON: {err}.",
                                hint="Restore it from a copy, or start the run again in a new directory.") from err
        if not isinstance(manifest, dict) or "config" not in manifest or not isinstance(manifest["config"], dict):
            raise DriftlabError(
                f"{self.manifest_path} is not a driftlab manifest (no 'config' object).",
                hint="Restore it from a copy, or start the run again in a new directory.",
            )
        return manifest

    def start(
        self,
        config: dict[str, Any],
        plan: dict[str, Any],
        ignore: Iterable[str] = (),
        *,
        protocol: str,
        legacy: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write the manifest of a new run, or check it against an existing one; return it.

        Every config field except those in `ignore` (e.g. device, batch size) must match
        for a resume to continue the same experiment; nested settings are compared one by
        one under dotted names (`backend.dtype`), and an ignored name covers what is under
        it (`backend.runtime`). A resumed run keeps its recorded plan: the caller continues
        from the returned manifest, not from current data.

        `legacy` maps a (dotted) setting added after runs existed to the value a recorded config
        that lacks it meant (an older run asked MMLU at a round, not a paper turn): such a run
        compares as that value, so a new default never silently changes what a resume means.
        """
        self._require_writer()
        if self.exists():
            old = self.read_manifest()
            if old.get("driftlab_run") != FORMAT:
                raise DriftlabError(
                    f"{self.path} was written by an older driftlab (manifest format {old.get('driftlab_run')}); "
                    "it can be reported but not resumed.",
                    hint="Start the run again in a new --out directory.",
                )
            if old.get("protocol", "selfchat") != protocol:
                raise DriftlabError(f"{self.path} holds a '{old.get('protocol', 'selfchat')}' run, not a '{protocol}' run.",
                                    hint="Choose a new --out directory.")
            # A key the old config lacks is an option added by a newer driftlab: the run predates
            # it, and its recorded plan (pairs, starters, personas) decides how it continues.
            before, now = _flat(old["config"]), _flat(config)
            added = {k: v for k, v in (legacy or {}).items() if k not in before}
            before.update(added)
            keys = [k for k in dict.fromkeys([*before, *now])
                    if k in before and not any(k == i or k.startswith(i + ".") for i in ignore)]
            diffs = [f"{k}: {before.get(k)!r}{' (recorded before the option existed)' if k in added else ''} -> "
                     f"{now.get(k)!r}" for k in keys if before.get(k) != now.get(k)]
            if diffs:
                raise DriftlabError(
                    f"{self.path} holds a run with a different configuration ({'; '.join(diffs)}).",
                    hint="Re-run with the original options to resume it, or choose a new --out directory.",
                )
            return old
        manifest = {
            "driftlab_run": FORMAT,
            "protocol": protocol,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config,
            "versions": versions(),
            **plan,
        }
        self._write_manifest(manifest)
        return manifest

    def update_manifest(self, **fields: Any) -> None:
        self._require_writer()
        self._write_manifest({**self.read_manifest(), **fields})

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        """Atomically: a reader never sees a half-written manifest."""
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, self.manifest_path)

    # -- the writer's lock ------------------------------------------------------------------------
    @contextmanager
    def writing(self) -> Iterator[RunDir]:
        """Hold the run's exclusive lock; re-entrant within a process.

        Creates the directory if needed. If the block fails before a manifest exists, the
        directory is left as it was (removed again if this call created it), so a bad
        option leaves nothing behind that blocks the corrected retry.
        """
        from filelock import FileLock, Timeout

        if self.path.exists() and not self.path.is_dir():
            raise DriftlabError(f"--out {self.path} is a file.", hint="Give a directory (new, or a run to resume).")
        created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            key = self.path.resolve()
            lock = _LOCKS.setdefault(key, FileLock(str(self.path / LOCK)))
            lock.acquire(timeout=0)
        except Timeout:
            raise DriftlabError(
                f"{self.path} is in use by another driftlab process ({self._owner()}).",
                hint="Wait for it to finish (it resumes nothing twice), or choose another --out directory.",
            ) from None
        except OSError as err:
            if created:
                shutil.rmtree(self.path, ignore_errors=True)
            raise DriftlabError(
                f"Cannot write the run directory {self.path}: {err.strerror or err}.",
                hint="Choose an --out directory you can write to.",
            ) from None
        self._writing += 1
        try:
            if lock.lock_counter == 1:
                (self.path / OWNER).write_text(
                    json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}), encoding="utf-8")
                self._repair_tail()
            yield self
        except BaseException:
            if created and lock.lock_counter == 1 and not self.exists():
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        finally:
            self._writing -= 1
            if lock.lock_counter == 1 and self.path.exists():
                (self.path / OWNER).unlink(missing_ok=True)
            lock.release()

    def _owner(self) -> str:
        try:
            owner = json.loads((self.path / OWNER).read_text(encoding="utf-8"))
            return f"PID {owner['pid']} on {owner['host']}, since {owner['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "owner unknown"

    def _require_writer(self) -> None:
        if not self._writing:
            raise RuntimeError("write to a RunDir only inside `with rundir.writing():`")

    def _repair_tail(self) -> None:
        """Cut a torn last line (a writer killed mid-write); only the lock holder may."""
        if not self.records_path.is_file():
            return
        raw = self.records_path.read_bytes()
        good = raw.rfind(b"\n") + 1
        if good < len(raw):
            with self.records_path.open("r+b") as fh:
                fh.truncate(good)

    # -- records -------------------------------------------------------------------------------
    def append(self, records: list[Any]) -> None:
        """Append records (dicts or pydantic models) durably: one write, flush, fsync."""
        self._require_writer()
        if not records:
            return
        rows = [r.model_dump(mode="json") if isinstance(r, BaseModel) else r for r in records]
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        with self.records_path.open("a", encoding="utf-8") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def records(self, schema: TypeAdapter | None = None) -> list[Any]:
        """Every complete record, in file order; read-only (a torn last line is skipped).

        With `schema` (a protocol's record type) each record is validated and returned as
        that type; a bad line is an error naming its line number.
        """
        if not self.records_path.is_file():
            return []
        raw = self.records_path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]  # a torn tail stays on disk for the writer to cut
        out: list[Any] = []
        for n, line in enumerate(complete.splitlines(), start=1):
            try:
                rec = json.loads(line.decode("utf-8"))
                if not isinstance(rec, dict):
                    raise ValueError(f"a JSON {type(rec).__name__}, not an object")
                out.append(schema.validate_python(rec) if schema is not None else rec)
            except (ValueError, ValidationError) as err:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
                raise DriftlabError(
                    f"{self.records_path} line {n} is not a valid record: {_one_line(err)}.",
                    hint=f"Remove line {n} (the run resumes by recomputing it), or start a new --out directory.",
                ) from None
        return out


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested settings compared (and named) one by one."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _one_line(err: Exception) -> str:
    if isinstance(err, ValidationError):
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        return f"{where}: {e['msg']}" if where else e["msg"]
    return str(err).split("\n")[0][:200]


def jsonable(x: object) -> object:
    """NaN and inf -> null, numpy scalars -> Python: for strict JSON."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
