"""Self-chat throughput: this implementation vs a naive loop, same model and settings.

naive  = one conversation at a time, one generate call per turn or probe, every prompt
         recomputed from scratch (prefix cache off, batch size 1);
driftlab = conversations batched per round, probes batched with the agent's turn, and the
         KV cache of each dialog prefix reused across turns and probes.
Two ablations attribute the gain (batching only; prefix reuse only). Turns are a fixed
max_new_tokens long (EOS ignored) so every variant does the same amount of decoding.
"""

from __future__ import annotations

import tempfile
import time

from common import Result

from driftlab.chat.hf import HFChatBackend
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig


def run(quick: bool = False) -> Result:
    pairs, rounds, tokens = (2, 2, 8) if quick else (4, 4, 32)
    backend = HFChatBackend("smollm2-135m", dtype="auto")
    cache_bytes = backend.prefix_cache.max_bytes
    variants = [  # name, batch size, prefix cache
        ("naive loop", 1, False),
        ("batching only", 32, False),
        ("prefix reuse only", 1, True),
        ("driftlab (batching + prefix reuse)", 32, True),
    ]
    res = Result(
        title=f"self-chat: {backend.name} ({backend.model.dtype}), {pairs} pairs x {rounds} rounds, "
        f"{tokens} tokens/turn, 2 probe repeats + user probe",
        columns=["variant", "wall s", "conversations/hour", "generations", "speedup vs naive"],
    )
    rates = {}
    for name, batch, cache in variants:
        backend.prefix_cache.clear()
        backend.prefix_cache.max_bytes = cache_bytes if cache else 0
        cfg = SelfChatConfig(pairs=pairs, rounds=rounds, max_new_tokens=tokens, probe_repeats=2, user_probe=True,
                             batch_size=batch, ignore_eos=True, seed=1)
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            rundir = SelfChat(cfg, out, backend, progress=False).run()
            seconds = time.perf_counter() - t
            n = len(rundir.records())
        rates[name] = pairs * 3600 / seconds
        res.rows.append([name, f"{seconds:.1f}", f"{rates[name]:.1f}", n,
                         f"{rates[name] / rates['naive loop']:.2f}x"])
    fast = rates["driftlab (batching + prefix reuse)"]
    res.results = {
        "conversations_per_hour": f"{fast:.1f}",
        "naive_conversations_per_hour": f"{rates['naive loop']:.1f}",
        "speedup": f"{fast / rates['naive loop']:.2f}",
    }
    return res
