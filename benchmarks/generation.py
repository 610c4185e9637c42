"""Generation throughput of the local backend at batch sizes 1, 4 and 16, and with uneven replies.

Greedy decoding of exactly `tokens` new tokens (EOS ignored) per conversation, default model,
prefix cache off so every call pays for its prefill. Aggregate tokens/s = batch x tokens /
wall time; the headline is the ratio batch16 / batch1.

Uneven replies: a batch of 16 whose rows stop at very different lengths (per-row limits
from 4 to 128 tokens, mean 25.8, at --full: the shape of self-chat replies, where most turns
are short and a few run to the limit), with rows that are done leaving the
batch (the default) and without (every row decodes until the longest ends). Tokens/s counts
the replies' tokens.

Protocol: torch threads pinned (1 on a CPU, see common.pin_threads); every call is made once
untimed first (warm-up); then `repeats` rounds each run every call once, the order rotating
between rounds, and the best time of each is kept.

Sizes: --quick 16 tokens, limits quartered (1-32, mean 6.4), 1 round; default 32 tokens (a
warm-up of 4 tokens on the same prompts), limits quartered, 2 rounds; --full 64 tokens, the
limits above, full-length warm-ups, 2 rounds for the batch sizes and 3 for the uneven batch (the
size of the figures in docs/design-notes.md). Measured with `time python benchmarks/run.py
generation` on this project's 2-core CPU, shared with other jobs (load average ~2, this run
included), 1 torch thread, float32: the default size took 1 min 39 s (batch 16 4.79x batch 1's
tokens/s; rows that leave 1.30x staying), --quick 1 min 1 s.

GENBENCH_MODEL picks the model (default smollm2-135m; e.g. qwen2.5-coder-1.5b, where a CPU
decode step costs far more per row, so rows that leave save more).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from common import Result, Table, pin_threads, size_of

from driftlab.bench import STARTERS
from driftlab.chat import ChatRequest, Sampling, chat
from driftlab.chat.hf import HFChatBackend

UNEVEN = [128, 64, 48, 32, 24, 24, 16, 16, 12, 12, 8, 8, 8, 4, 4, 4]  # per-row limits, mean 25.8
SIZES = {  # new tokens, uneven limits divided by, rounds for the batch sizes, rounds for the uneven batch,
    # warm-up tokens for the batch sizes (the same prompts: the same prefill and kernels)
    "quick": (16, 4, 1, 1, 16),
    "default": (32, 4, 2, 2, 4),
    "full": (64, 1, 2, 3, 64),
}


def interleaved(calls: dict[str, Callable[[], object]], repeats: int,
                warm: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    """Best wall time of each call: an untimed warm-up each (the call itself, or its `warm` one),
    then `repeats` rounds, the order rotating."""
    for name in calls:
        (warm or calls)[name]()
    names = list(calls)
    best = {name: float("inf") for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            t = time.perf_counter()
            calls[name]()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    new_tokens, shrink, repeats, uneven_repeats, warm_tokens = SIZES[size]
    threads, _ = pin_threads()
    backend = HFChatBackend(os.environ.get("GENBENCH_MODEL") or "smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    sampling = Sampling(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    res = Result(
        title=f"generation: {backend.name} ({str(backend.model.dtype).removeprefix('torch.')}, "
              f"{threads} torch threads), greedy, {new_tokens} new tokens, best of {repeats} "
              f"interleaved round{'s' if repeats > 1 else ''} after warm-up ({size} size)",
        columns=["batch", "wall s", "tokens/s (aggregate)", "tokens/s per conversation", "vs batch 1"],
    )
    batches = (1, 4, 16)
    convs = {b: [[{"role": "user", "content": STARTERS[i % len(STARTERS)]}] for i in range(b)] for b in batches}
    warm = sampling.model_copy(update={"max_new_tokens": warm_tokens})
    walls = interleaved({str(b): (lambda b=b: chat(backend, convs[b], sampling)) for b in batches}, repeats,
                        warm={str(b): (lambda b=b: chat(backend, convs[b], warm)) for b in batches})
    tps = {b: b * new_tokens / walls[str(b)] for b in batches}
    for b in batches:
        res.rows.append([b, f"{walls[str(b)]:.2f}", f"{tps[b]:.1f}", f"{tps[b] / b:.1f}", f"{tps[b] / tps[1]:.2f}x"])
    res.results = {
        "size": size,
        "torch_threads": str(threads),
        "tokens_per_s_batch1": f"{tps[1]:.1f}",
        "tokens_per_s_batch4": f"{tps[4]:.1f}",
        "tokens_per_s_batch16": f"{tps[16]:.1f}",
        "batch16_over_batch1": f"{tps[16] / tps[1]:.2f}",
    }
    limits = [max(1, n // shrink) for n in UNEVEN]
    uneven_convs = [[{"role": "user", "content": STARTERS[i % len(STARTERS)]}] for i in range(len(limits))]
    uneven = Sampling(greedy=True, max_new_tokens=max(limits), ignore_eos=True)
    request = ChatRequest(uneven_convs, uneven, row_max_tokens=limits)

    def generate(compact: bool) -> None:
        backend.compact_rows = compact
        try:
            replies = backend.generate(request)
        finally:
            backend.compact_rows = True
        assert [r.n_tokens for r in replies] == limits, "a row decoded more or fewer tokens than its limit"

    table = Table(title=f"uneven replies: batch {len(limits)}, per-row limits {min(limits)}-{max(limits)} tokens "
                        f"(mean {sum(limits) / len(limits):.1f}), best of {uneven_repeats} interleaved "
                        f"round{'s' if uneven_repeats > 1 else ''} after warm-up",
                  columns=["rows that are done", "wall s", "tokens/s (replies)", "vs staying"])
    labels = {"stay in the batch": False, "leave the batch (default)": True}
    walls = interleaved({label: (lambda c=compact: generate(c)) for label, compact in labels.items()}, uneven_repeats)
    stay = walls["stay in the batch"]
    for label in labels:
        table.rows.append([label, f"{walls[label]:.2f}", f"{sum(limits) / walls[label]:.1f}",
                           f"{stay / walls[label]:.2f}x"])
    res.tables.append(table)
    res.results["uneven_leave_over_stay"] = f"{stay / walls['leave the batch (default)']:.2f}"
    return res
