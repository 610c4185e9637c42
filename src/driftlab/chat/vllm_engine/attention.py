"""driftlab's attention inside vLLM: its CPU backend, with steered rows recomputed by driftlab's engine.

Registered over `CPU_ATTN` by the worker (`worker.DriftlabWorker`), before the model is built, so
every attention layer gets it. A pass without steered rows is vLLM's kernel alone. With some, the
kernel still runs on the whole batch (it returns outputs only: no log-sum-exp, no key bias), then
each group of steered rows (`step.AttentionGroup`) gets its keys and values from the paged cache in
the transformers engine's left-padded layout and `attention.engine.driftlab_attention` recomputes
their outputs with key biases, split-softmax and the pi floor, and records pi: the same function,
on the same layout, as the transformers engine. Only the gather is vLLM-specific: a GPU backend
would need its own (or FlashAttention's partial attentions and log-sum-exps, merged as
`attention.kernels.merge` merges the system-only and all-keys calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from driftlab.chat.vllm_engine.install import load_vllm

load_vllm()  # the guard first: this module may be the first of a process to import vLLM

from vllm.model_executor.models.utils import extract_layer_index  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl  # noqa: E402

from driftlab.attention.engine import driftlab_attention  # noqa: E402
from driftlab.chat.vllm_engine import step  # noqa: E402


@dataclass(frozen=True)
class _Layer:
    """What the engine function reads of the module it serves: which layer, and not training."""

    layer_idx: int
    training: bool = False


class DriftlabCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        engine = step.ENGINE
        plan = engine.plan() if engine is not None and attn_metadata is not None else None
        if plan is None or not plan.groups:
            return out
        engine.check_layout(layer, key, value, kv_cache, attn_metadata)
        module = self._driftlab_layer = getattr(self, "_driftlab_layer", None) or _Layer(extract_layer_index(layer.layer_name))
        index = module.layer_idx
        for group in plan.groups:
            if not group.state.acts_on(index):
                continue
            if group.reads_only:  # pi alone: every layer's at once, after the last (AttentionGroup.stash)
                group.stash(index, query, kv_cache, self.scale)
                continue
            if group.reweights:  # split-softmax, the pi floor: the kernel's output reweighted
                group.reweight(index, query, kv_cache, output, self.scale)
                continue
            keys, values = group.gather(kv_cache)
            queries = query[group.queries].transpose(1, 2)  # [B, H, q, d]
            steered, _ = driftlab_attention(module, queries, keys, values, group.mask, self.scale, driftlab=group.state)
            if group.decode:
                output[group.queries[:, 0]] = steered[:, 0].to(output.dtype)
            else:  # [B, q, H, d], of which the real queries go back
                output[group.queries[group.real]] = steered[group.real].to(output.dtype)
        return out


class DriftlabCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[DriftlabCPUAttentionImpl]:
        return DriftlabCPUAttentionImpl
