"""Generation throughput of the local backend at batch sizes 1, 4 and 16.

Greedy decoding of exactly 64 new tokens (EOS ignored) per conversation, default model,
prefix cache off so every call pays for its prefill. Aggregate tokens/s = batch x 64 /
wall time; the headline is the ratio batch16 / batch1.
"""

from __future__ import annotations

from common import Result, best_time

from driftlab.bench import STARTERS
from driftlab.chat import Sampling, chat
from driftlab.chat.hf import HFChatBackend


def run(quick: bool = False) -> Result:
    new_tokens = 16 if quick else 64
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
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
    return res
