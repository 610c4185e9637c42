"""Static-cache decoding for `HFChatBackend`: the pieces a CUDA-graph-ready decode step needs.

Why: the dynamic-cache loop pays Python per layer and per token (a 7B batch-1 step took 22-29 ms
on an H100 whose weight-bandwidth floor is ~4.6 ms; the compiled loop took 7.7 ms: see
docs/performance.md). A decode step becomes capturable when every tensor it reads keeps its
shape and address from step to step: transformers' `StaticCache` and the attention state laid
out statically (`AttentionState.static_layout`). The step then runs through `torch.compile`
(`mode="reduce-overhead"` on CUDA: CUDA graphs; inductor alone on a CPU). The prefill stays
eager, as in transformers' `generate`.

The graph budget, per model and process: one plain graph and one steered graph per batch
bucket (a batch is padded to a power of two with inert rows, `batch_bucket`), whatever the
prompt lengths, steers, strengths, spans or head sets:
* the cache length is a dynamic dimension (`dynamic=True`): a longer prompt gets a longer cache
  (rounded up by `cache_length`; a shorter one reuses the cache in hand), not a new graph. Duck
  shaping is off, so no other dimension that happened to have the same size pins it (`_call`);
* on CUDA the batch is concrete (`static_batch`), so each bucket gets flex's split-KV decoding
  kernel; on a CPU the buckets of 2 rows or more share one graph;
* the steered step reads every knob from tensors (attention.decode): a new steer is new values;
* key biases come in head-selection slots (`bias_slots`): four hold every kind, with InstABoost,
  PASTA and two head-restricted biases composed; a steer with more distinct head selections per
  row takes 8, a graph of its own;
* on the FlexAttention path (CUDA) the plain step is lean too: one flex pass over the filled key
  blocks, grouped heads as they are (attention.decode's `_lean`);
* the residual stream's state (persona directions: projections recorded, vector and cap steers)
  is data too (activation.state): a call that carries it runs the plain or steered graph's
  variant with the layer hooks' tensors, one more graph per bucket and kind, whatever the steer.
A graph compiled past that budget is said once, naming the guard that failed, and recorded
(`HFChatBackend.ran`, the manifest's `ran`).

Decode modes (`HFChatBackend(decode=...)`, `--decode`):
* `dynamic`: the dynamic-cache loop.
* `static`: a static cache, eager steps (the same numbers as `compiled`, easy to debug).
* `compiled`: a static cache and compiled steps.
* `auto`: `compiled` on CUDA (where the H100 measured it fastest), `dynamic` elsewhere (a CPU
  gains little from compiling and pays its compile time on every new process).

Compiled code persists between processes: inductor's caches live under driftlab's cache
(`compile_cache_dir`, one directory per torch/transformers/driftlab versions; inductor keys each
entry by the graph, which holds the model's shapes, dtype and device). `driftlab models warm`
fills it ahead of a run; the log and the manifest say how long compiling took and whether the
cache served.
"""

from __future__ import annotations

import logging
import os
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch

from driftlab.attention import engine
from driftlab.chat import precompiled
from driftlab.chat.base import ChatRequest, Sampling
from driftlab.chat.spec import DecodeMode
from driftlab.cuda_support import auto_fast_path
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

if TYPE_CHECKING:
    from driftlab.activation.state import ResidualState
    from driftlab.attention.state import AttentionState

logger = logging.getLogger(__name__)

# An `HFChatBackend`: `static_step` and `warm` are the bodies of its methods (importing it would close a circle).
Backend = Any

DECODE_MODES: tuple[str, ...] = get_args(DecodeMode)
# The most compiled variants kept per step function (dynamo's default is 8). Dynamo counts them
# per code object, and the step's is transformers' forward wrapper, shared by every model in the
# process. Past the limit a fullgraph compile raises FailOnRecompileLimitHit: the backend then
# runs the later steps eagerly on the static cache, said once and recorded (`HFChatBackend.ran`).
RECOMPILE_LIMIT = 64
# torch.compile settings per device type; tests swap in a cheaper backend. `dynamic=True`: the
# cache length is symbolic, so a new prompt length compiles nothing. driftlab's own key,
# `static_batch`: the batch dimension is concrete, one graph per batch bucket, because inductor
# picks flex's split-KV decoding kernel only for a concrete batch (`flex_decoding._use_flex_decoding`);
# on a CPU one graph serves every bucket of 2 rows or more (fewer compiles, no such kernel).
COMPILE_OPTIONS: dict[str, dict[str, Any]] = {
    "cuda": {"mode": "reduce-overhead", "fullgraph": True, "dynamic": True, "static_batch": True},
    "cpu": {"fullgraph": True, "dynamic": True},
}
# Head-selection slots of key biases in a steered graph: a fixed count, so InstABoost, PASTA and a
# head-restricted bias composed share the graph of every other steer (see the module docstring).
BIAS_SLOTS = 4
# A held cache must fit in free device memory with this much more for a step's activations
# (StaticDecoder._fits; benchmarks/gpu.py's paper check uses the same margin).
CACHE_MARGIN = 1.25


class CudaGraphRecordings:
    """CUDA graphs recorded in this process. Inductor's CUDA-graph trees announce each recording
    through dynamo's compile callbacks (CallbackTrigger.CUDAGRAPH_RECORDING); counting them shows a
    recording that lands inside a timed run, a stall no compile counter sees (the graph was compiled
    long before)."""

    count = 0
    _seen: Callable[[Any], None] | None = None
    _handler: Any = None  # dynamo's callback handler, once torch has the trigger

    @classmethod
    def watch(cls) -> bool:
        """Count recordings from now on: installs the callback, again after `torch._dynamo.reset()`
        (which drops every callback). False where torch has no such trigger. Runs every compiled
        step, so after the first call it is one membership check."""
        if cls._seen is None:
            from torch._dynamo import callback

            trigger = getattr(getattr(callback, "CallbackTrigger", None), "CUDAGRAPH_RECORDING", None)
            if trigger is None:
                return False

            def seen(args: Any) -> None:
                if args.callback_trigger is trigger:
                    cls.count += 1

            cls._seen, cls._handler = seen, callback.callback_handler
        if cls._seen not in cls._handler.start_callbacks:
            cls._handler.register_start_callback(cls._seen)
        return True


def auto_decode(device: torch.device) -> str:
    """The loop `--decode auto` means on `device`: compiled on CUDA with a torch the fast path
    is tested on (`driftlab.cuda_support`), dynamic elsewhere."""
    return "compiled" if auto_fast_path(device) else "dynamic"


def cache_length(n: int, limit: int | None = None) -> int:
    """The static cache length for `n` slots: `n` rounded up to 1/8 of its power of two, in
    whole key blocks of flex (128) and at least two of them (dynamo specialises a dimension of
    size 1, and the decode block masks have one entry per key block), so a cache serves a few
    calls of growing prompts before a longer one is needed, at a cost of at most 12.5% more key
    slots for long ones; capped at the model's context window when that still holds `n`."""
    grain = 1 << max(7, n.bit_length() - 4)
    length = max(-(-n // grain) * grain, 256)
    return min(length, limit) if limit and limit >= n else length


def batch_bucket(n: int) -> int:
    """The batch a static decode runs: `n` rounded up to a power of two (inert rows fill it)."""
    return 1 << max(0, (n - 1).bit_length())


def warm_buckets(batches: Any) -> list[int]:
    """The batch buckets that warming for the batch sizes `batches` compiles, ascending; a clear
    error for anything but whole numbers of at least 1 (before any model is loaded)."""
    sizes = list(batches)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise DriftlabError(f"Batch sizes to warm must be whole numbers of at least 1, got {sizes}.",
                            hint="E.g. --batch 1,2,4,8.")
    return sorted({batch_bucket(n) for n in sizes})


def cache_bytes(config: Any, batch: int, length: int, itemsize: int) -> int:
    """Bytes of the keys and values of a static cache of `batch` rows and `length` slots for a
    model of `config`, `itemsize` bytes an element."""
    cfg = config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * batch * heads * length * head_dim * itemsize


def bias_slots(n: int) -> int:
    """Key-bias slots of a steered graph for `n` distinct head selections in a row: BIAS_SLOTS,
    or the power of two above it that holds them."""
    return max(BIAS_SLOTS, batch_bucket(n))


def compile_cache_dir() -> Path:
    """Where compiled code persists: driftlab's cache, one directory per versions of torch,
    transformers and driftlab (inductor's own keys tell graphs, shapes, dtypes and devices apart).
    A package with no installed metadata (a checkout on PYTHONPATH) is tagged `checkout`."""
    from importlib.metadata import PackageNotFoundError, version

    from driftlab.assets.store import cache_root

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "checkout"

    tag = "-".join(f"{name}{installed(name)}" for name in ("torch", "transformers", "driftlab"))
    return cache_root() / "compile" / tag.replace("+", "_")


def users_cache_dir(value: str | None) -> str | None:
    """The inductor cache the user chose through TORCHINDUCTOR_CACHE_DIR, or None. Inductor writes
    its own /tmp default into that variable on first use, and a library imported before driftlab
    may have used it (pastalib's import does): that value is inductor's, not a choice."""
    if value is None:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return None if os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


# TORCHINDUCTOR_CACHE_DIR as driftlab's import found it, before inductor writes its default there.
# Judged (users_cache_dir) only when compiling: that imports inductor, a second in every process
# whose parent had compiled (the variable is then set), such as a server's or a sweep's children.
_CACHE_DIR_AT_IMPORT = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def use_compile_cache() -> Path:
    """Point inductor's caches at `compile_cache_dir`, unless the user set TORCHINDUCTOR_CACHE_DIR.
    Inductor reads the variable at each use (and writes its /tmp default there on first use)."""
    if users_cache_dir(_CACHE_DIR_AT_IMPORT) is None:
        path = compile_cache_dir()
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(path):
            path.mkdir(parents=True, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
            from torch._inductor.utils import clear_caches

            clear_caches()  # what inductor memoised about the old directory
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


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


def failed_guard(reasons: list[str]) -> str:
    """The guard that made dynamo compile again, from its recompile reasons (one line per cached
    graph it tried, e.g. "0/1: tensor 'kwargs['past_key_values'].layers[0].keys' size mismatch at
    index 2. expected 256, actual 384"): a tensor's shape or dtype first, since graphs of other
    models and of the plain step share the code object and fail on their own object or kwargs."""
    lines = [line.strip().lstrip("- ").strip() for reason in reasons for line in reason.splitlines()]
    lines = [line for line in lines if re.match(r"\d+/\d+: ", line)]
    for wanted in ("mismatch", "kwargs['driftlab']", ""):
        for line in lines:
            if wanted in line and "len(kwargs)" not in line and "check_obj_id" not in line:
                return line.split(": ", 1)[1].split("  #")[0].strip()
    return lines[0].split(": ", 1)[1] if lines else "a guard dynamo did not report"


class StaticDecoder:
    """One backend's static-decode resources, kept between calls: the compiled step, a static
    cache and the attention state's static tensors (`arena`) per batch bucket, the last
    `KEEP_CACHES` buckets used, and what compiling cost.

    Reusing them keeps the addresses a captured CUDA graph reads, so a call of a bucket in hand
    whose prompt fits its cache replays the graphs recorded for it instead of recording new ones.
    Three buckets are kept because a self-chat with CFG cycles through three (the user's turns,
    the agent's, and CFG's agent turns with twice the rows): fewer, and caches would be
    reallocated, and their graphs recorded again, inside the run. The memory budget: a held cache
    is let go (least recently used first) when a new one would not fit in the device's free
    memory otherwise; `ran` counts these evictions. A longer prompt replaces its bucket's cache
    with a longer one.
    """

    KEEP_CACHES = 3

    def __init__(self, model: Any, compiled: bool) -> None:
        self.model = model
        self.compiled = compiled
        if compiled:
            precompiled.setting()  # a bad DRIFTLAB_PRECOMPILED fails here, before any work
        self._step: Any = None
        # batch bucket -> (cache length, cache, arena), the most recently used last
        self._held: OrderedDict[int, tuple[int, Any, dict[str, torch.Tensor]]] = OrderedDict()
        self._batch: int | None = None  # the bucket of the current call
        self.static_batch = False  # each batch bucket its own graph (COMPILE_OPTIONS' static_batch)
        self._marked: weakref.WeakSet = weakref.WeakSet()  # caches whose fixed dimensions are marked static
        # What ran, for the run's manifest and the benchmark's labels (`ran`): graphs dynamo
        # compiled for the step, per graph key (batch bucket, steered, bias slots, attention); the
        # (batch, cache length) shapes decoded; compile seconds and inductor cache hits / misses;
        # the guards that failed past the budget; and why compiled steps stopped (None: they did not).
        self.graphs = 0
        self.per_key: dict[tuple[int, bool, int, str, bool], int] = {}
        self.shapes: set[tuple[int, int]] = set()
        self.compile_s = 0.0
        self.cache_hits = self.cache_misses = 0
        # AOTAutograd's own cache (on by default since torch 2.6): a hit skips AOT tracing, so
        # a second process whose inductor cache hits but whose AOT cache misses still traces twice
        self.aot_cache = {"hit": 0, "miss": 0, "bypass": 0}
        self.over_budget: list[str] = []
        self.eager_reason: str | None = None
        self.evictions = 0  # held caches let go for another bucket's (KEEP_CACHES or the memory budget)
        self.cudagraph_skips = 0  # compiled graphs inductor did not capture in a CUDA graph
        self.cudagraph_recordings = 0  # CUDA graphs recorded during this decoder's steps (CudaGraphRecordings)
        self.recordings_watched = False
        self.artifacts: precompiled.Artifacts | None = None  # the precompiled steps' store, where used

    def ran(self) -> dict[str, Any]:
        """The loop that decoded: `compiled` (with the graphs compiled, their keys, compile
        seconds and cache use), or `static` (eager steps; `eager_after` says why compiled steps
        stopped, where they were asked for)."""
        facts: dict[str, Any] = {"loop": "compiled" if self.compiled else "static", "shapes": len(self.shapes)}
        if self._step is not None or self.eager_reason:
            facts["graphs"] = self.graphs
            facts["graph_keys"] = [{"batch": b, "steered": s, "bias_slots": j, "attention": a, "residual": r,
                                    "graphs": n} for (b, s, j, a, r), n in sorted(self.per_key.items())]
            facts["compile_s"] = round(self.compile_s, 2)
            facts["compile_cache"] = {"hits": self.cache_hits, "misses": self.cache_misses,
                                      **{f"aot_{k}": n for k, n in self.aot_cache.items()}}
            facts["cudagraph_skips"] = self.cudagraph_skips
            if self.recordings_watched:
                facts["cudagraph_recordings"] = self.cudagraph_recordings
            if self.artifacts is not None:
                facts["precompiled"] = self.artifacts.ran()
            if self.decode_kernel:
                facts["decode_kernel"] = "flex_decoding (split over keys)"
        facts["cache_evictions"] = self.evictions
        if self.over_budget:
            facts["over_budget"] = list(self.over_budget)
        if self.eager_reason:
            facts["eager_after"] = self.eager_reason
        return facts

    def tally(self) -> dict[str, float]:
        """Running totals, for `HFChatBackend.warm` to difference: graphs compiled, seconds compiling
        or loading precompiled steps, inductor cache hits and misses, precompiled steps saved and loaded."""
        a = self.artifacts
        return {"graphs": self.graphs, "compile_s": self.compile_s + (a.load_s if a else 0.0),
                "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "saved": a.saved if a else 0, "loaded": a.loaded if a else 0}

    def new_cache(self, batch: int, length: int) -> Any:
        """An empty `StaticCache` of at least `length` slots for `batch` rows: the bucket's own,
        reset, when it has slots enough; else a new one of `length` slots (the least recently used
        bucket's cache is let go past `KEEP_CACHES`)."""
        from transformers import StaticCache

        held = self._held.get(batch)
        self._batch = batch
        if held is not None and held[0] >= length:
            self._held.move_to_end(batch)
            self.shapes.add((batch, held[0]))
            held[1].reset()
            return held[1]
        self.shapes.add((batch, length))
        self._held.pop(batch, None)  # free the old caches before allocating the new one
        need = self._cache_bytes(batch, length)
        while self._held and (len(self._held) >= self.KEEP_CACHES or not self._fits(need)):
            self._held.popitem(last=False)
            self.evictions += 1
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._held[batch] = (length, cache, {})
        return cache

    def _cache_bytes(self, batch: int, length: int) -> int:
        return cache_bytes(self.model.config, batch, length, self.model.dtype.itemsize)

    def _fits(self, need: int) -> bool:
        """Whether `need` bytes fit in the device's free memory (and the allocator's free blocks),
        with a margin for the step's activations; a CPU always says yes."""
        device = self.model.device
        if device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return need * CACHE_MARGIN <= free

    @property
    def cache(self) -> Any:
        """The current call's static cache (None before the first)."""
        return self._held[self._batch][1] if self._batch in self._held else None

    @property
    def arena(self) -> dict[str, torch.Tensor]:
        """The attention state's static tensors of the current call's cache."""
        return self._held[self._batch][2]

    @property
    def length(self) -> int:
        """The key slots of the current call's cache."""
        return self._held[self._batch][0]

    def _options(self) -> dict[str, Any]:
        """torch.compile's options on this model's device, and driftlab's `static_batch`."""
        return dict(COMPILE_OPTIONS.get(self.model.device.type, COMPILE_OPTIONS["cpu"]))

    @property
    def decode_kernel(self) -> bool:
        """Whether compiled steps ask flex for its split-KV decoding kernel by name: on CUDA with a
        concrete batch, where inductor can always give it (a miss then fails the compile, said and
        recorded, instead of running the generic kernel)."""
        return self.compiled and self.model.device.type == "cuda" and bool(self._options().get("static_batch"))

    def step(self) -> Any:
        """The forward function of one decode step: `model.forward`, compiled in `compiled` mode."""
        if not self.compiled:
            return self.model
        if self._step is None:
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            if limit is not None and limit < RECOMPILE_LIMIT:
                torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
            cache = use_compile_cache()
            options = self._options()
            # flex.py is imported on first use (engine._flex_module): imported inside the first trace,
            # it would leave a guard on the module global the import then changes, and that step's
            # first graph would be compiled twice in a process that had not used flex before.
            engine._flex_module()
            self.static_batch = options.pop("static_batch", False)
            compiled = torch.compile(self.model.forward, **options)
            if precompiled.wanted(self.model.device, options):
                compiled = self.artifacts = precompiled.Artifacts(self.model, options, compiled,
                                                                  cache / "driftlab-aot")
            self._step = lambda *args, **kwargs: self._call(compiled, args, kwargs)
        return self._step

    def _call(self, compiled: Callable, args: tuple, kwargs: dict) -> Any:
        """One call of the compiled forward, traced on driftlab's terms:
        * Python floats (a layer's scaling, a norm's epsilon) as constants: under dynamic=True
          dynamo would make them graph inputs read with .item(), CPU scalars that keep a step out
          of CUDA graphs. Only shapes are meant to be dynamic.
        * No duck shaping: dynamo would give one symbol to input dimensions equal at compile time,
          so a dimension the graph specialises (the bias slots' count, a head count) would pin
          another that merely had the same size (the cache's key blocks), and the next cache length
          would compile again.
        * The cache's head counts and head size static (`_mark_cache`), and with `static_batch`
          the rows' dimension too (the rest follows from these)."""
        from torch.fx.experimental import _config as fx_config

        self._mark_cache(kwargs.get("past_key_values"))
        if self.static_batch:
            for name in ("input_ids", "attention_mask", "position_ids"):
                if isinstance(kwargs.get(name), torch.Tensor):
                    torch._dynamo.mark_static(kwargs[name], 0)
        with torch._dynamo.config.patch(specialize_float=True), fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    def run(self, forward: Callable[[], torch.Tensor], key: tuple[int, bool, int, str, bool],
            say: Callable[[str], None]) -> torch.Tensor:
        """Run one compiled step (`forward`), counting what it compiled against the budget:
        `key` is the step's graph key (batch bucket, steered, bias slots, attention implementation). A
        graph past one per key is said once through `say`, naming the guard that failed, and kept in
        `over_budget`."""
        from torch._dynamo.utils import counters, guard_failures

        graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        aot = {k: counters["aot_autograd"][f"autograd_cache_{k}"] for k in self.aot_cache}
        failed = {code: len(reasons) for code, reasons in guard_failures.items()}
        self.recordings_watched = CudaGraphRecordings.watch() or self.recordings_watched
        recorded = CudaGraphRecordings.count
        start = time.perf_counter()
        try:
            return forward()
        finally:
            self.cudagraph_skips += counters["inductor"]["cudagraph_skips"] - skips
            self.cudagraph_recordings += CudaGraphRecordings.count - recorded
            for k, before in aot.items():
                self.aot_cache[k] += counters["aot_autograd"][f"autograd_cache_{k}"] - before
            new = counters["stats"]["unique_graphs"] - graphs
            if new:
                seconds = time.perf_counter() - start
                self._compiled(key, new, seconds, counters["inductor"]["fxgraph_cache_hit"] - hits,
                               counters["inductor"]["fxgraph_cache_miss"] - misses)
                if self.per_key[key] > 1:
                    reasons = [r for code, rs in guard_failures.items() for r in rs[failed.get(code, 0):]]
                    self._over_budget(key, reasons, say)

    def _mark_cache(self, cache: Any) -> None:
        """Mark a static cache's KV-head and head-size dimensions static (and its rows, with
        `static_batch`), once per cache: only its length is meant to be dynamic. Why: under
        `dynamic=True` a symbolic KV-head count makes the query-head group symbolic; a folded group
        (Qwen2.5-7B's 7) read by the bias score_mod then reaches inductor's flex lowering as a shape
        buffer it cannot lower (an H100, torch 2.11: "'ShapeAsConstantBuffer' object has no
        attribute 'dtype'"), and flex's decoding kernel needs the group to be a known power of two."""
        if cache is None or cache in self._marked:
            return
        layers = [t for layer in getattr(cache, "layers", []) for t in (getattr(layer, "keys", None),
                                                                        getattr(layer, "values", None))]
        if not layers or any(not isinstance(t, torch.Tensor) for t in layers):
            return  # not laid out yet (transformers allocates a layer on its first update)
        for t in layers:
            for dim in (1, 3, *((0,) if self.static_batch else ())):
                torch._dynamo.mark_static(t, dim)
        self._marked.add(cache)

    def _compiled(self, key: tuple[int, bool, int, str, bool], new: int, seconds: float, hits: int, misses: int) -> None:
        self.graphs += new
        self.per_key[key] = self.per_key.get(key, 0) + new
        self.compile_s += seconds
        self.cache_hits += hits
        self.cache_misses += misses
        batch, steered, slots, _, residual = key
        served = "served by the compile cache" if hits and not misses else \
            f"compile cache: {hits} hits, {misses} misses"
        logger.info("compiled the %s decode step for batch %d%s%s in %.1f s (%s)", "steered" if steered else "plain",
                    batch, f", {slots} bias slots" if steered else "", " with the residual state" if residual else "",
                    seconds, served)

    def _over_budget(self, key: tuple[int, bool, int, str, bool], reasons: list[str], say: Callable[[str], None]) -> None:
        guard = failed_guard(reasons)
        batch, steered, _, _, _ = key
        self.over_budget.append(f"batch {batch} {'steered' if steered else 'plain'}: {guard}")
        if len(self.over_budget) == 1:
            say(f"the {'steered' if steered else 'plain'} decode step for batch {batch} compiled again, past the "
                f"budget of one graph per batch size and kind, because {guard} (recorded under ran.decode.over_budget; "
                "said once).")


def static_step(backend: Backend, ids, mask, positions, cache, state: AttentionState | None,
                 residual: ResidualState | None = None) -> torch.Tensor:
    """One decode step on the static cache, compiled in `compiled` mode.

    A step that cannot be compiled (dynamo or inductor refuses it, before anything runs)
    runs eagerly, with the same numbers, and so do the later ones, said once. The logits
    are copied: a CUDA graph's next replay overwrites its outputs."""
    static = backend._static
    if not static.compiled:
        return backend._forward(ids, mask, positions, cache, state, forward=static.step(), residual=residual)
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    calls = state._calls if state is not None else 0
    residual_calls = residual._calls if residual is not None else 0
    steered = state is not None and not state.lean
    slots = state.bias_heads.shape[0] if steered else 0
    # One graph per key; the attention implementation too (a benchmark runs stock SDPA beside driftlab's).
    key = (ids.shape[0], steered, slots, backend.model.config._attn_implementation, residual is not None)
    try:
        return static.run(lambda: backend._forward(ids, mask, positions, cache, state, forward=static.step(),
                                                   residual=residual).clone(),
                          key, lambda message: backend._fallback(f"--decode compiled: {backend.name}: {message}"))
    except (TorchDynamoException, FailOnRecompileLimitHit) as err:
        if state is not None:
            state._calls = calls  # the failed pass did not run
        if residual is not None:
            residual._calls = residual_calls
        static.compiled = False
        if isinstance(err, FailOnRecompileLimitHit):
            why = (f"its decode step reached dynamo's recompile limit ({RECOMPILE_LIMIT} compiled variants: "
                   "batch sizes x cache lengths x intervention layouts)")
        else:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            why = f"a decode step cannot be compiled ({type(err).__name__}: {first})"
        static.eager_reason = why
        backend._fallback(f"--decode compiled: {backend.name}: {why}; it and the later steps run eagerly on the "
                          "static cache (the run's manifest records it under ran.agent.decode).")
        return backend._forward(ids, mask, positions, cache, state, forward=static.step(), residual=residual)


def warm(backend: Backend, batches: Sequence[int] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
    """Compile the decode step ahead of a run: a plain and a steered call per batch bucket of
    `batches`, each a few tokens (the cache length is dynamic, so one short prompt serves every
    length). Compiled code lands in the compile cache (`static_decode.compile_cache_dir`), which
    later processes read, and so do the precompiled steps (`chat.precompiled`), which they load
    instead of tracing again. Returns one row per (bucket, kind): graphs compiled, seconds
    (compiling or loading), inductor cache hits and misses, precompiled steps saved and loaded."""
    static = backend._static
    if static is None or not static.compiled:
        raise DriftlabError(f"{backend.name} does not decode with the compiled loop (--decode {backend.decode_mode}"
                            f"{': ' + backend._static_refused if backend._static_refused else ''}): nothing to warm.",
                            hint="Load it with decode='compiled' (--decode compiled).")
    # With directions, a persona's rows carry the residual state (its projection is recorded): the
    # run's graphs are those, so warm on a persona the directions hold (an axis serves any prompt).
    held = [p.system_prompt for p in backend.directions.personas.values()] if backend.directions else []
    system = next((s for s in held if s is not None), "You are brief.")
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    steered = Interventions.parse(["split-softmax:k=0.9", "trace", "instaboost:m=2"])
    sampling = Sampling(greedy=True, max_new_tokens=3, ignore_eos=True)
    rows = []
    for bucket in warm_buckets(batches):
        for interventions in (Interventions(), steered):
            before = static.tally()
            backend.generate(ChatRequest([conversation] * bucket, sampling, interventions=interventions))
            row = {k: v - before[k] for k, v in static.tally().items()}
            rows.append({"batch": bucket, "steered": interventions is steered, "graphs": row["graphs"],
                         "compile_s": round(row["compile_s"], 2), "cache_hits": row["cache_hits"],
                         "cache_misses": row["cache_misses"], "saved": row["saved"], "loaded": row["loaded"]})
    return rows


def static_decoder(model, decode: DecodeMode, device: torch.device, *, device_map: str | None,
                   quantize: str | None) -> tuple[StaticDecoder | None, str | None]:
    """The static decoder `decode` asks for on `device` (`auto`: `auto_decode`), None for the dynamic loop;
    and why a static loop asked for cannot serve this model (`static_refusal`), else None."""
    wanted = auto_decode(device) if decode == "auto" else decode
    if wanted not in ("static", "compiled"):
        return None, None
    why = static_refusal(model, device_map=device_map, quantize=quantize)
    return (StaticDecoder(model, compiled=wanted == "compiled") if why is None else None), why


def decode_facts(asked: DecodeMode, static: StaticDecoder | None, refused: str | None) -> dict[str, Any]:
    """What decoded (`HFChatBackend.ran`): the loop asked for and the one that ran, with the graphs a
    compiled step compiled and why a faster loop was not taken."""
    facts: dict[str, Any] = {"asked": asked}
    if static is not None:
        facts.update(static.ran())
    else:
        facts["loop"] = "dynamic"
        if refused:
            facts["refused"] = refused
    return facts
