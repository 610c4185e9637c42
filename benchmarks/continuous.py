"""Continuous vs static batching in `driftlab serve`, under arrivals spread in time.

One model (smollm2-135m, the CPU's preferred dtype), one process, two apps on 127.0.0.1 that
share the backend: `--batching continuous` (the default) and `--batching static`, run back to
back on the same load, the order rotating from one load to the next.

A load: `clients` clients, each sending `per_client` streamed chat requests, waiting an
exponential gap before each (Poisson arrivals, mean `gap` seconds; the same seeded gaps in
both modes). Request k asks `max_tokens` drawn from [4, longest] (seeded) with `ignore_eos`
(so both modes decode exactly the same tokens), greedy, and one of three steers in turn:
none, split-softmax:k=0.8, instaboost:m=5 (requests of one steer share a batch; those of
another wait for it to drain). Measured per request: time to first token (TTFT: the first
chunk with text) and end to end (the `[DONE]` event); per load: tokens/s over the wall time.

Then the case continuous batching exists for: a 5-token request sent 100 ms after a 256-token
one (same sampling and steer). RESULT short_vs_long_*: the short one's end-to-end time over the
long one's, per mode.

RESULTs: continuous/static ratios at each load: throughput (target >= 1.3), p99 TTFT (target
<= 0.5), p99 end to end (target <= 0.7); with a handful of requests per load, p99 is about the
maximum.

Sizes: --quick 8 clients x 1, tokens 4-32; default 8 and 16 clients x 2, tokens 4-64; --full 8,
16 and 32 clients x 3, tokens 4-256.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import httpx
import numpy as np
from common import Result, size_of

from driftlab.chat.hf import HFChatBackend
from driftlab.serve import ServeSettings, background, create_app

SYSTEM = "Always reply in French."
STEERS = ([], ["split-softmax:k=0.8"], ["instaboost:m=5"])
MODES = ("continuous", "static")
SIZES = {"quick": ([(8, 1)], 32, 0.2), "default": ([(8, 2), (16, 2)], 64, 0.3),
         "full": ([(8, 3), (16, 3), (32, 3)], 256, 0.5)}  # loads (clients, per client), longest, mean gap s


def _body(model: str, k: int, tokens: int, steer: list[str]) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": f"Tell me one fact about the number {k}."}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True, "driftlab": {"steer": steer}}


async def _one(http: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int]:
    """(TTFT, end to end, tokens) of one streamed request."""
    t, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - t
            tokens = body["max_tokens"]
    return first or 0.0, time.perf_counter() - t, tokens


async def _load(url: str, model: str, clients: int, per_client: int, longest: int, gap: float) -> dict:
    rng = random.Random(clients)
    plan = [[(rng.expovariate(1 / gap), rng.randint(4, longest)) for _ in range(per_client)] for _ in range(clients)]
    ttft, e2e, tokens = [], [], 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for r, (wait, n) in enumerate(plan[c]):
            await asyncio.sleep(wait)
            k = c * per_client + r
            a, b, t = await _one(http, url, _body(model, k, n, STEERS[k % len(STEERS)]))
            ttft.append(a)
            e2e.append(b)
            tokens += t

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        start = time.perf_counter()
        await asyncio.gather(*[client(c, http) for c in range(clients)])
        wall = time.perf_counter() - start
    return {"tok/s": tokens / wall, "p99 ttft": float(np.percentile(ttft, 99)), "p99 e2e": float(np.percentile(e2e, 99)),
            "p50 e2e": float(np.percentile(e2e, 50)), "n": len(e2e)}


async def _short_after_long(url: str, model: str) -> float:
    async with httpx.AsyncClient(timeout=3600) as http:
        long = asyncio.create_task(_one(http, url, _body(model, 1, 256, [])))
        await asyncio.sleep(0.1)
        (_, short, _), (_, whole, _) = await asyncio.gather(_one(http, url, _body(model, 2, 5, [])), long)
    return short / whole


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    loads, longest, gap = SIZES[size]
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    dtype = str(backend.model.dtype).removeprefix("torch.")
    res = Result(f"continuous vs static batching: smollm2-135m {dtype}, Poisson arrivals (mean gap {gap} s), "
                 f"max_tokens 4-{longest}, three steers ({size} size)",
                 ["mode", "clients x requests", "tok/s", "p99 TTFT s", "p50 end-to-end s", "p99 end-to-end s",
                  "joined a running batch"])
    measured: dict[tuple[str, int], dict] = {}
    with contextlib.ExitStack() as stack:
        apps = {mode: create_app(backend, ServeSettings(max_wait_ms=10, batching=mode)) for mode in MODES}
        urls = {mode: stack.enter_context(background(app)) for mode, app in apps.items()}
        for mode in MODES:  # warm-up
            asyncio.run(_load(urls[mode], backend.name, 2, 1, 4, 0.01))
        for i, (clients, per_client) in enumerate(loads):
            for mode in MODES[i % 2:] + MODES[: i % 2]:
                batcher = apps[mode].state.batcher
                before = batcher.n_admitted
                m = measured[(mode, clients)] = asyncio.run(_load(urls[mode], backend.name, clients, per_client,
                                                                 longest, gap))
                res.rows.append([mode, f"{clients} x {per_client}", f"{m['tok/s']:.1f}", f"{m['p99 ttft']:.2f}",
                                 f"{m['p50 e2e']:.2f}", f"{m['p99 e2e']:.2f}", batcher.n_admitted - before])
        short = {mode: asyncio.run(_short_after_long(urls[mode], backend.name)) for mode in MODES}
    for clients, _ in loads:
        c, s = measured[("continuous", clients)], measured[("static", clients)]
        res.results[f"continuous.throughput_{clients}"] = f"{c['tok/s'] / s['tok/s']:.2f}"
        res.results[f"continuous.p99_ttft_{clients}"] = f"{c['p99 ttft'] / s['p99 ttft']:.2f}"
        res.results[f"continuous.p99_e2e_{clients}"] = f"{c['p99 e2e'] / s['p99 e2e']:.2f}"
    for mode in MODES:
        res.results[f"short_vs_long_{mode}"] = f"{short[mode]:.2f}"
    res.notes.append("short_vs_long: a 5-token request sent 100 ms after a 256-token one, its end-to-end time over "
                     "the long one's (continuous: it joins the running batch; static: it waits for it)")
    return res
