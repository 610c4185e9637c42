"""Self-chat throughput: driftlab's batched self-chat vs a naive loop, same model and settings.

naive    = one conversation at a time, one generate call per turn or probe, every prompt
           recomputed from scratch (prefix cache off, batch size 1);
driftlab = conversations batched per round, probes batched with the agent's turn, and the
           KV cache of each dialog prefix reused across turns and probes (what `driftlab run`
           does by default).
`--full` adds two ablations that attribute the gain (batching only; prefix reuse only).

Protocol, so the ratio is honest:
* one backend (one loaded model) serves every variant; torch threads are pinned (1 on a CPU,
  see common.pin_threads);
* every variant runs the same config with the same run seed: pairs, starters and the seed of
  every generation derive from it, never from how work is batched. Turns and probes are exactly
  `tokens` long (EOS ignored; probes with the turn's budget, in the agent's call), and every
  variant must write the same records (same keys and token counts: asserted, so all do the
  same decoding work); their texts are compared too (`records_identical`; in float32 batching
  and prefix reuse change no token, a guarantee the test suite checks);
* a warm-up run of every variant first (untimed: allocator, kernels, lazy imports);
* then `repeats` rounds in which every variant runs once, the order rotating each round (naive
  first, then driftlab first, ...), so slow drift of a shared machine hits both alike; the best
  time of each is kept (`speedup`), and each round's own ratio is reported too
  (`speedup_rounds`: paired, the two runs of a round back to back).

Sizes (pairs x rounds x tokens per turn; 2 probe repeats + a user probe; batch size 32;
SELFCHAT_SIZE=PAIRSxROUNDSxTOKENS overrides the first three):
  --quick   1 x 2 x 4, 1 timed round: a smoke test of the benchmark, no figure (26-30 s here).
  default   8 x 1 x 8, 2 timed rounds: 2 min 12 s and 2 min 5 s in two runs of `time python
            benchmarks/run.py selfchat` on this project's 2-core CPU, shared with other jobs
            (load average ~3, these runs included), 1 torch thread, float32: speedup 2.48x and
            2.32x (CPU time 2.38x, 2.30x), all 40 records identical to the naive loop's.
  --full    4 x 8 x 64, 2 timed rounds, with the ablations: the size of the 5.00x figure in
            docs/design-notes.md (one run, 2 threads, bfloat16 on another 2-core CPU with
            AVX512-BF16). On this project's CPU (no bfloat16 units: float32), 1 torch thread,
            load average ~3, one timing of each variant at this size took 28 min (naive loop,
            1703 s) and 7.6 min (driftlab, 456 s): 3.73x, below the target; the whole --full run
            (a warm-up, then 2 rounds of 4 variants) would take about 2.5 hours here.

Target (issue): driftlab >= 5x the naive loop (RESULT speedup), judged at the --full size
(RESULT speedup_target_size); the default size cannot show it, and on this CPU (1 thread,
float32) the --full size did not either (3.73x above). Short turns and dialogs spend their time
in prefill (above all of the probe questions, which both variants must read), which batching
does not speed up on one thread; the gain grows with the length of the turns (batched decoding)
and with the number of conversations decoded together, in these timings less with the number
of rounds. One timing of each variant per size on this CPU, 1 thread, float32, under load (load
average 3-7): 8 x 1 x 8 3.4x (2.3x and 2.5x in the default runs above), 6 x 1 x 16 3.2x,
8 x 1 x 32 3.7x, 8 x 1 x 64 4.3x (its naive loop alone took 400 s), 4 x 8 x 64 3.73x. Sizes that
a 5-minute run affords stay near 2.5x here; none measured here reached 5x.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from common import Result, pin_threads, selfchat_config, size_of

from driftlab.chat import Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat

NAIVE = ("naive loop", 1, False)  # name, batch size, prefix cache
DRIFTLAB = ("driftlab (batching + prefix reuse)", 32, True)
ABLATIONS = [("batching only", 32, False), ("prefix reuse only", 1, True)]
SIZES = {  # pairs, rounds, tokens per turn, timed rounds
    "quick": (1, 2, 4, 1),
    "default": (8, 1, 8, 2),
    "full": (4, 8, 64, 2),
}
TARGET = 5.0


def _once(backend: HFChatBackend, cfg, cache: bool, cache_bytes: int) -> tuple[float, float, list]:
    """(wall seconds, this process's CPU seconds, records) of one full run into a fresh directory."""
    backend.prefix_cache.clear()
    backend.prefix_cache.max_bytes = cache_bytes if cache else 0
    with tempfile.TemporaryDirectory() as out:
        t, c = time.perf_counter(), time.process_time()
        rundir = run_protocol(SelfChat(cfg, backend), out, progress=False)
        seconds, cpu = time.perf_counter() - t, time.process_time() - c
        records = rundir.records(RECORDS)
    return seconds, cpu, records


def _size(size: str) -> tuple[int, int, int, int]:
    """(pairs, rounds, tokens, timed rounds): the size's, or SELFCHAT_SIZE=PAIRSxROUNDSxTOKENS's."""
    pairs, rounds, tokens, repeats = SIZES[size]
    text = os.environ.get("SELFCHAT_SIZE")
    if text:
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise DriftlabError(f"SELFCHAT_SIZE={text!r}: expected PAIRSxROUNDSxTOKENS, e.g. 6x2x32.")
        pairs, rounds, tokens = (int(x) for x in parts)
    return pairs, rounds, tokens, repeats


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    pairs, rounds, tokens, repeats = _size(size)
    variants = [NAIVE, *(ABLATIONS if size == "full" else []), DRIFTLAB]
    threads, _ = pin_threads()
    backend = HFChatBackend("smollm2-135m", dtype="auto")
    cache_bytes = backend.prefix_cache.max_bytes
    sampling = Sampling(max_new_tokens=tokens, ignore_eos=True)
    configs = {name: selfchat_config(pairs=pairs, rounds=rounds, sampling=sampling, probe_repeats=2,
                                     user_probe=True, batch_size=batch, seed=1) for name, batch, _ in variants}
    cache_of = {name: cache for name, _, cache in variants}

    warm = selfchat_config(pairs=1, rounds=2, sampling=Sampling(max_new_tokens=4, ignore_eos=True), seed=99)
    for name, *_ in variants:
        _once(backend, warm.model_copy(update={"batch_size": configs[name].batch_size}), cache_of[name], cache_bytes)

    times: dict[str, list[float]] = {name: [] for name, *_ in variants}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in variants}
    records: dict[str, list] = {}
    for rep in range(repeats):
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for name, *_ in order:
            seconds, cpu_s, recs = _once(backend, configs[name], cache_of[name], cache_bytes)
            times[name].append(seconds)
            cpu[name].append(cpu_s)
            records.setdefault(name, recs)
    naive, fast = NAIVE[0], DRIFTLAB[0]
    best = {name: min(ts) for name, ts in times.items()}
    best_cpu = {name: min(ts) for name, ts in cpu.items()}

    def work(recs: list) -> list[tuple]:
        return sorted((r.key, r.n_tokens) for r in recs)

    def content(recs: list) -> dict[tuple, str]:
        return {r.key: r.text for r in recs}

    for name in records:  # equal work: the same records, each of the same length
        assert work(records[name]) == work(records[naive]), f"{name} did different work than {naive}"
    ref = content(records[naive])
    identical = {name: sum(content(recs)[k] == text for k, text in ref.items()) for name, recs in records.items()}
    n_records = len(ref)
    n_tokens = sum(r.n_tokens for r in records[naive])
    paired = [a / b for a, b in zip(times[naive], times[fast], strict=True)]  # round by round
    speedup = best[naive] / best[fast]

    res = Result(
        title=f"self-chat: {backend.name} ({str(backend.model.dtype).removeprefix('torch.')}, {threads} torch "
        f"threads), {pairs} pairs x {rounds} rounds, {tokens} tokens/turn, 2 probe repeats + user probe; best of "
        f"{repeats} interleaved round{'s' if repeats > 1 else ''}, after warm-up ({size} size)",
        columns=["variant", "best s", "s per round", "CPU s", "conversations/h", "records", "tokens",
                 "texts = naive's", "speedup", "CPU-time speedup"],
    )
    rate = {name: pairs * 3600 / best[name] for name in best}
    for name, *_ in variants:
        res.rows.append([name, f"{best[name]:.1f}", " ".join(f"{t:.1f}" for t in times[name]), f"{best_cpu[name]:.1f}",
                         f"{rate[name]:.1f}", n_records, n_tokens, f"{identical[name]}/{n_records}",
                         f"{best[naive] / best[name]:.2f}x", f"{best_cpu[naive] / best_cpu[name]:.2f}x"])
    met = "met" if speedup >= TARGET else "missed"
    res.notes = [
        f"speedup = best naive / best driftlab wall time; per round (paired, back to back): "
        f"{', '.join(f'{x:.2f}x' for x in paired)}. CPU s = this process's CPU time (time.process_time), less "
        "sensitive to how much of the machine other jobs take, not to how they load its caches and cores.",
        f"every variant wrote the same {n_records} records ({n_tokens} generated tokens); texts identical to the "
        f"naive loop's: {', '.join(f'{n} {identical[n]}/{n_records}' for n in identical if n != naive)}"
        + ("" if backend.model.dtype != torch.float32 or all(v == n_records for v in identical.values())
           else " (float32: batching should change no token; see the test suite)"),
        f"target (issue): driftlab >= {TARGET:g}x the naive loop: {met} at this size ({speedup:.2f}x)."
        + ("" if (pairs, rounds, tokens) == SIZES["full"][:3] else
           " The target is judged at the --full size (4 pairs x 8 rounds x 64 tokens); this size checks the "
           "protocol and its equal records, not the 5x figure (the module's docstring says what each size "
           "measured)."),
    ]
    res.results = {
        "size": f"{pairs}x{rounds}x{tokens}",
        "torch_threads": str(threads),
        "conversations_per_hour": f"{rate[fast]:.1f}",
        "naive_conversations_per_hour": f"{rate[naive]:.1f}",
        "speedup": f"{speedup:.2f}",
        "speedup_rounds": ",".join(f"{x:.2f}" for x in paired),
        "cpu_time_speedup": f"{best_cpu[naive] / best_cpu[fast]:.2f}",
        "records_identical": f"{identical[fast]}/{n_records}",
        "speedup_target": f"{TARGET:g}",
        "speedup_target_size": "x".join(str(x) for x in SIZES["full"][:3]),  # where the target applies
        "speedup_target_met": str(speedup >= TARGET).lower(),
    }
    for name, *_ in ABLATIONS:
        if name in best:
            res.results[f"speedup_{name.replace(' ', '_')}"] = f"{best[naive] / best[name]:.2f}"
    return res

