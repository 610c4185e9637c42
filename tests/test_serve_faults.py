"""`driftlab serve` under faults and load: one client cannot break the others.

Real HTTP on loopback, the real model. Each test is bounded in time: the model is the
135M one and replies are a few tokens, except where a request must be long on purpose.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from devices import backend_device, on_cpu
from driftlab.chat import Sampling, chat
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from driftlab.serve.background import free_port

MODEL = "smollm2-135m"
TIMEOUT = 300  # the 2-core CI machine can be slow; no test relies on this limit


@pytest.fixture(scope="module")
def backend(smol_dir):
    from driftlab.chat.hf import HFChatBackend

    b = HFChatBackend(str(smol_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=8 << 20)
    b.name = MODEL
    return b


def body(content: str = "Hi!", max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def long_body(tokens: int, **extra) -> dict:
    """A request that decodes exactly `tokens` tokens (vLLM's ignore_eos)."""
    return body("Count from one to a thousand.", tokens, ignore_eos=True, **extra)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "type" in err and "param" in err
    return err


class Faulty:
    """The real backend, failing every batch that holds a conversation saying POISON: a fault
    inside the model, which no check before the batch can see."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def generate(self, request):
        if any("POISON" in m["content"] for c in request.conversations for m in c):
            raise RuntimeError("injected fault")
        return self.real.generate(request)


def test_a_poisoned_batch_fails_only_its_poison(backend, smol32):
    """Oversized, unencodable, deeply nested and model-crashing requests among 6 normal ones,
    all queued into one batch window: the 6 normal ones get the replies they get alone."""
    app = create_app(Faulty(backend), ServeSettings(max_batch_size=32, max_wait_ms=300, max_tokens_limit=64))
    prompts = [f"Name a colour, please ({i})." for i in range(6)]
    oversize = json.dumps(body("word " * 9000)).encode()  # > the 8192-token context window
    surrogate = json.dumps(body("hi")).replace('"hi"', '"hi \\ud800"').encode()
    poisons = {"oversize": oversize, "surrogate": surrogate, "deep": b"[" * 100_000,
               "crash": json.dumps(body("POISON")).encode()}

    async def send_all(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            def post(content: bytes):
                return client.post(f"{url}/v1/chat/completions", content=content,
                                   headers={"content-type": "application/json"})
            return await asyncio.gather(*[post(json.dumps(body(p)).encode()) for p in prompts],
                                        *[post(c) for c in poisons.values()])

    with serving(app) as url:
        responses = asyncio.run(send_all(url))
        sizes = app.state.batcher.sizes_since(0)
    normal, bad = responses[:6], dict(zip(poisons, responses[6:]))
    for p, r in zip(prompts, normal):
        assert r.status_code == 200, r.text
        alone = chat(backend, [[{"role": "user", "content": p}]], Sampling(max_new_tokens=8, temperature=0))[0]
        assert r.json()["choices"][0]["message"]["content"] == alone.text
    assert "context window of 8192" in openai_error(bad["oversize"], 422)["message"]
    assert "surrogate" in openai_error(bad["surrogate"], 400)["message"]
    assert "nests JSON too deeply" in openai_error(bad["deep"], 400)["message"]
    err = openai_error(bad["crash"], 500)
    assert err["type"] == "server_error" and "injected" not in err["message"]  # no internals leak
    assert max(sizes) > 1  # the crash really shared a batch with normal requests, then was isolated


def test_framework_errors_are_openai_json_and_types_are_strict(backend):
    app = create_app(backend, ServeSettings(docs=False))
    with serving(app) as url:
        assert "Invalid URL (POST /v1/completions)" in openai_error(
            httpx.post(f"{url}/v1/completions", json={}, timeout=TIMEOUT), 404)["message"]
        r = httpx.get(f"{url}/v1/chat/completions", timeout=TIMEOUT)
        openai_error(r, 405)
        assert "POST" in r.headers["allow"]
        for field, value in (("max_tokens", True), ("temperature", "0.5"), ("stream", 1), ("seed", 1.5)):
            err = openai_error(httpx.post(f"{url}/v1/chat/completions", json=body(**{field: value}),
                                          timeout=TIMEOUT), 422)
            assert err["param"] == field
        assert httpx.get(f"{url}/docs", timeout=TIMEOUT).status_code == 404  # --no-docs
        assert httpx.get(f"{url}/openapi.json", timeout=TIMEOUT).status_code == 404
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    assert "driftlab_queue_depth 0.0" in metrics
    assert 'driftlab_responses_total{code="404"} 3.0' in metrics
    assert 'driftlab_responses_total{code="422"} 4.0' in metrics


def _timed(url: str, payload: dict) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def _tokens_generated(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith("driftlab_generated_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no token counter in /metrics")


@pytest.mark.parametrize("how", ["plain", "stream"])
def test_a_client_that_leaves_frees_its_slot_within_a_step(backend, how):
    """A 160-token request abandoned after a moment (a client timeout, or a stream closed
    after 2 chunks) stops decoding: a 2-token request sent right after answers within twice
    its idle latency, and far fewer than 160 tokens are generated for the abandoned one.
    (Best of 3 trials, so a busy machine's noise does not decide.)"""
    app = create_app(backend, ServeSettings(max_tokens_limit=256))
    small = body("Hello!", 2)

    def leave() -> None:
        if how == "plain":
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/chat/completions", json=long_body(160), timeout=0.5)
            return
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long_body(160, stream=True),
                          timeout=TIMEOUT) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data:")
                if events == 3:  # the role chunk, then 2 content chunks: close the stream
                    return

    with serving(app) as url:
        _timed(url, small)  # warm-up
        ratios, abandoned = [], []
        for _ in range(3):  # idle and after-leaving measured side by side, as the machine's load drifts
            idle = min(_timed(url, small) for _ in range(2))
            before = _tokens_generated(url)
            leave()
            ratios.append(_timed(url, small) / idle)
            abandoned.append(_tokens_generated(url) - before - 2)
    assert min(ratios) < 2, ratios
    assert max(abandoned) < 100, abandoned


def test_a_full_queue_answers_429_with_retry_after(backend):
    app = create_app(backend, ServeSettings(max_batch_size=1, max_wait_ms=0, max_queue=2, max_tokens_limit=256))

    async def flood(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            first = asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=long_body(48)))
            while (await client.get(f"{url}/health")).json()["in_flight"] < 1:  # decoding, queue empty
                await asyncio.sleep(0.01)
            rest = await asyncio.gather(*[client.post(f"{url}/v1/chat/completions", json=body(f"Hi {i}", 2))
                                          for i in range(5)])
            return await first, rest

    with serving(app) as url:
        first, rest = asyncio.run(flood(url))
    assert first.status_code == 200
    codes = sorted(r.status_code for r in rest)
    assert codes == [200, 200, 429, 429, 429], codes
    refused = next(r for r in rest if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and openai_error(refused, 429)["type"] == "rate_limit_error"


def test_a_request_past_its_deadline_ends_with_504_and_frees_the_server(backend):
    app = create_app(backend, ServeSettings(request_timeout=0.5, max_tokens_limit=512))
    with serving(app) as url:
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/chat/completions", json=long_body(500), timeout=TIMEOUT)
        took = time.perf_counter() - start
        assert openai_error(r, 504)["type"] == "timeout_error" and took < 5, took
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long_body(500, stream=True),
                          timeout=TIMEOUT) as s:
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
        assert _timed(url, body("Hello!", 2)) < 5


def test_memory_stays_flat_over_10_rounds_of_32_clients(smol_dir):
    """RSS after 10 rounds of 32 concurrent clients stays within 10% of RSS after round 1:
    the prefix cache is capped (--prefix-cache-mb) and no record of past work grows."""
    from driftlab.chat.hf import HFChatBackend

    settings = ServeSettings(prefix_cache_mb=16)
    b = HFChatBackend(str(smol_dir), dtype="float32", device=backend_device(),
                      prefix_cache_bytes=settings.prefix_cache_bytes)
    b.name = MODEL
    app = create_app(b, settings)

    async def round_of(url, r):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            rs = await asyncio.gather(*[client.post(f"{url}/v1/chat/completions",
                                                    json=body(f"Tell me a fact about {r * 32 + i}.", 8))
                                        for i in range(32)])
        assert [x.status_code for x in rs] == [200] * 32

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with serving(app) as url:
        asyncio.run(round_of(url, 0))
        first = rss()
        for r in range(1, 10):
            asyncio.run(round_of(url, r))
        last = rss()
        assert 0 < b.prefix_cache.nbytes <= 16 << 20
    assert last <= 1.10 * first, (first >> 20, last >> 20)


def test_deterministic_replies_do_not_depend_on_their_batch_in_bfloat16(smol_dir):
    """In bfloat16 a batch changes the arithmetic, and with it greedy text; --deterministic
    decodes each request alone, so a reply is the same alone and among 8 concurrent ones."""
    from driftlab.chat.hf import HFChatBackend

    prompts = [f"Write a long sentence about the number {i} and why it matters." for i in range(8)]
    # Without a prefix cache: with one, the batch reuses each prompt's KV computed alone, and on
    # some CPUs (AMX) the batched decode steps then match the single ones exactly.
    plain = HFChatBackend(str(smol_dir), dtype="bfloat16", device=backend_device(), prefix_cache_bytes=0)
    alone = [chat(plain, [[{"role": "user", "content": p}]], Sampling(max_new_tokens=24, temperature=0))[0].text
             for p in prompts]
    batched = chat(plain, [[{"role": "user", "content": p}] for p in prompts],
                   Sampling(max_new_tokens=24, temperature=0))
    if on_cpu():  # that these prompts show it was seen on the CPU; on a GPU the check below still holds
        assert any(a != b.text for a, b in zip(alone, batched)), "bf16 batching changed nothing: pick other prompts"

    b = HFChatBackend(str(smol_dir), dtype="bfloat16", device=backend_device(),
                      prefix_cache_bytes=ServeSettings(deterministic=True).prefix_cache_bytes)
    b.name = MODEL
    app = create_app(b, ServeSettings(deterministic=True, max_wait_ms=200))

    async def ask_all(url):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(*[client.post(f"{url}/v1/chat/completions", json=body(p, 24))
                                          for p in prompts])

    with serving(app) as url:
        responses = asyncio.run(ask_all(url))
        assert set(app.state.batcher.sizes_since(0)) == {1}
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == alone


# -- the whole server process: drain on SIGTERM, exposure ---------------------------------------
@contextmanager
def server_process(smol_dir, *args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "driftlab", "serve", "--model", str(smol_dir), "--port", str(port),
                             "--dtype", "float32", "--device", backend_device(), "--served-model-name", MODEL, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.3)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_drains_finishes_what_it_can_ends_the_rest_cleanly_and_exits_0(smol_dir):
    """2 plain + 2 streamed requests in flight at SIGTERM, one of each short and one too long
    for --graceful-timeout 20: the short ones complete, the long plain one gets 503 JSON, the
    long stream an error event then [DONE]; a request sent while draining gets 503; exit 0."""
    with server_process(smol_dir, "--graceful-timeout", "20", "--max-tokens-limit", "4000") as (proc, url):
        async def scenario():
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                async def stream(payload):
                    async with client.stream("POST", f"{url}/v1/chat/completions", json=payload) as r:
                        return r.status_code, [x.removeprefix("data: ") async for x in r.aiter_lines()
                                               if x.startswith("data:")]

                def plain(payload):
                    return client.post(f"{url}/v1/chat/completions", json=payload)

                async def accepted(n: int, tasks) -> None:
                    while (await client.get(f"{url}/health")).json()["in_flight"] + sum(t.done() for t in tasks) < n:
                        await asyncio.sleep(0.02)

                # A first request keeps the model busy while the four queue up, so they share the
                # next batch (a request cannot join a batch that is already decoding).
                gate = asyncio.create_task(plain(long_body(40)))
                await accepted(1, [gate])
                tasks = [gate, *(asyncio.create_task(c) for c in (
                    plain(long_body(12)), stream(long_body(12, stream=True)),
                    plain(long_body(4000)), stream(long_body(4000, stream=True))))]
                await accepted(5, tasks)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                late = await client.post(f"{url}/v1/chat/completions", json=body())
                return late, await asyncio.gather(*tasks)

        late, (gate, short, short_stream, long, long_stream) = asyncio.run(scenario())
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
    openai_error(late, 503)
    assert gate.status_code == 200, gate.text
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 12, short.text
    assert short_stream[0] == 200 and short_stream[1][-1] == "[DONE]"
    assert json.loads(short_stream[1][-2])["choices"][0]["finish_reason"] == "length"
    assert "--graceful-timeout" in openai_error(long, 503)["message"]
    assert long_stream[0] == 200 and long_stream[1][-1] == "[DONE]"
    assert json.loads(long_stream[1][-2])["error"]["code"] == 503
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_an_api_key_file_guards_an_exposed_server(smol_dir, tmp_path):
    key = tmp_path / "key.txt"
    key.write_text("file-key-123\n")
    with server_process(smol_dir, "--host", "0.0.0.0", "--api-key-file", str(key)) as (proc, url):
        assert httpx.post(f"{url}/v1/chat/completions", json=body(max_tokens=1), timeout=TIMEOUT).status_code == 401
        r = httpx.post(f"{url}/v1/chat/completions", json=body(max_tokens=1), timeout=TIMEOUT,
                       headers={"Authorization": "Bearer file-key-123"})
        assert r.status_code == 200


# -- the client side: a server that stops answering ----------------------------------------------
@contextmanager
def hanging_server():
    """A TCP server that accepts connections and never answers (a hung or SIGSTOPped server)."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()
        sock.close()


def test_the_client_gives_up_on_a_hung_server_with_one_line(tmp_path):
    with hanging_server() as base_url:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "driftlab", "chat", "--model", "openai:any", "--base-url", base_url,
                              "--timeout", "1", "--max-retries", "1", "Hello"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={**os.environ, "OPENAI_API_KEY": "none"})
        took = time.monotonic() - start
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "failed 2 times" in error[0] and "no answer within 1 s (--timeout)" in error[0]
    assert took < 30, took  # 2 attempts of 1 s plus backoff, plus the CLI's start
