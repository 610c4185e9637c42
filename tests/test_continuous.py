"""Continuous batching: rows that join a running decode batch (`ChatRequest.admit`) get the tokens
they get alone (their logits to float32 rounding, so a draw at a near tie may part), plain, under a
key bias, along a persona direction, traced, greedy and seeded; a batch keeps only the cache slots
its live rows attend to; their KV goes to the prefix cache as a lone row's does; and over HTTP a
short request sent while a long one decodes joins its batch and finishes first.

The real model (SmolLM2-135M, float32) decodes the richest join (a key bias and pi traced, along a
persona direction) and the HTTP scenes; the other options and the bookkeeping run on a tiny random
Llama (tests/tiny_models.py: a step costs a millisecond, not ~30 ms), each test checking there that
its conditions change the tokens, so that its equalities cannot hold vacuously."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import numpy as np
import pytest
import torch

from devices import backend_device, tol
from driftlab.chat import ChatRequest, Sampling, decoding
from driftlab.chat.hf import HFChatBackend
from driftlab.chat.sampling import sample, uniform, warpers
from driftlab.errors import DriftlabError
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from driftlab.steering.interventions import Interventions
from test_activation import FRENCH, synthetic

USERS = ["Hi!", "Tell me about the sea in detail, please, with many words.", "What is 2+2?", "Name a colour.",
         "Describe a cat.", "Why is the sky blue?"]
CONVS = [[{"role": "system", "content": FRENCH}, {"role": "user", "content": u}] for u in USERS]
LIMITS = [14, 6, 10, 14, 3, 12]
WAVES = [[2, 3], [], [4, 5]]  # the rows admit() gives at the 1st, 2nd and 3rd step boundary


@pytest.fixture(scope="module")
def tiny32(tiny_llama) -> HFChatBackend:
    """A tiny random Llama as smol32 is: float32, no prefix cache."""
    return HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


def waves_of(sampling: Sampling, steer: Interventions, waves=WAVES):
    """A first request of rows 0-1 whose admit() gives the rows of each wave in turn."""
    left = [list(w) for w in waves]

    def request(rows: list[int], **extra) -> ChatRequest:
        return ChatRequest([CONVS[i] for i in rows], sampling, seeds=[100 + i for i in rows], interventions=steer,
                           row_max_tokens=[LIMITS[i] for i in rows], **extra)

    def admit() -> ChatRequest | None:
        rows = left.pop(0) if left else []
        return request(rows) if rows else None

    return request([0, 1], admit=admit), request


@pytest.mark.model
@pytest.mark.parametrize("model, steer, sampling", [
    pytest.param("tiny32", [], Sampling(greedy=True, max_new_tokens=14), id="plain-greedy"),
    pytest.param("tiny32", ["instaboost:m=5"], Sampling(temperature=1.0, top_p=0.9, max_new_tokens=14),
                 id="instaboost-seeded"),
    pytest.param("tiny32", ["vector:alpha=4"], Sampling(greedy=True, max_new_tokens=14), id="vector-greedy"),
    pytest.param("smol32", ["split-softmax:k=0.7", "trace"], Sampling(greedy=True, max_new_tokens=14),
                 id="traced-greedy"),
])
def test_rows_that_join_a_running_batch_decode_as_they_do_alone(request, model, steer, sampling, monkeypatch) -> None:
    """The richest case (a key bias, pi traced, a persona direction's projection) on SmolLM2; the
    others on the tiny model, where a steered lone run must differ from a plain one."""
    backend = request.getfixturevalue(model)
    together_draws, alone_draws = Draws(), Draws()
    backend.use_directions(synthetic(backend.shape.layers, backend.d_model, [FRENCH]))
    try:
        iv = Interventions.parse(steer)
        first, rows_of = waves_of(sampling, iv)
        monkeypatch.setattr(decoding, "sample", together_draws)
        together = backend.generate(first)
        monkeypatch.setattr(decoding, "sample", alone_draws)
        alone = [backend.generate(rows_of([i]))[0] for i in range(len(CONVS))]
        monkeypatch.setattr(decoding, "sample", sample)
        plain = backend.generate(waves_of(sampling, Interventions())[0]) if steer and model == "tiny32" else None
    finally:
        backend.use_directions(None)
    assert len(together) == len(CONVS)
    assert len({tuple(r.token_ids) for r in alone}) == len(CONVS)  # each row's own tokens, not one repeated
    if plain is not None:  # the steer changes the tokens, so the rows' equalities below have teeth
        assert [r.token_ids for r in plain] != [r.token_ids for r in together]
    parted = 0
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        if not same_draws(got.token_ids, want.token_ids, 100 + i, together_draws, alone_draws, warpers(sampling)):
            parted += 1  # at a near tie: the rest of the row follows another token
            continue
        assert got.finish_reason == want.finish_reason and got.n_prompt_tokens == want.n_prompt_tokens
        if want.activation is not None:  # the projection each row recorded, joined or alone
            for key in ("prompt", "reply", "last"):
                assert got.activation[key] == pytest.approx(want.activation[key], abs=1e-4)
        assert (got.trace is None) == (want.trace is None) == ("trace" not in steer)
        if want.trace is not None:  # pi at each reply token, per layer and head: joined, left or alone
            assert got.trace.decode.shape == want.trace.decode.shape  # a step per sampled token, a final EOS too
            assert len(want.trace.decode) == len(want.trace.generated_tokens) >= len(want.token_ids)
            np.testing.assert_allclose(got.trace.decode, want.trace.decode, atol=tol(1e-5), rtol=0)
    assert [len(r.token_ids) for r in together][4] <= 3  # row 4's own limit held after it joined
    assert parted <= 1, f"{parted} of {len(CONVS)} rows parted at near ties: more than float noise makes"


class Draws:
    """Stands in for the decode loop's `sample` and keeps each row's logits by (seed, step): every
    row here has its own seed, so a joined row's draws can be matched to its lone run's."""

    def __init__(self) -> None:
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, logits, chain, seeds, steps):
        for row, key in enumerate(zip(seeds, steps, strict=True)):
            self.logits[key] = logits[row].detach().clone()
        return sample(logits, chain, seeds, steps)


def same_draws(got: list[int], want: list[int], seed: int, together: Draws, alone: Draws, chain) -> bool:
    """True when a joined row's tokens are its lone run's. A row's logits joined and alone differ by
    float32 rounding (other matmul shapes: ~4e-5 here), so a draw that lands that close to a tie may
    go the other way (seen: u 2.5e-7 from a CDF step on one CPU). Where the tokens part, the logits
    must still agree at every step up to there, and the lone draw must have been a near tie there;
    a wrong row, seed or step fails one of the two."""
    if got == want:
        return True
    n = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    for step in range(n + 1):
        torch.testing.assert_close(together.logits[seed, step], alone.logits[seed, step], atol=1e-3, rtol=0)
    logits = alone.logits[seed, n]
    if chain is None:  # greedy: the two tokens' logits within rounding of each other
        assert logits[want[n]] - logits[got[n]] < 1e-4, (seed, n, got[n], want[n])
        return False
    cdf = torch.softmax(chain(None, logits[None].clone()), -1)[0].double().cumsum(0)
    u = uniform(seed, n) * cdf[-1].item()
    margin = min(u - (cdf[want[n] - 1].item() if want[n] else 0.0), cdf[want[n]].item() - u)
    assert 0 <= margin < 1e-5, (seed, n, margin)
    return False


JOINERS = 20


@pytest.mark.model
def test_a_batch_that_rows_keep_joining_keeps_only_its_live_rows_slots(tiny32, monkeypatch) -> None:
    """A row joins at every step boundary for 20 steps, each leaving 6 tokens later: the batch lives
    for about 26 steps, but each step's cache holds only what its live rows attend to (a row's
    prompt and reply, at most), not a slot for every step the batch has lived (that would be 20
    slots past the longest prompt, where the prompts differ by fewer). The last joiners still get
    the tokens they get alone."""
    widths: list[int] = []
    feed = decoding.Decoding.feed

    def measured(self, nxt):
        feed(self, nxt)
        widths.append(self.mask.shape[1])
        assert all(layer.keys.shape[2] == widths[-1] for layer in self.cache.layers)

    monkeypatch.setattr(decoding.Decoding, "feed", measured)
    sampling = Sampling(greedy=True, max_new_tokens=6, ignore_eos=True)
    joiners = [[CONVS[i % len(CONVS)]] for i in range(JOINERS)]

    def admit() -> ChatRequest | None:
        return ChatRequest(joiners.pop(0), sampling) if joiners else None

    together = tiny32.generate(ChatRequest(CONVS[:2], sampling, admit=admit))
    longest = max(len(tiny32.render(c).ids) for c in CONVS)
    shortest = min(len(tiny32.render(c).ids) for c in CONVS)
    assert shortest + JOINERS > longest + 6  # a slot per step lived would break the bound below
    assert len(together) == JOINERS + 2 and len(widths) >= JOINERS + 5
    assert max(widths) <= longest + 6, (max(widths), longest)
    alone = tiny32.generate(ChatRequest([CONVS[i % len(CONVS)] for i in range(JOINERS - 3, JOINERS)], sampling))
    assert [r.token_ids for r in together[-3:]] == [r.token_ids for r in alone]


@pytest.mark.model
def test_joined_rows_store_their_prefixes_as_a_lone_row_does(tiny_llama, tiny32) -> None:
    """A follow-up turn on a joined row's reply reuses the KV the batch stored and decodes as without it
    (as tiny32 decodes it: the same model and dtype, with no prefix cache)."""
    cached = HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=64 << 20)
    plain = tiny32
    assert plain.prefix_cache.max_bytes == 0
    greedy = Sampling(greedy=True, max_new_tokens=14)
    first, _ = waves_of(greedy, Interventions())
    replies = cached.generate(first)
    follow = [[*CONVS[i], {"role": "assistant", "content": replies[i].text}, {"role": "user", "content": "Why?"}]
              for i in (3, 5)]  # rows that joined at the 1st and 3rd step
    hits_before = cached.prefix_cache.hits_tokens
    again = cached.generate(ChatRequest(follow, greedy))
    assert cached.prefix_cache.hits_tokens > hits_before
    assert [r.token_ids for r in again] == [r.token_ids for r in plain.generate(ChatRequest(follow, greedy))]


@pytest.mark.model
@pytest.mark.parametrize("first_traced", [False, True], ids=["traced-join-plain", "plain-join-traced"])
def test_traced_and_untraced_rows_share_a_running_batch(tiny32, first_traced: bool) -> None:
    """Telemetry's pi trace is per row: traced rows join a running untraced batch (and untraced rows
    a traced one) and each row gets what it gets alone: its tokens, and its pi at every step
    where it asked for it, none where it did not."""
    greedy = Sampling(greedy=True, max_new_tokens=14)
    steers = [Interventions(), Interventions.parse(["trace"])]
    steer_of = [steers[first_traced], steers[not first_traced]]  # rows 0-1 and 4-5, then rows 2-3

    def request(rows: list[int], **extra) -> ChatRequest:
        return ChatRequest([CONVS[i] for i in rows], greedy, interventions=steer_of[rows[0] in (2, 3)],
                           row_max_tokens=[LIMITS[i] for i in rows], **extra)

    left = [list(w) for w in WAVES]

    def admit() -> ChatRequest | None:
        rows = left.pop(0) if left else []
        return request(rows) if rows else None

    together = tiny32.generate(request([0, 1], admit=admit))
    alone = [tiny32.generate(request([i]))[0] for i in range(len(CONVS))]
    assert len(together) == len(CONVS)
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert got.token_ids == want.token_ids, (i, got.text, want.text)
        traced = "trace" in steer_of[i in (2, 3)].kinds
        assert (got.trace is None) == (want.trace is None) == (not traced)
        if traced:
            assert got.trace.decode.shape == want.trace.decode.shape
            np.testing.assert_allclose(got.trace.decode, want.trace.decode, atol=tol(1e-5), rtol=0)


def test_rows_of_another_sampling_are_refused_and_a_prefill_trace_takes_none(smol32) -> None:
    greedy = Sampling(greedy=True, max_new_tokens=6)
    other = ChatRequest([CONVS[2]], Sampling(temperature=0.5, max_new_tokens=6))
    with pytest.raises(DriftlabError, match="must share its sampling"):
        smol32.generate(ChatRequest([CONVS[0]], greedy, admit=lambda: other))
    asked = []
    traced = ChatRequest([CONVS[0]], greedy, interventions=Interventions.parse(["trace:prefill=true"]),
                         admit=lambda: asked.append(1))
    (reply,) = smol32.generate(traced)
    assert not asked and reply.trace.prefill is not None  # prefill traces are laid out per batch: no row joins


def test_a_short_request_joins_a_long_one_and_finishes_first(smol32) -> None:
    """Sent once a 64-token request streams, a 5-token one of the same sampling joins its batch
    (continuous) and ends before it, with the tokens it gets alone; under --batching static it
    waits for the long one. Once the short reply is in, a continuous run has shown its order, so
    the long stream's client leaves then instead of reading its remaining tokens."""
    long = {"model": smol32.name, "messages": CONVS[1], "max_tokens": 64, "ignore_eos": True, "temperature": 0,
            "stream": True}
    short = {"model": smol32.name, "messages": CONVS[2], "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    (alone,) = smol32.generate(ChatRequest([CONVS[2]], Sampling(greedy=True, max_new_tokens=5, ignore_eos=True)))

    async def race(url: str, extra: dict, wait_for_long: bool) -> tuple[dict, list[str]]:
        order: list[str] = []
        async with httpx.AsyncClient(timeout=600) as http:
            streaming = asyncio.Event()

            async def run_long() -> None:
                async with http.stream("POST", f"{url}/v1/chat/completions", json=long) as r:
                    async for line in r.aiter_lines():
                        if '"content": "' in line and not streaming.is_set():
                            streaming.set()
                order.append("long")

            task = asyncio.create_task(run_long())
            await streaming.wait()
            reply = (await http.post(f"{url}/v1/chat/completions", json={**short, **extra})).json()
            order.append("short")
            if not wait_for_long and not task.done():
                task.cancel()  # closes the stream: its row leaves the batch
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return reply, order

    telemetry = {"driftlab": {"telemetry": True}}  # a traced row joins the plain stream's batch too
    for batching, first, extra in (("continuous", "short", {}), ("continuous", "short", telemetry),
                                   ("static", "long", {})):
        app = create_app(smol32, ServeSettings(max_wait_ms=0, batching=batching))
        with serving(app) as url:
            reply, order = asyncio.run(race(url, extra, wait_for_long=batching == "static"))
            admitted = app.state.server.batcher.n_admitted
        assert order[0] == first, (batching, extra, order)
        choice = reply["choices"][0]
        assert choice["message"]["content"] == alone.text and choice["finish_reason"] == alone.finish_reason
        assert admitted == (1 if batching == "continuous" else 0)
        assert (reply.get("driftlab", {}).get("telemetry", {}).get("pi") is not None) == bool(extra)


def test_a_client_that_leaves_mid_stream_changes_no_other_rows_tokens(smol32) -> None:
    """Rows join a running stream and leave it (one client disconnects after its second chunk, one
    finishes early): every reply that completes has the tokens it gets alone."""
    def body(i: int, tokens: int, stream: bool = False) -> dict:
        return {"model": smol32.name, "messages": CONVS[i], "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0, "stream": stream}

    alone = {i: smol32.generate(ChatRequest([CONVS[i]], Sampling(greedy=True, max_new_tokens=n, ignore_eos=True)))[0]
             .text for i, n in ((0, 48), (3, 6), (5, 12))}

    async def scene(url: str) -> dict[int, str]:
        async with httpx.AsyncClient(timeout=600) as http:
            started = asyncio.Event()

            async def stream(i: int, tokens: int, leave_after: int | None = None) -> str:
                text, chunks = "", 0
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body(i, tokens, True)) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data:") or "[DONE]" in line:
                            continue
                        delta = json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                        text, chunks = text + delta, chunks + bool(delta)
                        started.set()
                        if leave_after is not None and chunks >= leave_after:
                            return "left"  # closes the connection mid-stream
                return text.strip()

            first = asyncio.create_task(stream(0, 48))
            await started.wait()
            leaving = asyncio.create_task(stream(1, 40, leave_after=2))
            short = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=body(3, 6)))
            await leaving
            later = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=body(5, 12)))
            return {0: await first, 3: (await short).json()["choices"][0]["message"]["content"],
                    5: (await later).json()["choices"][0]["message"]["content"]}

    app = create_app(smol32, ServeSettings(max_wait_ms=0))
    with serving(app) as url:
        got = asyncio.run(scene(url))
        admitted = app.state.server.batcher.n_admitted
    assert got == alone
    assert admitted >= 2  # the leaving and the short request joined the first one's batch


@pytest.mark.model
def test_rows_of_different_steers_share_a_running_batch_and_decode_as_alone(tiny32) -> None:
    """Plain rows first; split-softmax, InstABoost, a vector steer and system-prompt repetition rows
    join them at later steps (each steer's rows are per-row data in one batch): every row gets the
    tokens it gets alone."""
    tiny32.use_directions(synthetic(tiny32.shape.layers, tiny32.d_model, [FRENCH]))
    greedy = Sampling(greedy=True, max_new_tokens=10)
    steers = [[], ["split-softmax:k=0.7"], ["instaboost:m=5"], ["vector:alpha=4"], ["split-softmax:k=0.5,heads=1-2"]]  # heads=: layers 1-2 of 3
    rows = {0: [0, 1], 1: [2], 2: [3], 3: [4], 4: [5]}  # steer index -> rows
    queue = [ChatRequest([CONVS[i] for i in rows[k]], greedy, interventions=Interventions.parse(steers[k]))
             for k in (1, 2, 3, 4)]
    try:
        together = tiny32.generate(ChatRequest([CONVS[i] for i in rows[0]], greedy,
                                               admit=lambda: queue.pop(0) if queue else None))
        alone = [tiny32.generate(ChatRequest([CONVS[i]], greedy, interventions=Interventions.parse(steers[k])))[0]
                 for k, ids in rows.items() for i in ids]
        plain = tiny32.generate(ChatRequest(CONVS[2:], greedy))
    finally:
        tiny32.use_directions(None)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    # each steer changes its row's reply, so the rows' equalities have teeth
    assert all(p.token_ids != a.token_ids for p, a in zip(plain, alone[2:], strict=True))
