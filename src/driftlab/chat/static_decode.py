"""Static-cache decoding for `HFChatBackend`: the pieces a CUDA-graph-ready decode step needs.

Why: the dynamic-cache loop pays Python per layer and per token (a 7B batch-1 step costs
26-29 ms on an H100 whose weight-bandwidth floor is 4.5 ms; transformers' own static cache +
torch.compile does 9.8 ms). A decode step becomes capturable when every tensor it reads
keeps its shape and address from step to step: transformers' `StaticCache` (sized to the
prompt plus the new tokens, rounded up to a bucket so that few lengths compile) and the
attention state laid out statically (`AttentionState.static_layout`). The step then runs
through `torch.compile` (`mode="reduce-overhead"` on CUDA: CUDA graphs; inductor alone on a
CPU). The prefill stays eager, as in transformers' `generate`.

Decode modes (`HFChatBackend(decode=...)`, `--decode`):
* `dynamic`: the dynamic-cache loop.
* `static`: a static cache, eager steps (the same numbers as `compiled`, easy to debug).
* `compiled`: a static cache and compiled steps.
* `auto`: `dynamic` on every device for now: until the GPU benchmark (benchmarks/gpu.py)
  has measured the compiled path against the dynamic one on real shapes, it is opt-in.
"""

from __future__ import annotations

from typing import Any, get_args

import torch

from driftlab.chat.spec import DecodeMode

DECODE_MODES: tuple[str, ...] = get_args(DecodeMode)
# The most compiled variants (cache lengths x batch sizes x intervention layouts) kept per step
# function (dynamo's default is 8). Dynamo counts them per code object, and the step's is
# transformers' forward wrapper, shared by every model in the process. Past the limit a
# fullgraph compile raises FailOnRecompileLimitHit: the backend then runs the later steps
# eagerly on the static cache, said once and recorded (`HFChatBackend.ran`).
RECOMPILE_LIMIT = 64
# torch.compile settings per device type; tests swap in a cheaper backend.
COMPILE_OPTIONS: dict[str, dict[str, Any]] = {
    "cuda": {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False},
    "cpu": {"fullgraph": True, "dynamic": False},
}


def cache_length(n: int, limit: int | None = None) -> int:
    """The static cache length for `n` slots: `n` rounded up to 1/8 of its power of two (at
    least 64), so lengths share compiled graphs at a cost of at most 12.5% more key slots;
    capped at the model's context window when that still holds `n`."""
    grain = 1 << max(6, n.bit_length() - 4)
    length = -(-n // grain) * grain
    return min(length, limit) if limit and limit >= n else length


def static_refusal(model: Any, *, device_map: str | None, quantize: str | None) -> str | None:
    """Why this model cannot decode with a static cache (None: it can)."""
    if device_map:
        return "its layers are spread over devices (--device-map)"
    if quantize:
        return "its weights are quantized (--quantize)"
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    except Exception as err:  # noqa: BLE001 - an architecture transformers cannot lay out statically
        return f"transformers cannot lay out its cache statically ({err})"
    if any(t != "full_attention" for t in types):
        kinds = sorted({t for t in types if t != "full_attention"})
        return f"it has {', '.join(kinds)} layers (driftlab's static layout needs full attention everywhere)"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not support a static cache in transformers"
    return None


class StaticDecoder:
    """One backend's static-decode resources, kept between calls: the compiled step, the
    static cache and the attention state's static tensors (`arena`) of the last shape used.

    Reusing them keeps the addresses a captured CUDA graph reads, so a call of the same
    batch size and cache length replays the graphs of the last one instead of recording new
    ones; a new shape replaces them (one cache in memory at a time).
    """

    def __init__(self, model: Any, compiled: bool) -> None:
        self.model = model
        self.compiled = compiled
        self._step: Any = None
        self._key: tuple | None = None
        self.cache: Any = None
        self.arena: dict[str, torch.Tensor] = {}
        # What ran, for the run's manifest and the benchmark's labels (`ran`): graphs dynamo
        # compiled for the step, the (batch, cache length) shapes decoded, and why compiled
        # steps stopped (None: they did not).
        self.graphs = 0
        self.shapes: set[tuple[int, int]] = set()
        self.eager_reason: str | None = None

    def ran(self) -> dict[str, Any]:
        """The loop that decoded: `compiled` (with the graphs compiled), or `static` (eager steps;
        `eager_after` says why compiled steps stopped, where they were asked for)."""
        facts: dict[str, Any] = {"loop": "compiled" if self.compiled else "static", "shapes": len(self.shapes)}
        if self._step is not None or self.eager_reason:
            facts["graphs"] = self.graphs
        if self.eager_reason:
            facts["eager_after"] = self.eager_reason
        return facts

    def new_cache(self, batch: int, length: int) -> Any:
        """An empty `StaticCache` of `length` slots for `batch` rows (the last one, reset, if the same)."""
        from transformers import StaticCache

        key = (batch, length)
        self.shapes.add(key)
        if self._key == key and self.cache is not None:
            self.cache.reset()
            return self.cache
        self._key, self.arena = key, {}
        self.cache = None  # free the old cache before allocating the new one
        self.cache = StaticCache(config=self.model.config, max_cache_len=length)
        return self.cache

    def step(self) -> Any:
        """The forward function of one decode step: `model.forward`, compiled in `compiled` mode."""
        if not self.compiled:
            return self.model
        if self._step is None:
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            if limit is not None and limit < RECOMPILE_LIMIT:
                torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
            options = COMPILE_OPTIONS.get(self.model.device.type, COMPILE_OPTIONS["cpu"])
            self._step = torch.compile(self.model.forward, **options)
        return self._step
