"""The vLLM worker driftlab runs in (vLLM's `worker_cls`): its attention backend, its residual hooks,
and the calls the driftlab process makes (`collective_rpc`).

Why a worker class (vLLM's own extension point): it runs in whatever process holds the model, so
nothing crosses processes but method names and data; it registers driftlab's attention backend
before the model is built (`__init__`) and hooks the decoder layers right after the weights load
(`load_model`), before vLLM's warm-up compiles the forward pass. A hook added after that would be
silently missing from the compiled graph; this one is in it, as an opaque custom op
(`driftlab::vllm_residual`) whose body reads the current pass's plan at run time, so eager and
compiled mode run the same code.
"""

from __future__ import annotations

from typing import Any

import torch

from driftlab.chat.vllm_engine.install import load_vllm

load_vllm()  # the guard first: this module may be the first of a process to import vLLM

from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

from driftlab.chat.vllm_engine import step  # noqa: E402
from driftlab.errors import DriftlabError  # noqa: E402

BACKEND = "driftlab.chat.vllm_engine.attention.DriftlabCPUAttentionBackend"


@torch.library.custom_op("driftlab::vllm_residual", mutates_args=("hidden", "residual"))
def vllm_residual(hidden: torch.Tensor, residual: torch.Tensor, layer: int) -> None:
    """Decoder layer `layer`'s output (hidden, residual), steered in place and read (`step.ResidualPlan`)."""
    engine = step.ENGINE
    plan = engine.plan() if engine is not None else None
    if plan is not None and plan.residual is not None:
        plan.residual.apply(layer, hidden, residual)


@vllm_residual.register_fake
def _(hidden: torch.Tensor, residual: torch.Tensor, layer: int) -> None:
    return None


class _Hook:
    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, module, args, output):
        hidden, residual = output[0], output[1]
        torch.ops.driftlab.vllm_residual(hidden, residual, self.index)
        return output


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers, which return (hidden, residual) in vLLM's models."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise DriftlabError(f"{type(model).__name__} keeps no decoder layers at model.model.layers, where driftlab's "
                            "vLLM adapter looks.", hint="Use a Llama-, Qwen2- or Mistral-style model.")
    return list(layers)


class DriftlabWorker(CPUWorker):
    """vLLM's CPU worker, with driftlab's attention backend, residual hooks and engine state."""

    def __init__(self, *args, **kwargs) -> None:
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
        super().__init__(*args, **kwargs)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        runner = self.model_runner
        config = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        from vllm.distributed import get_tensor_model_parallel_rank

        local = config.get_num_attention_heads(parallel)  # this worker's shard of the query heads
        first = get_tensor_model_parallel_rank() * local
        engine = step.Engine(runner, config.get_num_layers(parallel), local * parallel.tensor_parallel_size,
                             config.get_hidden_size(), shard=(first, first + local))
        engine.dtype = config.dtype
        for i, layer in enumerate(decoder_layers(runner.model)):
            layer.register_forward_hook(_Hook(i))
        step.ENGINE = engine
        # After each pass the runner hands its final hidden states to its prompt log-probs (every pass, asked
        # or not): driftlab's whole distributions are read there first (`Engine.keep_logits`).
        prompt_logprobs = runner._get_prompt_logprobs_dict

        def keep_then_prompt_logprobs(hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]):
            engine.keep_logits(hidden_states, num_scheduled_tokens)
            return prompt_logprobs(hidden_states, num_scheduled_tokens)

        runner._get_prompt_logprobs_dict = keep_then_prompt_logprobs

    # -- called by the driftlab process (LLM.collective_rpc) ----------------------------------------------
    def driftlab_use_directions(self, path: str | None) -> None:
        step.ENGINE.use_directions(path)

    def driftlab_take(self, ids: list[str]) -> list[dict[str, Any] | None]:
        return step.ENGINE.take(ids)
