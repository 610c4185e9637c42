"""`resolve_model`: a model name to a local Hugging Face directory, in one documented order.

1. a preset name (`smollm2-135m`): its pulled directory (the default one is pulled on demand);
2. an existing local directory (`./my-model`, `/models/x`, even one named like `org/name`);
3. a Hugging Face Hub id `org/name[@revision]`: its snapshot in the Hugging Face cache,
   downloaded first if the hub is reachable and it is not cached (`assets.hub`).

Anything else is a one-line error: a path that does not exist, a malformed Hub id, or an
unknown preset name (listing the presets). Above the cache layout (`store`), the
provisioning step (`pull`) and the Hub (`hub`), since resolving may pull or download.
"""

from __future__ import annotations

import os
from pathlib import Path

from driftlab.assets.hub import looks_like_path, parse_hub_id, resolve_hub
from driftlab.assets.registry import DEFAULT_MODEL, PRESETS, get_preset
from driftlab.assets.store import is_model_dir, model_dir, pulled_info
from driftlab.errors import DriftlabError


def resolve_model(name_or_path: str, *, auto_pull_default: bool = True, root: Path | None = None) -> Path:
    """Turn a preset name, a local directory or a Hub id into a local Hugging Face model directory.

    Only the default preset is pulled automatically: the others are large, and a silent
    gigabyte download is worse than a clear instruction.
    """
    if name_or_path in PRESETS:
        return _preset(name_or_path, auto_pull_default, root)
    path = Path(name_or_path).expanduser()
    if is_model_dir(path):
        return path
    ref = None if path.exists() else parse_hub_id(name_or_path)  # a malformed id raises here
    if ref is not None:
        return resolve_hub(ref)
    if path.exists() or looks_like_path(name_or_path) or os.sep in name_or_path:
        if path.is_dir():
            raise DriftlabError(
                f"'{name_or_path}' is a directory but not a Hugging Face model (no config.json in it).",
                hint="Point --model at a directory saved with save_pretrained (config.json, *.safetensors, "
                "tokenizer files), or use a preset name from `driftlab models list`.",
            )
        raise DriftlabError(
            f"Model directory '{name_or_path}' does not exist.",
            hint="Check the path, or use a preset name from `driftlab models list` or a Hub id (org/name).",
        )
    get_preset(name_or_path)  # raises the unknown-name error listing known presets
    raise AssertionError("unreachable")


def _preset(name_or_path: str, auto_pull_default: bool, root: Path | None) -> Path:
    if pulled_info(name_or_path, root) is None:
        if name_or_path == DEFAULT_MODEL and auto_pull_default:
            from driftlab.assets.pull import pull

            return pull(name_or_path, root=root)
        raise DriftlabError(
            f"Model '{name_or_path}' has not been pulled yet (looked in {model_dir(name_or_path, root)}).",
            hint=f"Run `driftlab models pull {name_or_path}` once; later runs load it offline.",
        )
    return model_dir(name_or_path, root)
