"""Speed and memory of the attention engine's modes against plain SDPA and the eager path.

What it answers: does tracing pi, a key bias or split-softmax cost much over plain decoding,
and how does that compare with what a user without driftlab would do — run transformers'
eager attention with `output_attentions=True` and sum the returned weights over the system
keys? The eager path materialises T x T weights per layer; the engine never does.

Setup: default model (smollm2-135m), dtype auto (fp32 on CPUs without native bf16), batch 1, greedy, EOS ignored, a
system prompt plus a user turn of real text (seed 000's paper) cut to the context length,
prefix cache off. Every mode runs the same prompt; modes are interleaved within a repeat so
slow drift of a shared machine hits them alike, and the best repeat is kept.

* decode tokens/s = 1 / median time of one decode forward (the backend's own `_forward`,
  timed per call; the median ignores bursts from other processes);
* "2048 + 64" = wall time of one whole call: a 2048-token prefill and 64 decode steps;
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

import torch
from common import Result

from driftlab.attention.state import AttentionConfig
from driftlab.chat import Sampling
from driftlab.chat.hf import HFChatBackend

# Real prose for the long context: the persona-drift paper beside the repo, else the benchmark's
# own system prompts and starters.
SEED_TEXT = next(iter(sorted((Path(__file__).resolve().parents[2] / "shared" / "seeds").glob("000_*.txt"))), None)
def _prose() -> str:
    if SEED_TEXT is not None:
        return SEED_TEXT.read_text()
    from driftlab.bench import STARTERS, load_personas

    return " ".join([p.system_prompt for p in load_personas()] + list(STARTERS)) * 4


SYSTEM = "You are a careful science journalist. Always answer in French, in at most three sentences."
MODES: dict[str, AttentionConfig | None] = {
    "plain SDPA": None,
    "tracing": AttentionConfig(trace=True),
    "key bias": AttentionConfig(bias=2.0),  # InstABoost-style, every layer and head
    "split-softmax": AttentionConfig(split_k=0.9),  # every layer and head
}
EAGER = "eager output_attentions"


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
        conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tok.decode(text_ids[:take])}]
        got = len(backend.render(conv).ids)
        if got == n_tokens:
            break
        take += n_tokens - got
    return conv


class TimedBackend:
    """Times each forward of the backend's decode loop (first = prefill, the rest = decode)."""

    def __init__(self, backend: HFChatBackend) -> None:
        self.backend, self.calls = backend, []
        self._forward = backend._forward
        backend._forward = self._timed

    def _timed(self, *args, **kwargs):
        sync()
        t = time.perf_counter()
        out = self._forward(*args, **kwargs)
        sync()
        self.calls.append(time.perf_counter() - t)
        return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def eager_run(backend: HFChatBackend, conv: list[dict], n_new: int, calls: list[float]) -> torch.Tensor:
    """What a user without the engine does: eager attention, output_attentions=True, pi from the weights.

    Greedy, one token per step with a KV cache; pi [n_new, L, H] for the query that predicts
    each new token, like the engine's decode trace.
    """
    from transformers import DynamicCache

    model = backend.model
    rendered = backend.render(conv)
    s, e = rendered.system_span
    ids = torch.tensor([rendered.ids], device=backend.device)
    cache = DynamicCache(config=model.config)
    pis = []
    with torch.inference_mode():
        for _ in range(n_new):
            sync()
            t = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, output_attentions=True, logits_to_keep=1)
            sync()
            calls.append(time.perf_counter() - t)
            pis.append(torch.stack([a[0, :, -1, s:e].float().sum(-1) for a in out.attentions]))
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            del out
    return torch.stack(pis)


# -- the benchmark ---------------------------------------------------------------------------------
def run(quick: bool = False) -> Result:
    contexts = (64, 256) if quick else (256, 2048)
    n_decode = 8 if quick else 64
    repeats = 1 if quick else 2
    big = contexts[-1]
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    threads = torch.get_num_threads()
    if backend.device.type == "cpu":
        # With 2+ OpenMP threads, any other busy process on the (shared) cores stalls every
        # parallel region at its barrier: we saw single decode steps swing from 60 ms to 2.5 s.
        # One thread gives stable ratios; absolute speeds are then per core.
        torch.set_num_threads(1)
    timer = TimedBackend(backend)
    memory = PeakMemory(backend.device)
    sampling = Sampling(greedy=True, max_new_tokens=n_decode + 1, ignore_eos=True)  # prefill + n_decode steps
    convs = {ctx: conversation(backend, ctx) for ctx in contexts}
    backend.chat([convs[contexts[0]]], sampling.model_copy(update={"max_new_tokens": 2}))  # warm-up

    names = [*MODES, EAGER]
    step_s = {(n, c): math.inf for n in names for c in contexts}  # median decode step, best repeat
    prefill_s = {(n, c): math.inf for n in names for c in contexts}
    total_s = {(n, c): math.inf for n in names for c in contexts}
    peak_mb = {n: 0.0 for n in names}
    first_pi: dict[tuple[str, int], torch.Tensor] = {}  # pi of the last prompt query, [L, H]
    for _ in range(repeats):
        for ctx in contexts:
            for name in names:
                timer.calls = []
                t = time.perf_counter()
                if name == EAGER:
                    engine = backend.model.config._attn_implementation
                    backend.model.set_attn_implementation("eager")
                    try:
                        pi, mb = memory.measure(lambda c=convs[ctx]: eager_run(backend, c, n_decode + 1, timer.calls))
                    finally:
                        backend.model.set_attn_implementation(engine)
                    first_pi[(name, ctx)] = pi[0]
                else:
                    (reply,), mb = memory.measure(
                        lambda c=convs[ctx], a=MODES[name]: backend.chat([c], sampling, attention=a)
                    )
                    assert reply.n_tokens == n_decode + 1
                    if reply.trace:
                        first_pi[(name, ctx)] = reply.trace["decode"][0]
                wall = time.perf_counter() - t
                assert len(timer.calls) == n_decode + 1
                key = (name, ctx)
                prefill_s[key] = min(prefill_s[key], timer.calls[0])
                step_s[key] = min(step_s[key], statistics.median(timer.calls[1:]))
                total_s[key] = min(total_s[key], wall)
                if ctx == big:
                    peak_mb[name] = max(peak_mb[name], mb)

    lens = {ctx: len(backend.render(convs[ctx]).ids) for ctx in contexts}
    res = Result(
        title=(
            f"attention modes: {backend.name} ({backend.model.dtype}, {backend.device}), batch 1, greedy, "
            f"{n_decode} decode steps, best of {repeats}"
        ),
        columns=[
            "mode",
            *[f"decode tok/s @{c}" for c in contexts],
            f"decode vs plain @{big}",
            f"prefill s @{big}",
            f"{big}+{n_decode} s",
            "eager / mode",
            f"peak MiB @{big}+{n_decode}",
        ],
    )
    plain = "plain SDPA"
    for name in names:
        res.rows.append(
            [
                name,
                *[f"{1 / step_s[(name, c)]:.1f}" for c in contexts],
                f"{step_s[(name, big)] / step_s[(plain, big)]:.3f}x",
                f"{prefill_s[(name, big)]:.2f}",
                f"{total_s[(name, big)]:.2f}",
                f"{total_s[(EAGER, big)] / total_s[(name, big)]:.2f}x",
                f"{peak_mb[name]:.0f}",
            ]
        )
    res.notes = [
        f"prompt lengths (tokens): {lens}; system prompt of {backend.render(convs[big]).system_span[1]} tokens "
        "(span mode prefix). Bias = +2 on the system keys, split-softmax k = 0.9, both on every layer and head.",
        "decode tok/s = 1 / median per-step forward time; 'eager / mode' = wall time of the eager "
        f"output_attentions run over that mode's, for {big}-token prefill + {n_decode} decode steps.",
        f"peak memory method: {memory.method}; extra over what was resident before the call "
        "(model weights excluded).",
        f"torch threads: {torch.get_num_threads()} (process default {threads}).",
    ]
    torch.set_num_threads(threads)
    diff = [(first_pi[("tracing", c)] - first_pi[(EAGER, c)]).abs() for c in contexts]
    res.notes.append(
        f"sanity: pi of the last prompt query, engine trace vs eager weights (both {str(backend.model.dtype).removeprefix('torch.')}), max abs diff "
        f"{max(d[0].max().item() for d in diff):.1e} in layer 0, {max(d.max().item() for d in diff):.1e} "
        "over all layers (the two kernels' rounding compounds through the layers)."
    )
    if quick:
        res.notes.append(f"--quick: the RESULT ratios are at context {big}, not 2048.")
    ratio = {name: step_s[(name, big)] / step_s[(plain, big)] for name in MODES}
    res.results = {
        "tracing_overhead": f"{ratio['tracing']:.3f}",
        "bias_overhead": f"{ratio['key bias']:.3f}",
        "split_softmax_overhead": f"{ratio['split-softmax']:.3f}",
        "eager_slowdown": f"{total_s[(EAGER, big)] / total_s[('split-softmax', big)]:.2f}",
    }
    return res
