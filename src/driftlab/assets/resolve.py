"""`resolve_model`: a model name (preset or local directory) to a local Hugging Face directory.

Above the cache layout (`store`) and the provisioning step (`pull`), since resolving the
default preset may pull it.
"""

from __future__ import annotations

import os
from pathlib import Path

from driftlab.assets.registry import DEFAULT_MODEL, PRESETS, get_preset
from driftlab.assets.store import is_model_dir, model_dir, pulled_info
from driftlab.errors import DriftlabError


def resolve_model(name_or_path: str, *, auto_pull_default: bool = True, root: Path | None = None) -> Path:
    """Turn a preset name or a local directory into a local Hugging Face model directory.

    Only the default preset is pulled automatically: the others are large, and a silent
    gigabyte download is worse than a clear instruction.
    """
    path = Path(name_or_path).expanduser()
    if is_model_dir(path):
        return path
    if path.exists() or os.sep in name_or_path or name_or_path.startswith("."):
        if path.is_dir():
            raise DriftlabError(
                f"'{name_or_path}' is a directory but not a Hugging Face model (no config.json in it).",
                hint="Point --model at a directory saved with save_pretrained (config.json, *.safetensors, "
                "tokenizer files), or use a preset name from `driftlab models list`.",
            )
        raise DriftlabError(
            f"Model directory '{name_or_path}' does not exist.",
            hint="Check the path, or use a preset name from `driftlab models list`.",
        )
    if name_or_path not in PRESETS:
        get_preset(name_or_path)  # raises the unknown-name error listing known presets
    if pulled_info(name_or_path, root) is None:
        if name_or_path == DEFAULT_MODEL and auto_pull_default:
            from driftlab.assets.pull import pull

            return pull(name_or_path, root=root)
        raise DriftlabError(
            f"Model '{name_or_path}' has not been pulled yet (looked in {model_dir(name_or_path, root)}).",
            hint=f"Run `driftlab models pull {name_or_path}` once; later runs load it offline.",
        )
    return model_dir(name_or_path, root)
