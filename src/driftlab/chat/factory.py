"""`make_backend(spec)`: the one place that turns a model name into a backend.

Protocols and commands never construct a backend class themselves: a local Hugging Face
model, any OpenAI-compatible server (`openai:MODEL`) and a Ray pool of local models all
plug in here.
"""

from __future__ import annotations

from pathlib import Path

from driftlab.chat.base import ChatBackend
from driftlab.chat.spec import MEMORY_PREFIX, REMOTE_PREFIX, BackendSpec
from driftlab.errors import DriftlabError


def make_backend(
    spec: BackendSpec, *, prefix_cache_bytes: int = 2 << 30, run_dir: str | Path | None = None
) -> ChatBackend:
    """Load or connect to the backend a spec names.

    `openai:MODEL` is a model behind an OpenAI-compatible server; with `runtime.ray` the
    local model runs in a pool of Ray actors; otherwise it is loaded here. `run_dir` is
    the locked run directory of the caller: a remote backend logs every request there, so
    a resumed run never sends a finished request again.
    """
    if spec.model.startswith(MEMORY_PREFIX):
        raise DriftlabError(f"{spec.model} is a model that was held in memory by the Python process that ran it; "
                            "it cannot be loaded by name.",
                            hint="Pass the backend itself: driftlab.from_model(model, tokenizer), then e.g. "
                                 "driftlab.selfchat(backend, out=...) to resume.")
    if spec.directions and spec.directions.startswith(MEMORY_PREFIX):
        raise DriftlabError("The run's persona directions were held in memory by the Python process that ran it; "
                            "they cannot be loaded by name.",
                            hint="Save them (driftlab.directions(..., out=DIR)) and pass directions=DIR, or pass "
                                 "the backend that holds them.")
    if spec.remote:
        if spec.device_map or spec.quantize:
            flag = "--device-map" if spec.device_map else "--quantize"
            raise DriftlabError(f"{flag} places a local model's weights; a remote openai: model is the server's.",
                                hint=f"Drop {flag}, or give the server's own options.")
        if spec.decode != "auto":
            raise DriftlabError("--decode picks a local model's decode loop; a remote openai: model decodes on its server.",
                                hint="Drop --decode.")
        if spec.directions:
            raise DriftlabError("--directions reads a local model's residual stream; a remote openai: model shows "
                                "only text.", hint="Drop --directions, or run the model locally.")
        if spec.runtime.ray:
            raise DriftlabError("--ray shards local models; a remote openai: model needs no Ray.",
                                hint="Drop --ray, and raise --concurrency instead.")
        from driftlab.chat.openai import OpenAIChatBackend

        return OpenAIChatBackend(spec.model[len(REMOTE_PREFIX) :], spec.runtime, log_dir=run_dir)
    if spec.runtime.ray:
        from driftlab.chat.ray_pool import RayBackend

        return RayBackend(spec, prefix_cache_bytes=prefix_cache_bytes)
    from driftlab.chat.loading import pick_device

    pick_device(spec.device)  # a device this machine lacks: refused before transformers' import (seconds)
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend.from_spec(spec, prefix_cache_bytes=prefix_cache_bytes)
