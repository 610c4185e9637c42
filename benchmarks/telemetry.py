"""What drift telemetry and adaptive control cost a server: `driftlab serve` with and without
`driftlab.telemetry`, and a steer always on vs only when drifting.

One model (smollm2-135m, the CPU's preferred dtype), one app on 127.0.0.1 (uvicorn, batches of up to 32, no prefix cache so every round
pays its prefill). A round is 8 concurrent chat requests under one system prompt, each a
conversation of three user turns (distinct last turns, greedy, `tokens` new tokens each,
`ignore_eos` so every mode decodes the same number of steps). Modes:

* plain:                no telemetry, no directions (the denominator);
* telemetry:            every request asks for telemetry: pi traced over the reply;
* directions:           the backend holds persona directions (projections are recorded on every
                        request), no telemetry asked;
* telemetry+directions: both: pi and the projection in every reply;
* instaboost:           every request steered (`instaboost:m=10`, always on);
* when-drifting:        the same steer with `when-drifting:r=0.5`: the server traces each
                        conversation's prefill for pi and its first turn's (cached), then steers
                        only the rows whose pi fell below half their first turn's.

The directions are random unit vectors with made-up statistics: what a projection costs does
not depend on the values. Each mode is warmed up once; then `repeats` rounds each run every mode
once, the order rotating. A ratio is the median over rounds of that round's ratio: the same
round's plain run is its baseline. A CPU's speed drifts between rounds (the table's range of the
rounds' ratios shows how far), so a best time of each mode compares moments, while a round's
modes run within a minute of each other. p: the Wilcoxon signed-rank test of the rounds' log
ratios (paired by round; driftlab.stats).

RESULT telemetry.cost: telemetry / plain (target <= 1.05); telemetry.cost_with_directions:
telemetry+directions / plain (target <= 1.10); gate.cost: when-drifting / instaboost (what deciding
costs; no target); gate.steered: how many of the 8 replies the gate steered.

Sizes: --quick 8 tokens, 1 round; default 32 tokens, 7 rounds; --full 64 tokens, 11 rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import numpy as np
import torch
from common import Result, size_of

from driftlab.activation.directions import Directions, PersonaDirection
from driftlab.chat.hf import HFChatBackend
from driftlab.serve import ServeSettings, background, create_app
from driftlab.stats import wilcoxon_signed_rank

SYSTEM = "Always reply in French."
USERS = ["Tell me about the sea.", "What is a good breakfast?", "How do trains work?", "Why is the sky blue?",
         "Describe a cat.", "What is chess?", "Name a famous painter.", "How do bees make honey?"]
HISTORY = [("Hello! Who are you?", "I am a helpful assistant."),
           ("Can you help me plan a trip?", "Of course. Where would you like to go, and when?")]
MODES = ("plain", "telemetry", "directions", "telemetry+directions", "instaboost", "when-drifting")
STEER = {"instaboost": ["instaboost:m=10"], "when-drifting": ["instaboost:m=10", "when-drifting:r=0.5"]}


def _directions(backend: HFChatBackend) -> Directions:
    L, d = backend.shape.layers, backend.d_model
    gen = torch.Generator().manual_seed(0)
    unit = torch.nn.functional.normalize(torch.randn(L, d, generator=gen), dim=-1)
    persona = PersonaDirection(id="french", system_prompt=SYSTEM, unit=unit, norm=torch.full((L,), 4.0),
                               with_proj=1 + torch.randn(16, L, generator=gen),
                               without_proj=torch.randn(16, L, generator=gen), auroc=torch.ones(3, L),
                               band=tuple(range(L // 2, L // 2 + 4)))
    return Directions({"model": backend.name, "n_layers": L, "d_model": d}, [persona])


def _messages(user: str) -> list[dict]:
    turns = [m for u, a in HISTORY for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
    return [{"role": "system", "content": SYSTEM}, *turns, {"role": "user", "content": user}]


async def _round(url: str, model: str, tokens: int, mode: str) -> tuple[float, int]:
    """One round's wall seconds, and how many replies were steered (by the gate's decisions)."""
    extra = {"telemetry": True} if "telemetry" in mode else {}
    extra |= {"steer": STEER[mode]} if mode in STEER else {}
    bodies = [{"model": model, "messages": _messages(u), "max_tokens": tokens, "temperature": 0,
               "ignore_eos": True, **({"driftlab": extra} if extra else {})} for u in USERS]
    async with httpx.AsyncClient(timeout=600) as http:
        t = time.perf_counter()
        replies = await asyncio.gather(*[http.post(f"{url}/v1/chat/completions", json=b) for b in bodies])
        elapsed = time.perf_counter() - t
    for r in replies:
        r.raise_for_status()
        if "telemetry" in mode and r.json()["driftlab"]["telemetry"]["pi"] is None:
            raise RuntimeError("a telemetry reply without pi")
    gates = [r.json().get("driftlab", {}).get("gate") for r in replies]
    if mode == "when-drifting" and None in gates:
        raise RuntimeError("a gated reply without its gate decision")
    return elapsed, sum(bool(g and g["steered"]) for g in gates)


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    tokens, repeats = {"quick": (8, 1), "default": (32, 7), "full": (64, 11)}[size]
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    directions = _directions(backend)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    steered = 0
    with background(create_app(backend, ServeSettings(max_wait_ms=50, prefix_cache_mb=0))) as url:
        for r in range(repeats + 1):  # round 0 warms every mode up
            order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
            for mode in order:
                backend.use_directions(directions if "directions" in mode else None)
                t, n = asyncio.run(_round(url, backend.name, tokens, mode))
                steered = n if mode == "when-drifting" else steered
                if r:
                    times[mode].append(t)
    backend.use_directions(None)
    return _result(times, tokens, repeats, steered, str(backend.model.dtype).removeprefix("torch."))


def _ratios(times: dict[str, list[float]], mode: str, base: str) -> list[float]:
    """Each round's time of `mode` over the same round's time of `base`."""
    return [t / b for t, b in zip(times[mode], times[base], strict=True)]


def _ratio(times: dict[str, list[float]], mode: str, base: str) -> float:
    """The median over rounds of mode's time over base's in the same round."""
    return statistics.median(_ratios(times, mode, base))


def _result(times: dict[str, list[float]], tokens: int, repeats: int, steered: int, dtype: str) -> Result:
    result = Result(title=f"drift telemetry and gating: 8 concurrent 3-turn requests x {tokens} tokens, smollm2-135m {dtype} "
                          f"({repeats} rounds, modes interleaved)",
                    columns=["mode", "best wall s", "median wall s", "time vs plain (median of rounds)",
                             "rounds' range", "p (paired)"])
    for mode in MODES:
        ratios = _ratios(times, mode, "plain")
        p = wilcoxon_signed_rank(np.log(ratios))[0] if mode != "plain" else float("nan")
        result.rows.append([mode, f"{min(times[mode]):.2f}", f"{statistics.median(times[mode]):.2f}",
                            f"{statistics.median(ratios):.3f}x", f"{min(ratios):.2f}-{max(ratios):.2f}x",
                            "" if mode == "plain" else f"{p:.3f}"])
    result.results["telemetry.cost"] = f"{_ratio(times, 'telemetry', 'plain'):.3f}"
    result.results["telemetry.cost_with_directions"] = f"{_ratio(times, 'telemetry+directions', 'plain'):.3f}"
    result.results["telemetry.directions_alone"] = f"{_ratio(times, 'directions', 'plain'):.3f}"
    result.results["gate.cost"] = f"{_ratio(times, 'when-drifting', 'instaboost'):.3f}"
    result.results["gate.steered"] = f"{steered} of {len(USERS)}"
    result.notes.append(f"when-drifting: the gate steered {steered} of {len(USERS)} replies; its cost vs always "
                        f"on is {_ratio(times, 'when-drifting', 'instaboost'):.3f}x")
    return result
