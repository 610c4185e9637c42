"""`make_backend(spec)`: the one place that turns a model name into a backend.

Protocols and commands never construct a backend class themselves: a local Hugging Face
model, any OpenAI-compatible server (`openai:MODEL`) and a Ray pool of local models all
plug in here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.chat.base import ChatBackend

SpanMode = Literal["prefix", "content"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
REMOTE_PREFIX = "openai:"


def _model_name(v: str) -> str:
    if v.startswith(REMOTE_PREFIX) and not v[len(REMOTE_PREFIX) :].strip():
        raise ValueError("'openai:' needs the served model's name, e.g. openai:Qwen/Qwen2.5-7B-Instruct")
    return v


# A preset, a local HF model directory, or openai:NAME for a model behind an OpenAI-compatible server.
ModelName = Annotated[str, Field(min_length=1), AfterValidator(_model_name)]


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

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http(s) URL, e.g. http://127.0.0.1:8000/v1")
        return v.rstrip("/") if v else v


class BackendSpec(BaseModel):
    """Which model to run and how (recorded in manifests)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelName = Field(DEFAULT_MODEL, description="preset, local HF model directory or openai:NAME")
    dtype: Dtype = "auto"
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    span: SpanMode = Field("content", description="which tokens are the system prompt: its text or its whole turn")
    runtime: Runtime = Runtime()

    @property
    def remote(self) -> bool:
        return self.model.startswith(REMOTE_PREFIX)

    @field_validator("device")
    @classmethod
    def _usable_device(cls, v: str) -> str:
        # Checked when the spec is made, before any model is looked up, pulled or loaded.
        from driftlab.chat.loading import pick_device

        pick_device(v)
        return v


def make_backend(
    spec: BackendSpec, *, prefix_cache_bytes: int = 2 << 30, run_dir: str | Path | None = None
) -> ChatBackend:
    """Load or connect to the backend a spec names.

    `openai:MODEL` is a model behind an OpenAI-compatible server; with `runtime.ray` the
    local model runs in a pool of Ray actors; otherwise it is loaded here. `run_dir` is
    the locked run directory of the caller: a remote backend logs every request there, so
    a resumed run never sends a finished request again.
    """
    if spec.remote:
        if spec.runtime.ray:
            from driftlab.errors import DriftlabError

            raise DriftlabError("--ray shards local models; a remote openai: model needs no Ray.",
                                hint="Drop --ray, and raise --concurrency instead.")
        from driftlab.chat.openai import OpenAIChatBackend

        return OpenAIChatBackend(spec.model[len(REMOTE_PREFIX) :], spec.runtime, log_dir=run_dir)
    if spec.runtime.ray:
        from driftlab.chat.ray_pool import RayBackend

        return RayBackend(spec, prefix_cache_bytes=prefix_cache_bytes)
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(spec.model, dtype=spec.dtype, device=spec.device, span_mode=spec.span,
                         prefix_cache_bytes=prefix_cache_bytes)
