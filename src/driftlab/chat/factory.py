"""`make_backend(spec)`: the one place that turns a model name into a backend.

Protocols and commands never construct a backend class themselves: a local Hugging Face
model, any OpenAI-compatible server (`openai:MODEL`) and a Ray pool of local models all
plug in here.
"""

from __future__ import annotations

from pathlib import Path

from driftlab.chat.base import ChatBackend
from driftlab.chat.spec import MEMORY_PREFIX, REMOTE_PREFIX, VLLM_PREFIX, BackendSpec
from driftlab.errors import DriftlabError


def make_backend(
    spec: BackendSpec, *, prefix_cache_bytes: int | None = None, run_dir: str | Path | None = None
) -> ChatBackend:
    """Load or connect to the backend a spec names.

    `openai:MODEL` is a model behind an OpenAI-compatible server; `vllm:MODEL` a local model
    in vLLM's engine, in this process (its engine options live in `runtime`); with `runtime.ray` the
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
    if spec.vllm:
        return _vllm_backend(spec)
    engine_options = [flag for flag, value, default in (
        ("--tensor-parallel", spec.runtime.tensor_parallel, 1), ("--memory-fraction", spec.runtime.memory_fraction, None),
        ("--max-model-len", spec.runtime.max_model_len, None), ("--no-prefix-caching", spec.runtime.prefix_caching, True))
        if value != default]
    if engine_options:
        raise DriftlabError(f"{engine_options[0]} sets vLLM's engine, and {spec.model} runs on the transformers engine.",
                            hint=f"Run it in vLLM (--model {VLLM_PREFIX}{spec.model}), or drop {engine_options[0]}.")
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


def _vllm_backend(spec: BackendSpec) -> ChatBackend:
    """A vllm: model: its options checked in one line each, before vLLM is imported."""
    for flag, value in (("--device-map", spec.device_map), ("--quantize", spec.quantize), ("--ray", spec.runtime.ray)):
        if value:
            raise DriftlabError(f"{flag} places a model for the transformers engine; vLLM places {spec.model}'s itself.",
                                hint=f"Drop {flag} (vLLM's own options: --tensor-parallel, --memory-fraction).")
    if spec.decode not in ("auto", "compiled", "dynamic"):
        raise DriftlabError(f"--decode {spec.decode} picks the transformers engine's loop; vLLM runs eager or compiled.",
                            hint="Use --decode auto (eager on a CPU) or --decode compiled.")
    if spec.device not in ("auto", "cpu") and not spec.device.startswith("cuda"):
        raise DriftlabError(f"--device {spec.device}: vLLM runs on the CPU build or on CUDA GPUs.", hint="Drop --device.")
    from driftlab.chat.vllm_backend import VLLMChatBackend

    return VLLMChatBackend(spec.model[len(VLLM_PREFIX):], dtype=spec.dtype, span_mode=spec.span, decode=spec.decode,
                           directions=spec.directions, runtime=spec.runtime)
