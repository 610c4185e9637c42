"""What a run's manifest says about a local Hugging Face model: which weights, how loaded.

Why apart from the backend: it reads the backend's fields and the asset store (presets, Hub snapshot
ids), not its decoding; a resumed run compares these facts (`protocol.runner`) to refuse other weights.
"""

from __future__ import annotations

from typing import Any


def describe_hf(backend: Any) -> dict[str, Any]:
    """`HFChatBackend.describe()`: name, path, architecture, dtype, device, spans, context, preset,
    directions, Hub snapshot, device map and quantization; a model handed over in memory says so."""
    if backend._attachment is not None:
        return _describe_memory(backend)
    from driftlab.assets.hub import snapshot_info

    meta: dict[str, Any] = {
        "name": backend.name, "backend": "hf", "path": str(backend.path), "architecture": type(backend.model).__name__,
        "dtype": str(backend.model.dtype).replace("torch.", ""), "device": str(backend.device),
        "span_mode": backend.renderer.span_mode, "max_context": backend.shape.max_context,
    }
    if preset := preset_of(backend.name):
        meta["preset"] = preset
    if backend.directions is not None:
        meta["directions"] = backend.directions.describe()
    hub = snapshot_info(backend.path)
    if hub:  # which weights exactly: a resumed run refuses others (protocol.runner)
        meta["hub"] = {**hub, "requested": backend.name}
    return {**meta, **_placement(backend, backend.model)}


def _describe_memory(backend: Any) -> dict[str, Any]:
    """describe() of a model from `from_model`: where it came from is the caller's object, so the
    manifest says so (`source`), with its name_or_path and adapters, and no preset."""
    from driftlab.chat.attach import adapters

    base = backend._attachment.base
    meta: dict[str, Any] = {
        "name": backend.name, "backend": "hf", "source": "memory",
        "name_or_path": getattr(base, "name_or_path", "") or None,
        "architecture": type(base).__name__, "wrapper": type(backend.model).__name__ if backend.model is not base else None,
        "dtype": str(base.dtype).replace("torch.", ""), "device": str(backend.device),
        "span_mode": backend.renderer.span_mode, "max_context": backend.shape.max_context,
        "peft": adapters(backend.model),
    }
    if backend.path is not None:
        from driftlab.assets.hub import snapshot_info

        hub = snapshot_info(backend.path)
        if hub:
            meta["hub"] = hub
    return {**meta, **_placement(backend, base)}


def _placement(backend: Any, model: Any) -> dict[str, Any]:
    """The device map and quantization, where the model was loaded with them."""
    meta: dict[str, Any] = {}
    if backend.device_map:
        meta["device_map"] = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    if backend.quantize:
        meta["quantize"] = backend.quantize
    return meta


def preset_of(name: str) -> dict[str, Any] | None:
    """The pull marker of a preset model name (None for a path, a Hub id or a model not pulled)."""
    from driftlab.assets import pulled_info

    return pulled_info(name) if "/" not in name and "@" not in name else None
