"""Which model to run and where: `BackendSpec` (recorded in every manifest) and its `Runtime`.

Plain data, no backend code: protocol configs nest a `BackendSpec`, and `make_backend`
(driftlab.chat.factory) turns one into a backend.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from driftlab.assets.hub import parse_hub_id
from driftlab.assets.registry import DEFAULT_MODEL, PRESETS
from driftlab.errors import DriftlabError

SpanMode = Literal["prefix", "content"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
REMOTE_PREFIX = "openai:"
VLLM_PREFIX = "vllm:"  # a model run in vLLM's engine in this process (chat.vllm_backend)
#: Steer kinds vLLM's engine cannot apply, and why (refused in one line, by configs and the backend).
VLLM_REFUSED = {
    "cfg": "cfg mixes each step's next-token distribution with a twin row's (the conversation without its "
           "system prompt), and vLLM samples every request on its own",
}
# A model the user built or loaded in Python and handed over (`driftlab.from_model`): manifests
# record it as memory:NAME; only that object can run it, so it cannot be loaded by name.
MEMORY_PREFIX = "memory:"
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _model_name(v: str) -> str:
    if v.startswith(MEMORY_PREFIX):
        if not v[len(MEMORY_PREFIX) :].strip():
            raise ValueError("'memory:' needs a name for the model, e.g. memory:my-finetune")
        return v
    if v.startswith(REMOTE_PREFIX):
        if not v[len(REMOTE_PREFIX) :].strip():
            raise ValueError("'openai:' needs the served model's name, e.g. openai:Qwen/Qwen2.5-7B-Instruct")
        return v
    local = v[len(VLLM_PREFIX):] if v.startswith(VLLM_PREFIX) else v
    if not local.strip():
        raise ValueError("'vllm:' needs a model: a preset, a local directory or a Hub id, e.g. vllm:smollm2-135m")
    # A malformed Hub id is refused here, by string rules alone (no torch, no hub), unless a
    # directory of that name exists: a local directory comes before a Hub id.
    if local not in PRESETS and not Path(local).expanduser().exists():
        try:
            parse_hub_id(local)
        except DriftlabError as err:
            raise ValueError(err.message.rstrip(".")) from None  # the CLI's error line adds its own
    return v


# A preset, a local HF model directory, a Hub id org/name[@revision], or openai:NAME for a model
# behind an OpenAI-compatible server (resolution order: driftlab.assets.resolve); vllm: before any
# local one runs it in vLLM's engine.
ModelName = Annotated[str, Field(min_length=1), AfterValidator(_model_name)]
Quantize = Literal["8bit", "4bit"]
# How a local model decodes (driftlab.chat.static_decode): auto = dynamic until the GPU benchmark decides.
DecodeMode = Literal["auto", "dynamic", "static", "compiled"]
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _device_map(v: str | None) -> str | None:
    """accelerate's strategies by name, or a JSON object {module: device}; checked without torch."""
    if v is None or v in DEVICE_MAPS:
        return v
    try:
        mapping = json.loads(v)
    except ValueError:
        raise ValueError(f"use {', '.join(DEVICE_MAPS)} or a JSON object such as "
                         '\'{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "": 0}\'') from None
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError("a JSON device map is an object {module name: device}")
    for module, device in mapping.items():
        ok = (isinstance(device, int) and not isinstance(device, bool) and device >= 0) or (
            isinstance(device, str) and (device in ("cpu", "disk", "mps") or _DEVICE.fullmatch(device)))
        if not ok or device == "auto":
            raise ValueError(f"device {device!r} of module {module!r} is not a GPU index, 'cuda:N', 'cpu' or 'disk'")
    return v


class Runtime(BaseModel):
    """Where the model runs and how it is reached: a server, a Ray cluster, concurrency.

    None of it changes what a run measures, so a run may resume under another runtime
    (e.g. on a cluster after starting on a laptop); manifests record it for reference.
    The API key itself is never stored: only the name of the variable that holds it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str | None = Field(None, description="OpenAI-compatible server (default: $OPENAI_BASE_URL or OpenAI)")
    api_key_env: str = Field("OPENAI_API_KEY", min_length=1, description="variable holding the API key")
    concurrency: int = Field(8, ge=1, le=1024, description="requests in flight at once (remote backends)")
    timeout: float = Field(300.0, gt=0, le=3600, allow_inf_nan=False, description="seconds per request")
    max_retries: int = Field(5, ge=0, le=50, description="retries on 429, 5xx and connection errors")
    ray: str | None = Field(None, min_length=1, description="Ray cluster address ('local' starts one here)")
    actors: int | None = Field(None, ge=1, le=4096, description="Ray actors (default: one per GPU, else 2)")
    # vLLM's engine (vllm: models)
    tensor_parallel: int = Field(1, ge=1, le=64, description="vllm: GPUs one model is split over (tensor parallelism)")
    memory_fraction: float | None = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False,
        description="vllm: share of the GPU's memory (a CPU host's) the engine takes (default: vLLM's 0.92 on a GPU, "
                    "a 2 GiB KV cache on a CPU)")
    max_model_len: int | None = Field(None, ge=16, le=1 << 24, description="vllm: longest context (default: the model's)")
    prefix_caching: bool = Field(True, description="vllm: reuse the KV cache of shared prompt prefixes")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http(s) URL, e.g. http://127.0.0.1:8000/v1")
        return v.rstrip("/") if v else v


def directions_there(folder: Path) -> bool:
    """Whether `folder` holds a `driftlab directions` output (its manifest and its tensors)."""
    return (folder / "directions.json").is_file() and (folder / "directions.safetensors").is_file()


class BackendSpec(BaseModel):
    """Which model to run and how (recorded in manifests)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelName = Field(
        DEFAULT_MODEL, description="preset, local HF model directory, Hub id org/name[@rev] or openai:NAME; "
                                   "vllm:MODEL runs a local one in vLLM's engine")
    dtype: Dtype = "auto"
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    span: SpanMode = Field("content", description="which tokens are the system prompt: its text or its whole turn")
    device_map: Annotated[str | None, AfterValidator(_device_map)] = Field(
        None, description="spread the model over devices (accelerate): auto, balanced, sequential or JSON")
    quantize: Quantize | None = Field(None, description="load the weights in 8 or 4 bits (bitsandbytes, CUDA)")
    decode: DecodeMode = Field(
        "auto", description="decode loop: dynamic cache, static cache, or static cache + torch.compile (CUDA graphs)")
    directions: str | None = Field(
        None, description="persona directions (a `driftlab directions` output directory): record each reply's "
                          "projection onto its persona's direction; vector and cap steers use them")
    runtime: Runtime = Runtime()

    @property
    def remote(self) -> bool:
        return self.model.startswith(REMOTE_PREFIX)

    @property
    def vllm(self) -> bool:
        return self.model.startswith(VLLM_PREFIX)

    @field_validator("directions")
    @classmethod
    def _directions_there(cls, v: str | None) -> str | None:
        """A directions path that holds none is refused before any model loads. `memory:` names
        directions a live backend holds (`use_directions` of a computed `Directions`)."""
        if v is None or v.startswith(MEMORY_PREFIX):
            return v
        folder = Path(v) if Path(v).is_dir() else Path(v).parent
        if not directions_there(folder):
            raise ValueError(f"no directions at {v} (directions.json and directions.safetensors are expected there; "
                             "make them with `driftlab directions`)")
        return str(folder)

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v: str) -> str:
        # A name driftlab can run on passes here without importing torch (every command builds a
        # spec before its cheap checks); whether this machine has that device is checked when the
        # model loads, before it is looked up or pulled. Any other name gets torch's verdict now.
        if not _DEVICE.fullmatch(v.strip().lower()):
            from driftlab.chat.loading import pick_device

            pick_device(v)
        return v
