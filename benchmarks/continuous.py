"""Continuous vs static batching in `driftlab serve`, under arrivals spread in time.

One model (smollm2-135m by default, the CPU's preferred dtype), one process, two apps on
127.0.0.1 that share the backend: `--batching continuous` (the default) and `--batching static`,
run back to back on the same load, the order rotating from one load to the next.

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

Where the throughput goes, in two more tables:
- each load's decode steps under each mode, timed from the forward pass of every step: their
  count, rows, cache slots and milliseconds (RESULT <mode>.rows_per_step_N). A mode gains
  throughput only where its steps hold more rows for less than their proportional cost;
- a client has one request in flight, so the client whose requests ask the most tokens sets the
  run's length: a decode step holds at most (all tokens) / (that client's tokens) rows on average,
  however the server schedules (RESULT rows_bound_N);
- a decode step's cost against its rows, alone (greedy, plain, `ignore_eos`, short prompts;
  RESULT step_ms_B), and at 16 rows of about 320 prompt tokens (RESULT step_ms_16_long): a
  running batch's rows are padded to its longest live row and attend over all of it, where a
  static batch's rows start together.

Sizes: --quick 8 clients x 1, tokens 4-32; default 8 and 16 clients x 2, tokens 4-64; --full 8,
16 and 32 clients x 3, tokens 4-256. BENCH_MODEL names another model (a preset or a directory;
smollm2-135m by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time

import httpx
import numpy as np
from common import Result, Table, size_of

from driftlab.chat import ChatRequest, Sampling, decoding
from driftlab.chat.hf import HFChatBackend
from driftlab.serve import ServeSettings, background, create_app

SYSTEM = "Always reply in French."
STEERS = ([], ["split-softmax:k=0.8"], ["instaboost:m=5"])
MODES = ("continuous", "static")
BATCHES = (1, 8, 16, 32)  # rows per decode step, for the step-cost table
LONG = 75  # "Count to ten." repeats of the long-context step (about 320 prompt tokens with SmolLM2)
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
    plan = _plan(clients, per_client, longest, gap)
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


def _plan(clients: int, per_client: int, longest: int, gap: float) -> list[list[tuple[float, int]]]:
    """Each client's (gap s, max_tokens) per request: seeded by the load, the same in both modes."""
    rng = random.Random(clients)
    return [[(rng.expovariate(1 / gap), rng.randint(4, longest)) for _ in range(per_client)] for _ in range(clients)]


def _rows_bound(plan: list[list[tuple[float, int]]]) -> float:
    """The most rows a decode step can average over the run: one request in flight per client, so
    the run lasts at least as many steps as its longest client asks tokens."""
    return sum(n for reqs in plan for _, n in reqs) / max(sum(n for _, n in reqs) for reqs in plan)


def _step_ms(backend: HFChatBackend, batch: int, repeat: int = 1, steps: int = 16) -> float:
    """Milliseconds per decode step at `batch` rows whose user turns say "Count to ten." `repeat`
    times (prefill excluded: a one-step run's time subtracted)."""
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count to ten. " * repeat + str(k)}]
             for k in range(batch)]

    def timed(n: int) -> float:
        t = time.perf_counter()
        backend.generate(ChatRequest(convs, Sampling(greedy=True, max_new_tokens=n, ignore_eos=True)))
        return time.perf_counter() - t

    timed(2)
    return 1000 * min(timed(steps + 1) - timed(1) for _ in range(2)) / steps


def _ceiling(backend: HFChatBackend, loads, longest: int, gap: float) -> Table:
    table = Table("what bounds the throughput ratio", ["measure", "value"])
    for clients, per_client in loads:
        bound = _rows_bound(_plan(clients, per_client, longest, gap))
        table.rows.append([f"rows per step at most, {clients} clients", f"{bound:.1f}"])
    for b in BATCHES:
        table.rows.append([f"ms per decode step, {b} rows", f"{_step_ms(backend, b):.0f}"])
    long = len(backend.render([{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "Count to ten. " * LONG}]).ids)
    table.rows.append([f"ms per decode step, 16 rows of {long} prompt tokens", f"{_step_ms(backend, 16, LONG):.0f}"])
    return table


class StepMeter:
    """The decode steps of a load: their count, rows, cache slots and time, from timing
    `Decoding.feed` (a step's one forward pass) while the meter is entered."""

    def __init__(self) -> None:
        self.steps = self.rows = self.slots = 0
        self.seconds = 0.0

    def __enter__(self) -> StepMeter:
        feed = self._feed = decoding.Decoding.feed

        def timed(run, nxt) -> None:
            t = time.perf_counter()
            feed(run, nxt)
            self.seconds += time.perf_counter() - t
            self.steps, self.rows, self.slots = self.steps + 1, self.rows + len(nxt), self.slots + run.mask.shape[1]

        decoding.Decoding.feed = timed
        return self

    def __exit__(self, *exc) -> None:
        decoding.Decoding.feed = self._feed

    def row(self) -> list[str]:
        n = max(self.steps, 1)
        return [str(self.steps), f"{self.rows / n:.1f}", f"{1000 * self.seconds / n:.0f}", f"{self.slots / n:.0f}",
                f"{1000 * self.seconds / max(self.rows, 1):.1f}"]


def _serve_loads(backend: HFChatBackend, loads, longest: int, gap: float, res: Result) -> dict:
    """Every load under both modes (the order rotating), a row of `res` each; their measures."""
    steps = Table("decode steps of each load (one forward pass each)",
                  ["mode", "clients", "steps", "rows per step", "ms per step", "cache slots per step", "ms per row"])
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
                with StepMeter() as meter:
                    m = asyncio.run(_load(urls[mode], backend.name, clients, per_client, longest, gap))
                measured[(mode, clients)] = m | {"rows per step": meter.rows / max(meter.steps, 1)}
                res.rows.append([mode, f"{clients} x {per_client}", f"{m['tok/s']:.1f}", f"{m['p99 ttft']:.2f}",
                                 f"{m['p50 e2e']:.2f}", f"{m['p99 e2e']:.2f}", batcher.n_admitted - before])
                steps.rows.append([mode, clients, *meter.row()])
        measured["short"] = {mode: asyncio.run(_short_after_long(urls[mode], backend.name)) for mode in MODES}
    res.tables.append(steps)
    return measured


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    loads, longest, gap = SIZES[size]
    model = os.environ.get("BENCH_MODEL") or "smollm2-135m"  # unset or empty: the default
    backend = HFChatBackend(model, dtype="auto", prefix_cache_bytes=0)
    dtype = str(backend.model.dtype).removeprefix("torch.")
    res = Result(f"continuous vs static batching: {model} {dtype}, Poisson arrivals (mean gap {gap} s), "
                 f"max_tokens 4-{longest}, three steers ({size} size)",
                 ["mode", "clients x requests", "tok/s", "p99 TTFT s", "p50 end-to-end s", "p99 end-to-end s",
                  "joined a running batch"])
    measured = _serve_loads(backend, loads, longest, gap, res)
    for clients, _ in loads:
        c, s = measured[("continuous", clients)], measured[("static", clients)]
        res.results[f"continuous.throughput_{clients}"] = f"{c['tok/s'] / s['tok/s']:.2f}"
        res.results[f"continuous.p99_ttft_{clients}"] = f"{c['p99 ttft'] / s['p99 ttft']:.2f}"
        res.results[f"continuous.p99_e2e_{clients}"] = f"{c['p99 e2e'] / s['p99 e2e']:.2f}"
        res.results[f"continuous.rows_per_step_{clients}"] = f"{c['rows per step']:.1f}"
        res.results[f"static.rows_per_step_{clients}"] = f"{s['rows per step']:.1f}"
    for mode in MODES:
        res.results[f"short_vs_long_{mode}"] = f"{measured['short'][mode]:.2f}"
    ceiling = _ceiling(backend, loads, longest, gap)
    res.tables.append(ceiling)
    for (clients, _), row in zip(loads, ceiling.rows, strict=False):
        res.results[f"rows_bound_{clients}"] = row[1]
    for b, row in zip(BATCHES, ceiling.rows[len(loads):], strict=False):
        res.results[f"step_ms_{b}"] = row[1]
    res.results["step_ms_16_long"] = ceiling.rows[-1][1]
    res.notes.append("short_vs_long: a 5-token request sent 100 ms after a 256-token one, its end-to-end time over "
                     "the long one's (continuous: it joins the running batch; static: it waits for it)")
    return res
