"""Speed and memory of the attention engine's modes against two SDPA baselines and the eager path.

What it answers: does tracing pi, a key bias or split-softmax cost much over plain decoding,
and how does that compare with what a user without driftlab would do: run stock transformers
(SDPA) for plain decoding, or eager attention with `output_attentions=True` and sum the
returned weights over the system keys for pi? The eager path materialises T x T weights per
layer; the engine never does.

Two baselines, one model each (same weights, same decode loop, same prompt):
* "driftlab SDPA (GQA-folded)": driftlab's attention function with no intervention, i.e.
  `engine._plain`. On CPU, decoding one query with grouped-query heads, it folds the query
  heads onto their KV head and calls SDPA itself (transformers would ask SDPA for
  `enable_gqa`, which CPU kernels serve on the slow math path); everywhere else (prefill,
  CUDA) it is transformers' SDPA function. The engine's modes are measured against it.
* "stock transformers SDPA": the model loaded with `attn_implementation="sdpa"`, no driftlab
  attention code at all.

Setup: default model (smollm2-135m), dtype auto (fp32 on CPUs without native bf16), batch 1,
greedy, EOS ignored, a system prompt plus a user turn of real text (the persona-drift paper,
Li et al. 2024, where it lies beside the repository) cut to the context length, prefix cache
off, torch intra-op threads pinned (1 on a CPU unless BENCH_THREADS says otherwise, see
common.pin_threads).
Protocol: every variant is warmed up at every context first (untimed); then each of N
repeats runs every variant once per context, interleaved (the order rotates between repeats,
so slow drift of a shared machine hits all alike), and the best repeat is kept. Every ratio
asserts that both sides ran the same prompt length and the same number of decode steps.

Sizes (contexts; decode steps; repeats): --quick 64 and 256; 8; 2. Default 256 and 1024; 16; 2.
--full 256 and 2048; 64; 3 (the size of the figures in docs/design-notes.md; it ran past 13
minutes on the shared 2-core CPU). Measured with `time python benchmarks/run.py attention` on
this project's 2-core CPU, shared with other jobs (load average ~2, this run included), 1 torch
thread, float32: the default size took 2 min 56 s (tracing 1.08x, key bias 1.00x, split-softmax
1.07x driftlab SDPA's decode step at 1024 tokens; eager 1.76x the whole call), --quick 1 min 8 s.

* decode tokens/s = 1 / median time of one decode forward (the backend's own `_forward`,
  timed per call; the median ignores bursts from other processes);
* "2048 + 64" = wall time of one whole call: a 2048-token prefill and 64 decode steps (at
  --full; the default size's call is a 1024-token prefill and 16 steps);
* peak memory: CUDA: `torch.cuda.max_memory_allocated` over the call, minus what was
  allocated before it. CPU: the process's peak resident set (VmHWM) over the call minus its
  resident set before; VmHWM is reset through /proc/self/clear_refs and freed heap pages are
  handed back with malloc_trim first, so earlier modes cannot hide a later one's peak.
"""

from __future__ import annotations

import ctypes
import gc
import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from common import Result, TimedForward, pin_threads, size_of, sync

from driftlab.chat import Sampling, chat
from driftlab.chat.hf import HFChatBackend
from driftlab.steering import Interventions

# Real prose for the long context: the persona-drift paper beside the repo, else the benchmark's
# own system prompts and starters.
SEED_TEXT = next(
    iter(sorted((Path(__file__).resolve().parents[2] / "shared" / "seeds").glob("000_*.txt"))), None
)


def _prose() -> str:
    if SEED_TEXT is not None:
        return SEED_TEXT.read_text()
    from driftlab.bench import STARTERS, load_personas

    return " ".join([p.system_prompt for p in load_personas()] + list(STARTERS)) * 4


SYSTEM = "You are a careful science journalist. Always answer in French, in at most three sentences."
DRIFTLAB_SDPA = "driftlab SDPA (GQA-folded)"
STOCK_SDPA = "stock transformers SDPA"
EAGER = "eager output_attentions"
# The engine's modes (--steer specs), all on driftlab's attention function.
MODES: dict[str, list[str]] = {
    DRIFTLAB_SDPA: [],
    "tracing": ["trace"],
    "key bias": ["bias:value=2.0"],  # InstABoost-style, system keys, every layer and head
    "split-softmax": ["split-softmax:k=0.9"],  # every layer and head
}


# -- memory ----------------------------------------------------------------------------------------
class PeakMemory:
    """Peak extra memory of a block of code (see the module docstring for the method)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.proc = Path("/proc/self/clear_refs")
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None
        self.method = "cuda max_memory_allocated" if self.cuda else "peak RSS (VmHWM reset via clear_refs)"
        self.ok = self.cuda or self.proc.exists()

    @staticmethod
    def _status_kb(key: str) -> int:
        return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))

    def measure(self, fn: Callable[[], object]) -> tuple[object, float]:
        """Run fn; return (its result, peak extra MiB or NaN when this OS cannot tell)."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # cached blocks of an earlier variant would hide this one's peak
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = fn()
            torch.cuda.synchronize()
            return out, (torch.cuda.max_memory_allocated() - before) / 2**20
        if not self.ok:
            return fn(), math.nan
        if self.libc is not None:
            self.libc.malloc_trim(0)
        self.proc.write_text("5")  # reset the high-water mark to the current RSS
        before = self._status_kb("VmRSS")
        out = fn()
        return out, (self._status_kb("VmHWM") - before) / 1024


# -- workload --------------------------------------------------------------------------------------
def conversation(backend: HFChatBackend, n_tokens: int) -> list[dict]:
    """System prompt + a user turn of real text, rendered to about `n_tokens` tokens."""
    tok = backend.tokenizer
    text_ids = tok(_prose() * 4, add_special_tokens=False)["input_ids"]
    frame = len(backend.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ""}]).ids)
    take = n_tokens - frame
    for _ in range(4):  # decoding and re-encoding may merge tokens; nudge to the target length
        conv = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": tok.decode(text_ids[:take])},
        ]
        got = len(backend.render(conv).ids)
        if got == n_tokens:
            break
        take += n_tokens - got
    return conv


def eager_run(
    backend: HFChatBackend, conv: list[dict], n_new: int, calls: list[float]
) -> tuple[torch.Tensor, list[int]]:
    """What a user without the engine does: eager attention, output_attentions=True, pi from the weights.

    Greedy, one token per step with a KV cache; pi [n_new, L, H] for the query that predicts
    each new token, like the engine's decode trace; and the n_new greedy token ids.
    """
    from transformers import DynamicCache

    model = backend.model
    rendered = backend.render(conv)
    s, e = rendered.system_span
    ids = torch.tensor([rendered.ids], device=backend.device)
    cache = DynamicCache(config=model.config)
    pis, tokens = [], []
    with torch.inference_mode():
        for _ in range(n_new):
            sync()
            t = time.perf_counter()
            out = model(
                input_ids=ids, past_key_values=cache, use_cache=True, output_attentions=True, logits_to_keep=1
            )
            sync()
            calls.append(time.perf_counter() - t)
            pis.append(torch.stack([a[0, :, -1, s:e].float().sum(-1) for a in out.attentions]))
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(ids))
            del out
    return torch.stack(pis), tokens


# -- the benchmark ---------------------------------------------------------------------------------
class Run(NamedTuple):  # (a dataclass needs sys.modules, which run.py's loader skips)
    """One measured call: per-forward times, wall time, peak memory and what was computed."""

    calls: list[float]
    wall: float
    mb: float
    prompt_len: int
    tokens: list[int]
    pi: torch.Tensor | None  # [n_new, L, H] when the variant traces pi

    @property
    def shape(self) -> tuple[int, int]:
        """(prompt tokens, forwards after the prefill): what a timing ratio must hold equal."""
        return self.prompt_len, len(self.calls) - 1


SIZES = {  # contexts, decode steps, timed rounds
    "quick": ((64, 256), 8, 2),
    "default": ((256, 1024), 16, 2),
    "full": ((256, 2048), 64, 3),
}


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    contexts, n_decode, repeats = SIZES[size]
    big = contexts[-1]
    # With 2+ OpenMP threads, any other busy process on the (shared) cores stalls every parallel
    # region at its barrier: we saw single decode steps swing from 60 ms to 2.5 s. One thread
    # (BENCH_THREADS to change it) gives stable ratios; absolute speeds are then per core.
    threads, default_threads = pin_threads()
    drift = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    stock = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0, attn_implementation="sdpa")
    assert stock.model.config._attn_implementation == "sdpa" != drift.model.config._attn_implementation
    timers = {id(drift): TimedForward(drift), id(stock): TimedForward(stock)}
    memory = PeakMemory(drift.device)
    convs = {ctx: conversation(drift, ctx) for ctx in contexts}
    lens = {ctx: len(drift.render(convs[ctx]).ids) for ctx in contexts}
    assert all(len(stock.render(convs[c]).ids) == lens[c] for c in contexts)
    steer = {name: Interventions.parse(specs) for name, specs in MODES.items()}

    def measure(name: str, ctx: int, n_new: int) -> Run:
        """Generate n_new tokens (1 prefill + n_new - 1 decode forwards) with variant `name`."""
        backend = drift if name in MODES else stock
        timer = timers[id(backend)]
        timer.calls = []
        conv = convs[ctx]
        t = time.perf_counter()
        if name == EAGER:
            model = stock.model
            model.set_attn_implementation("eager")
            try:
                (pi, tokens), mb = memory.measure(lambda: eager_run(stock, conv, n_new, timer.calls))
            finally:
                model.set_attn_implementation("sdpa")
        else:
            sampling = Sampling(greedy=True, max_new_tokens=n_new, ignore_eos=True)
            (reply,), mb = memory.measure(lambda: chat(backend, [conv], sampling, steer=steer.get(name)))
            pi = reply.trace["decode"] if reply.trace else None
            tokens = list(reply.token_ids)
            assert reply.n_tokens == n_new, (name, reply.n_tokens)
        wall = time.perf_counter() - t
        assert len(timer.calls) == n_new, (name, len(timer.calls))
        return Run(list(timer.calls), wall, mb, len(backend.render(conv).ids), tokens, pi)

    names = [STOCK_SDPA, *MODES, EAGER]
    for ctx in contexts:  # warm-up: every variant, every prompt shape, untimed
        for name in names:
            measure(name, ctx, 2)

    last: dict[tuple[str, int], Run] = {}  # the latest run of each variant and context
    step_s: dict[tuple[str, int], float] = {}  # median decode step, best repeat
    prefill_s: dict[tuple[str, int], float] = {}
    total_s: dict[tuple[str, int], float] = {}
    peak_mb = {n: 0.0 for n in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no fixed neighbour
        for ctx in contexts:
            for name in order:
                m = measure(name, ctx, n_decode + 1)
                key = (name, ctx)
                assert key not in last or m.shape == last[key].shape
                last[key] = m
                prefill_s[key] = min(prefill_s.get(key, math.inf), m.calls[0])
                step_s[key] = min(step_s.get(key, math.inf), statistics.median(m.calls[1:]))
                total_s[key] = min(total_s.get(key, math.inf), m.wall)
                if ctx == big:
                    peak_mb[name] = max(peak_mb[name], m.mb)

    def ratio(table: dict[tuple[str, int], float], a: str, b: str, ctx: int = big) -> float:
        """table[a] / table[b], only when both sides did the same work."""
        sa, sb = last[(a, ctx)].shape, last[(b, ctx)].shape
        assert sa == sb and sa[1] == n_decode, (a, sa, b, sb)
        return table[(a, ctx)] / table[(b, ctx)]

    res = Result(
        title=(
            f"attention modes: {drift.name} ({drift.model.dtype}, {drift.device}), batch 1, greedy, "
            f"{n_decode} decode steps, best of {repeats} interleaved repeats, torch threads {threads}"
        ),
        columns=[
            "variant",
            *[f"decode tok/s @{c}" for c in contexts],
            f"decode vs driftlab SDPA @{big}",
            f"decode vs stock SDPA @{big}",
            f"prefill s @{big}",
            f"{big}+{n_decode} s",
            "eager / variant",
            f"peak MiB @{big}+{n_decode}",
        ],
    )
    for name in names:
        res.rows.append(
            [
                name,
                *[f"{1 / step_s[(name, c)]:.1f}" for c in contexts],
                f"{ratio(step_s, name, DRIFTLAB_SDPA):.3f}x",
                f"{ratio(step_s, name, STOCK_SDPA):.3f}x",
                f"{prefill_s[(name, big)]:.2f}",
                f"{total_s[(name, big)]:.2f}",
                f"{ratio(total_s, EAGER, name):.2f}x",
                f"{peak_mb[name]:.0f}",
            ]
        )
    same = {c: last[(DRIFTLAB_SDPA, c)].tokens == last[(STOCK_SDPA, c)].tokens for c in contexts}
    res.notes = [
        f"prompt lengths (tokens): {lens}; system prompt of {drift.render(convs[big]).system_span[1]} tokens "
        "(span mode prefix). Bias = +2 on the system keys, split-softmax k = 0.9, both on every layer and head.",
        "decode tok/s = 1 / median per-step forward time; 'decode vs X' = that median over X's (lower is "
        f"faster); 'eager / variant' = wall time of the eager output_attentions run over the variant's, for "
        f"{big}-token prefill + {n_decode} decode steps. Each ratio checked: same prompt length and step count.",
        f"{DRIFTLAB_SDPA} = driftlab's attention function without interventions (engine._plain: GQA folded "
        f"into SDPA for CPU decode, transformers' SDPA otherwise); {STOCK_SDPA} = attn_implementation='sdpa'.",
        f"greedy tokens of the two SDPA baselines identical: {same} (in bf16 their different "
        "reduction orders may flip a near-tie token; in fp32 they agreed on 40 tokens at 256 and 2048).",
        f"peak memory method: {memory.method}; extra over what was resident before the call "
        "(model weights excluded).",
        f"torch threads: {threads} pinned (process default {default_threads}); "
        f"warm-up: every variant at every context before timing.",
    ]
    diff = [(last[("tracing", c)].pi[0] - last[(EAGER, c)].pi[0]).abs() for c in contexts]
    res.notes.append(
        f"sanity: pi of the last prompt query, engine trace vs eager weights (both "
        f"{str(drift.model.dtype).removeprefix('torch.')}), max abs diff "
        f"{max(d[0].max().item() for d in diff):.1e} in layer 0, {max(d.max().item() for d in diff):.1e} "
        "over all layers (the two kernels' rounding compounds through the layers)."
    )
    if big != 2048:
        res.notes.append(f"{size} size: the RESULT ratios are at context {big}, not 2048 (--full).")
    res.results = {
        "size": size,
        "torch_threads": str(threads),
        "tracing_overhead": f"{ratio(step_s, 'tracing', DRIFTLAB_SDPA):.3f}",
        "bias_overhead": f"{ratio(step_s, 'key bias', DRIFTLAB_SDPA):.3f}",
        "split_softmax_overhead": f"{ratio(step_s, 'split-softmax', DRIFTLAB_SDPA):.3f}",
        "driftlab_sdpa_vs_stock_sdpa": f"{ratio(step_s, DRIFTLAB_SDPA, STOCK_SDPA):.3f}",
        "tracing_vs_stock_sdpa": f"{ratio(step_s, 'tracing', STOCK_SDPA):.3f}",
        "bias_vs_stock_sdpa": f"{ratio(step_s, 'key bias', STOCK_SDPA):.3f}",
        "split_softmax_vs_stock_sdpa": f"{ratio(step_s, 'split-softmax', STOCK_SDPA):.3f}",
        "eager_slowdown": f"{ratio(total_s, EAGER, 'split-softmax'):.2f}",
        "eager_slowdown_vs_stock_sdpa": f"{ratio(total_s, EAGER, STOCK_SDPA):.2f}",
    }
    return res
