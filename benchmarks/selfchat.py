"""Self-chat throughput: this implementation vs a naive loop, same model and settings.

naive  = one conversation at a time, one generate call per turn or probe, every prompt
         recomputed from scratch (prefix cache off, batch size 1);
driftlab = conversations batched per round, probes batched with the agent's turn, and the
         KV cache of each dialog prefix reused across turns and probes.
Two ablations attribute the gain (batching only; prefix reuse only).

Protocol, so the ratios are honest:
* one backend (one loaded model) serves every variant; torch threads are pinned;
* turns are exactly `tokens` long (EOS ignored) and every variant must produce the same
  number of records and generated tokens (asserted), so all do the same decoding work;
* a warm-up run of every variant first (untimed: allocator, kernels, lazy imports);
* then `repeats` rounds in which every variant runs once, the order rotating each round,
  so slow drift of a shared machine hits all alike; the best time of each is kept.
"""

from __future__ import annotations

import tempfile
import time

import torch
from common import Result

from driftlab.chat import Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.protocol.dialog import RECORDS
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig

VARIANTS = [  # name, batch size, prefix cache
    ("naive loop", 1, False),
    ("batching only", 32, False),
    ("prefix reuse only", 1, True),
    ("driftlab (batching + prefix reuse)", 32, True),
]


def _once(backend: HFChatBackend, cfg: SelfChatConfig, cache: bool, cache_bytes: int) -> tuple[float, int, int]:
    """(seconds, records, generated tokens) of one full run into a fresh directory."""
    backend.prefix_cache.clear()
    backend.prefix_cache.max_bytes = cache_bytes if cache else 0
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        rundir = run_protocol(SelfChat(cfg, backend), out, progress=False)
        seconds = time.perf_counter() - t
        records = rundir.records(RECORDS)
    return seconds, len(records), sum(r.n_tokens for r in records)


def run(quick: bool = False) -> Result:
    pairs, rounds, tokens, repeats = (2, 2, 8, 1) if quick else (4, 8, 64, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # pinned for the whole run
    backend = HFChatBackend("smollm2-135m", dtype="auto")
    cache_bytes = backend.prefix_cache.max_bytes
    sampling = Sampling(max_new_tokens=tokens, ignore_eos=True)
    configs = {name: SelfChatConfig(pairs=pairs, rounds=rounds, sampling=sampling, probe_repeats=2, user_probe=True,
                                    batch_size=batch, seed=1) for name, batch, _ in VARIANTS}
    cache_of = {name: cache for name, _, cache in VARIANTS}

    warm = SelfChatConfig(pairs=1, rounds=2, sampling=Sampling(max_new_tokens=4, ignore_eos=True), seed=99)
    for name, *_ in VARIANTS:
        _once(backend, warm.model_copy(update={"batch_size": configs[name].batch_size}), cache_of[name], cache_bytes)

    best: dict[str, float] = {}
    work: dict[str, tuple[int, int]] = {}
    for rep in range(repeats):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]
        for name, *_ in order:
            seconds, n_records, n_tokens = _once(backend, configs[name], cache_of[name], cache_bytes)
            best[name] = min(best.get(name, float("inf")), seconds)
            work.setdefault(name, (n_records, n_tokens))
            assert work[name] == (n_records, n_tokens)
    naive = VARIANTS[0][0]
    assert len(set(work.values())) == 1, f"variants did different work: {work}"

    res = Result(
        title=f"self-chat: {backend.name} ({backend.model.dtype}, {threads} threads), {pairs} pairs x {rounds} rounds, "
        f"{tokens} tokens/turn, 2 probe repeats + user probe; best of {repeats}, interleaved, after warm-up",
        columns=["variant", "best wall s", "conversations/hour", "generations", "tokens", "speedup vs naive"],
    )
    rate = {name: pairs * 3600 / best[name] for name, *_ in VARIANTS}
    for name, *_ in VARIANTS:
        res.rows.append([name, f"{best[name]:.1f}", f"{rate[name]:.1f}", work[name][0], work[name][1],
                         f"{best[naive] / best[name]:.2f}x"])
    fast = VARIANTS[-1][0]
    res.results = {
        "conversations_per_hour": f"{rate[fast]:.1f}",
        "naive_conversations_per_hour": f"{rate[naive]:.1f}",
        "speedup": f"{best[naive] / best[fast]:.2f}",
    }
    return res
