"""Generation throughput of the local backend at batch sizes 1, 4 and 16, and with uneven replies.

Greedy decoding of exactly 64 new tokens (EOS ignored) per conversation, default model,
prefix cache off so every call pays for its prefill. Aggregate tokens/s = batch x 64 /
wall time; the headline is the ratio batch16 / batch1.

Uneven replies: a batch of 16 whose rows stop at very different lengths (per-row limits
from 4 to 128 tokens, mean 27: the shape of self-chat replies, where most turns are short
and a few run to the limit), with rows that are done leaving the batch (the default) and
without (every row decodes until the longest ends). Tokens/s counts the replies' tokens.

GENBENCH_MODEL picks the model (default smollm2-135m; e.g. qwen2.5-coder-1.5b, where a CPU
decode step costs far more per row, so rows that leave save more).
"""

from __future__ import annotations

import os

from common import Result, Table, best_time

from driftlab.bench import STARTERS
from driftlab.chat import ChatRequest, Sampling, chat
from driftlab.chat.hf import HFChatBackend

UNEVEN = [128, 64, 48, 32, 24, 24, 16, 16, 12, 12, 8, 8, 8, 4, 4, 4]  # per-row limits, mean 25.8


def run(quick: bool = False) -> Result:
    new_tokens = 16 if quick else 64
    backend = HFChatBackend(os.environ.get("GENBENCH_MODEL") or "smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    sampling = Sampling(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    res = Result(
        title=f"generation: {backend.name} ({backend.model.dtype}), greedy, {new_tokens} new tokens",
        columns=["batch", "wall s", "tokens/s (aggregate)", "tokens/s per conversation", "vs batch 1"],
    )
    tps = {}
    for batch in (1, 4, 16):
        convs = [[{"role": "user", "content": STARTERS[i % len(STARTERS)]}] for i in range(batch)]
        seconds = best_time(lambda convs=convs: chat(backend, convs, sampling), repeats=1 if quick else 2)
        tps[batch] = batch * new_tokens / seconds
        res.rows.append(
            [batch, f"{seconds:.2f}", f"{tps[batch]:.1f}", f"{tps[batch] / batch:.1f}", f"{tps[batch] / tps[1]:.2f}x"]
        )
    res.results = {
        "tokens_per_s_batch1": f"{tps[1]:.1f}",
        "tokens_per_s_batch4": f"{tps[4]:.1f}",
        "tokens_per_s_batch16": f"{tps[16]:.1f}",
        "batch16_over_batch1": f"{tps[16] / tps[1]:.2f}",
    }
    limits = [max(1, n // 4) for n in UNEVEN] if quick else UNEVEN
    convs = [[{"role": "user", "content": STARTERS[i % len(STARTERS)]}] for i in range(len(limits))]
    uneven = Sampling(greedy=True, max_new_tokens=max(limits), ignore_eos=True)
    table = Table(title=f"uneven replies: batch {len(limits)}, per-row limits {min(limits)}-{max(limits)} tokens "
                        f"(mean {sum(limits) / len(limits):.1f})",
                  columns=["rows that are done", "wall s", "tokens/s (replies)", "vs staying"])
    walls = {}
    for compact in (False, True):
        backend.compact_rows = compact
        walls[compact] = best_time(lambda: backend.generate(ChatRequest(convs, uneven, row_max_tokens=limits)),
                                   repeats=1 if quick else 3)
    backend.compact_rows = True
    for compact, label in ((False, "stay in the batch"), (True, "leave the batch (default)")):
        table.rows.append([label, f"{walls[compact]:.2f}", f"{sum(limits) / walls[compact]:.1f}",
                           f"{walls[False] / walls[compact]:.2f}x"])
    res.tables.append(table)
    res.results["uneven_leave_over_stay"] = f"{walls[False] / walls[True]:.2f}"
    return res
