"""Loopback load test of `driftlab serve`: batched serving vs one request at a time.

One model, one process. The same app is served on 127.0.0.1 through uvicorn with the
batcher's default (up to 32 requests per decode batch) and with `max_batch_size=1` (one
request at a time, what a naive server does), both at once on two ports. For 1, 8 and 32
concurrent clients, each client sends its requests one after another (greedy, distinct
prompts, `tokens` new tokens); we report requests/s and p50/p95 latency. Each mode is warmed
up first; at each load the modes run back to back, the order rotating from one load to the
next. Both modes decode the same requests greedily to at most the same length; the note
counts how many replies came out identical. A third mode repeats the batched one with every
5th client disconnecting early (tokens/s and latency count the requests that were answered).

RESULT serve_batching_speedup: throughput at 32 clients, batched / one at a time (target >= 3).

Torch threads are pinned (1 on a CPU, see common.pin_threads). Sizes (new tokens; clients x
requests each): --quick 8 tokens, 1x2, 8x1, 32x1; default 12 tokens, 1x2, 8x1, 32x1; --full 32
tokens, 1x4, 8x2, 32x1 (the size of the figures in docs/design-notes.md). Measured with `time
python benchmarks/run.py serve` on this project's 2-core CPU, shared with other jobs (load
average ~4, this run included), float32: the default size took 1 min 59 s (32 clients: 3.26x
the throughput of one request at a time; 42 of 42 replies identical), --quick 1 min 16 s to
1 min 35 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

import httpx
from common import Result, pin_threads, size_of

from driftlab.chat.hf import HFChatBackend
from driftlab.serve import ServeSettings, background, create_app

TOPICS = ["the sea", "mountains", "coffee", "trains", "chess", "winter", "bees", "libraries", "rain", "bread",
          "volcanoes", "jazz", "maps", "clocks", "owls", "bridges"]


def _prompt(i: int) -> str:
    return f"In two sentences, tell me something interesting about {TOPICS[i % len(TOPICS)]} (note {i})."


async def _load(url: str, model: str, clients: int, per_client: int, tokens: int,
                leave_every: int = 0) -> tuple[float, list[float], dict[int, str], int]:
    """Each client sends its requests one after another. With `leave_every` k, every k-th
    client gives up on each request after a moment (a client timeout: it disconnects), as
    real clients do; its requests count neither in latency nor in tokens."""
    latencies: list[float] = []
    texts: dict[int, str] = {}
    done_tokens = 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal done_tokens
        leaves = leave_every and c % leave_every == leave_every - 1
        for r in range(per_client):
            i = c * per_client + r
            body = {"model": model, "messages": [{"role": "user", "content": _prompt(i)}], "max_tokens": tokens,
                    "temperature": 0}
            t = time.perf_counter()
            if leaves:
                with contextlib.suppress(httpx.TimeoutException):
                    await http.post(f"{url}/v1/chat/completions", json=body, timeout=0.2)
                continue
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
            resp.raise_for_status()
            latencies.append(time.perf_counter() - t)
            out = resp.json()
            texts[i] = out["choices"][0]["message"]["content"]
            done_tokens += out["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        start = time.perf_counter()
        await asyncio.gather(*[client(c, http) for c in range(clients)])
        wall = time.perf_counter() - start
    return wall, latencies, texts, done_tokens


SIZES = {  # new tokens, [(clients, requests per client)]
    "quick": (8, [(1, 2), (8, 1), (32, 1)]),
    "default": (12, [(1, 2), (8, 1), (32, 1)]),
    "full": (32, [(1, 4), (8, 2), (32, 1)]),
}


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    tokens, loads = SIZES[size]
    threads, _ = pin_threads()
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    res = Result(f"driftlab serve on loopback: smollm2-135m ({str(backend.model.dtype).removeprefix('torch.')}, "
                 f"{threads} torch threads), greedy, {tokens} new tokens ({size} size)",
                 ["mode", "clients", "requests", "req/s", "tok/s", "p50 latency s", "p95 latency s", "mean batch"])
    throughput: dict[tuple[str, int], float] = {}
    replies: dict[tuple[str, int], dict[int, str]] = {}
    modes = (("batched", 32, 0), ("one at a time", 1, 0), ("batched, 20% leave early", 32, 5))
    rows: dict[tuple[str, int], list] = {}
    with contextlib.ExitStack() as stack:  # every mode served at once, so each load runs them back to back
        apps = {mode: create_app(backend, ServeSettings(max_batch_size=batch, max_wait_ms=10))
                for mode, batch, _ in modes}
        urls = {mode: stack.enter_context(background(app)) for mode, app in apps.items()}
        for mode, *_ in modes:
            asyncio.run(_load(urls[mode], backend.name, 2, 1, 4))  # warm-up
        for k, (clients, per_client) in enumerate(loads):
            order = modes[k % len(modes):] + modes[: k % len(modes)]  # rotating: no mode always first
            for mode, _, leave_every in order:
                if leave_every and clients < leave_every:
                    continue
                batcher = apps[mode].state.batcher
                before = batcher.n_batches
                wall, lat, texts, n_tokens = asyncio.run(
                    _load(urls[mode], backend.name, clients, per_client, tokens, leave_every))
                sizes = batcher.sizes_since(before)
                n = len(lat)
                throughput[(mode, clients)] = n / wall
                replies[(mode, clients)] = texts
                p95 = statistics.quantiles(lat, n=20)[-1] if len(lat) > 1 else lat[0]
                rows[(mode, clients)] = [mode, clients, n, f"{n / wall:.2f}", f"{n_tokens / wall:.1f}",
                                         f"{statistics.median(lat):.2f}", f"{p95:.2f}",
                                         f"{sum(sizes) / len(sizes):.1f}"]
    res.rows = [rows[(mode, c)] for mode, *_ in modes for c, _ in loads if (mode, c) in rows]
    pairs = [(text, replies[("one at a time", c)][i]) for c, _ in loads for i, text in replies[("batched", c)].items()]
    same = sum(a == b for a, b in pairs)
    res.notes.append(f"greedy replies identical in both modes: {same} of {len(pairs)} (in {backend.model.dtype}, "
                     "a different batch can flip a near-tied token; --deterministic or float32, see docs/serve.md)")
    res.notes.append("'20% leave early': every 5th client disconnects 0.2 s into each request; its rows leave the "
                     "batch at the next step, so the others' latency stays that of the batched mode")
    for c, _ in loads:
        res.results[f"serve_batching_speedup_{c}"] = f"{throughput[('batched', c)] / throughput[('one at a time', c)]:.2f}"
    res.results["serve_batching_speedup"] = res.results["serve_batching_speedup_32"]
    res.results = {"size": size, "torch_threads": str(threads), **res.results}
    return res
