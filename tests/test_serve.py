"""`driftlab serve` over real HTTP: the OpenAI wire format, errors, batching, streaming, shutdown.

Replies, steers and batching on the real model (SmolLM2-135M); streaming's reassembly on a tiny
random Llama (`tiny_backend`, also the server of test_serve_completions' and
test_serve_openai_compat's wire-format checks), where a step costs a millisecond."""

from __future__ import annotations

import asyncio
import copy
import functools
import json

import httpx
import pytest

from driftlab.chat import Sampling, chat
from driftlab.serve import ServeSettings, TextStream, create_app
from driftlab.serve.background import background as serving

MODEL = "smollm2-135m"
KEY = "s3cret-key-for-tests"
post = functools.partial(httpx.post, timeout=300)  # the 2-core CI machine can be slow
get = functools.partial(httpx.get, timeout=300)


@pytest.fixture(scope="module")
def server_backend(smol32):
    """smol32 (float32, no prefix cache) under the served model's name: a shallow copy that shares
    its weights, not a second load of the same model."""
    return served_as(smol32, MODEL)


@pytest.fixture(scope="module")
def tiny_backend(tiny_llama):
    """A tiny random Llama (tests/tiny_models.py) served as MODEL, as server_backend is (float32, no
    prefix cache), for what the wire format does with a reply rather than what the reply says."""
    from devices import backend_device
    from driftlab.chat.hf import HFChatBackend

    return served_as(HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0), MODEL)


@pytest.fixture(scope="module")
def tiny_server(tiny_backend):
    with serving(create_app(tiny_backend, ServeSettings(max_tokens_limit=64))) as url:
        yield url


def served_as(backend, name: str):
    """`backend` under another name (the one a server serves it as); model, tokenizer and caches shared."""
    named = copy.copy(backend)
    named.name = name
    return named


@pytest.fixture(scope="module")
def server(server_backend):
    app = create_app(server_backend, ServeSettings(max_batch_size=32, max_wait_ms=50, max_tokens_limit=64,
                                                   max_messages=8, max_body_bytes=4096))
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def locked_server(server_backend):
    with serving(create_app(server_backend, ServeSettings(api_key=KEY))) as url:
        yield url


def body(content: str = "Hi!", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **extra}


def test_completion_has_the_openai_shape_and_honours_the_system_prompt(server, smol32):
    url, _ = server
    messages = [{"role": "system", "content": "Always reply in French."}, {"role": "user", "content": "Hi, how are you?"}]
    r = post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 12,
                                                       "temperature": 0, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    local = chat(smol32, [messages], Sampling(max_new_tokens=12, temperature=0))[0]
    assert choice["message"] == {"role": "assistant", "content": local.text}
    assert choice["finish_reason"] == local.finish_reason
    assert out["usage"]["completion_tokens"] == local.n_tokens == len(choice["logprobs"]["content"])
    assert out["usage"]["prompt_tokens"] > 10 and out["object"] == "chat.completion"
    first = choice["logprobs"]["content"][0]
    assert len(first["top_logprobs"]) == 3 and first["token"] == first["top_logprobs"][0]["token"]  # greedy
    assert all(a["logprob"] >= b["logprob"] for a, b in zip(first["top_logprobs"], first["top_logprobs"][1:]))


def test_per_request_steer_replaces_the_default_and_changes_the_reply(server, smol32):
    url, _ = server
    conv = [{"role": "system", "content": "Always reply in French."}, {"role": "user", "content": "What is your hobby?"}]
    req = {"model": MODEL, "messages": conv, "max_tokens": 16, "temperature": 0}
    plain = post(f"{url}/v1/chat/completions", json=req).json()
    steered = post(f"{url}/v1/chat/completions", json={**req, "driftlab": {"steer": "split-softmax:k=0.3"}})
    assert steered.status_code == 200 and steered.json()["driftlab"]["steer"] == ["split-softmax:k=0.3,heads=all"]
    local = chat(smol32, [conv], Sampling(max_new_tokens=16, temperature=0), steer=["split-softmax:k=0.3"])[0]
    assert steered.json()["choices"][0]["message"]["content"] == local.text
    assert local.text != plain["choices"][0]["message"]["content"]


@pytest.mark.parametrize("payload, status, param", [
    (b"{not json", 400, None),
    (body(temperature="hot"), 422, "temperature"),
    (body(max_tokens=0), 422, "max_tokens"),
    (body(max_tokens=65), 422, "max_tokens"),  # above the server's limit of 64
    ({**body(), "messages": [{"role": "robot", "content": "x"}]}, 422, "messages.0.role"),
    ({**body(), "messages": []}, 422, "messages"),
    ({**body(), "messages": [{"role": "user", "content": "x"}] * 9}, 422, "messages"),  # limit 8
    (body(driftlab={"steer": "split-softmax:k=7"}), 422, "driftlab.steer"),
    (body(driftlab={"steer": "warp:factor=2"}), 422, "driftlab.steer"),
    (body(n=17), 422, "n"),  # at most 16 choices
    (body(stop=["a", "b", "c", "d", "e"]), 422, "stop"),  # OpenAI's limit: 4
    ({**body(), "model": "gpt-4o"}, 404, "model"),
    (body("x" * 5000), 413, None),  # body limit 4096 bytes
])
def test_bad_requests_get_the_right_status_and_name_the_field(server, payload, status, param):
    url, _ = server
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = post(f"{url}/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]


def test_oversized_chunked_body_is_refused_without_a_content_length(server):
    url, _ = server

    def parts():
        yield b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    r = post(f"{url}/v1/chat/completions", content=parts())
    assert r.status_code == 413


def test_bearer_auth(locked_server):
    url = locked_server
    ok = {"Authorization": f"Bearer {KEY}"}
    assert post(f"{url}/v1/chat/completions", json=body()).status_code == 401
    assert post(f"{url}/v1/chat/completions", json=body(),
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert get(f"{url}/v1/models").status_code == 401
    assert post(f"{url}/v1/chat/completions", json=body(), headers=ok).status_code == 200
    assert get(f"{url}/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
    assert get(f"{url}/health").json()["status"] == "ok"  # liveness needs no key


def test_16_concurrent_clients_are_batched_and_match_sequential_greedy(server, smol32):
    """16 clients at once (each reply then decoded alone, to compare: that is most of this test's time)."""
    url, app = server
    prompts = [f"Tell me one fact about the number {i}." for i in range(16)]
    before, joined = app.state.batcher.n_batches, app.state.batcher.n_admitted

    async def ask_all():
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*[client.post(f"{url}/v1/chat/completions", json=body(p, max_tokens=4))
                                        for p in prompts])
        return rs

    responses = asyncio.run(ask_all())
    assert [r.status_code for r in responses] == [200] * len(prompts)
    texts = [r.json()["choices"][0]["message"]["content"] for r in responses]
    for p, text in zip(prompts, texts):
        alone = chat(smol32, [[{"role": "user", "content": p}]], Sampling(max_new_tokens=4, temperature=0))[0]
        assert text == alone.text, p
    sizes = app.state.batcher.sizes_since(before)
    # batched, not one at a time: rows that joined a running batch (continuous batching, where the
    # first batch starts before all 32 arrive) count with the batch they joined
    assert sum(sizes) + app.state.batcher.n_admitted - joined == len(prompts) and len(sizes) < len(prompts)


@pytest.mark.model
def test_streamed_chunks_reassemble_to_the_reply(tiny_server):
    """On the tiny model: its sampled text (random tokens of the whole vocabulary) is a hard case
    for the chunks' hold-back rules."""
    import openai

    url = tiny_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=7)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=7,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 5  # really streamed, not one blob
    assert "".join(pieces) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


class _WordTokenizer:
    """Decodes ids to fixed strings, for TextStream's hold-back rules."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_text_stream_holds_back_what_the_final_text_may_drop():
    plain = TextStream(_WordTokenizer(["  Hi", " there", "\n", "\ufffd"]).decode)
    # leading space stripped as in the reply; trailing newline and a broken character wait
    assert [plain.push(i) for i in range(4)] == ["Hi", " there", "", ""]
    assert plain.finish("Hi there") == ""
    stops = TextStream(_WordTokenizer(["  Hello", " wor", "ld", "\n", "<|u", "ser|>"]).decode, ("<|user|>",))
    deltas = [stops.push(i) for i in range(6)]
    assert deltas[0] == "" and all("<" not in d and "\n" not in d for d in deltas)  # held back, then dropped
    assert "".join(deltas) + stops.finish("Hello world") == "Hello world"
    late = TextStream(_WordTokenizer(["Hi", " you"]).decode)
    assert late.push(0) == "Hi" and late.finish("Hi you") == " you"  # what is unsent comes at the end


def test_a_request_never_makes_the_server_open_a_file(server_backend, tmp_path, smol32):
    """pasta:heads= in a request names a registered head set or lists heads; a path is refused
    without opening it, so nothing of a file (its content, whether it exists) reaches the client."""
    from driftlab.steering.heads import save_heads

    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"api_token": "s3cr3t-value-xyz"}))
    heads = save_heads([(0, 1), (3, 2)], tmp_path / "heads.json")
    settings = ServeSettings(heads={"json-heads": str(heads)}, max_tokens_limit=16)
    with serving(create_app(server_backend, settings)) as url:
        conv = [{"role": "user", "content": "*Answer in JSON.* Who is Mary?"}]
        req = {"model": MODEL, "messages": conv, "max_tokens": 8, "temperature": 0}
        for path in (str(secret), "/etc/passwd", str(tmp_path / "missing.json"), "../heads.json"):
            r = post(f"{url}/v1/chat/completions", json={**req, "driftlab": {"steer": f"pasta:heads={path}"}})
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["param"] == "driftlab.steer" and "cannot name a file" in err["message"]
            assert "s3cr3t" not in r.text and "api_token" not in r.text and "exist" not in r.text
        named = post(f"{url}/v1/chat/completions", json={**req, "driftlab": {"steer": "pasta:heads=json-heads"}})
        inline = post(f"{url}/v1/chat/completions", json={**req, "driftlab": {"steer": "pasta:heads=0.1+3.2"}})
        assert named.status_code == inline.status_code == 200, named.text
        assert named.json()["driftlab"]["steer"] == inline.json()["driftlab"]["steer"]  # the heads themselves
        assert named.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
        listed = get(f"{url}/v1/models").json()["data"][0]["driftlab"]
        assert listed["heads"] == ["json-heads"]
    with pytest.raises(ValueError, match="starts with a letter"):
        ServeSettings(heads={"3.1": str(heads)})  # would shadow a head selection
