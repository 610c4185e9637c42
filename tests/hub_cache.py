"""A Hugging Face hub cache built by hand, for offline tests of Hub ids.

Why by hand: tests never reach the hub, but must meet the cache exactly as huggingface_hub
writes it (`models--org--name/{blobs,refs,snapshots}`, snapshot files linking to blobs named
by their hash, `refs/<branch>` holding a commit sha), so that `snapshot_download(...,
local_files_only=True)`, `scan_cache_dir` and driftlab's resolution are exercised for real.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tiny_models import make_tiny_model

REPO = "tiny-org/tiny-chat"
SHA_MAIN = "1" * 40  # refs/main
SHA_V2 = "2" * 40  # refs/v2 (a tag): other weights (another seed)


def repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(cache: Path, repo_id: str, sha: str, source: Path, refs: tuple[str, ...] = ()) -> Path:
    """Store `source`'s files as commit `sha` of `repo_id` (blobs + symlinked snapshot), point `refs` at it."""
    repo = repo_dir(cache, repo_id)
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        set_ref(cache, repo_id, ref, sha)
    return snapshot


def set_ref(cache: Path, repo_id: str, ref: str, sha: str) -> None:
    path = repo_dir(cache, repo_id) / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sha)


def build_cache(root: Path) -> Path:
    """A hub cache under `root`/hub holding REPO at two commits (main, v2) and a non-causal model."""
    cache = root / "hub"
    cache.mkdir(parents=True)
    add_snapshot(cache, REPO, SHA_MAIN, make_tiny_model("qwen2", root / "src-main", seed=0), refs=("main",))
    add_snapshot(cache, REPO, SHA_V2, make_tiny_model("qwen2", root / "src-v2", seed=1), refs=("v2",))
    encoder = root / "src-encoder"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    (encoder / "model.safetensors").write_bytes(b"not read")
    add_snapshot(cache, "tiny-org/an-encoder", "3" * 40, encoder, refs=("main",))
    return cache


def hub_env(root: Path, **extra: str) -> dict[str, str]:
    """Environment variables that point huggingface_hub (and driftlab) at `root`'s cache, offline."""
    return {"HF_HOME": str(root), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", **extra}
