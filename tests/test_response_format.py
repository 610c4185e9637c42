"""`driftlab serve`'s `response_format` (issue 34, item 1): `json_object` and `json_schema`
constrain decoding with xgrammar (driftlab.chat.constrain), so greedy replies of a real model
parse as JSON and satisfy the schema; a plain request decodes as before; a schema xgrammar
cannot use is a 422 naming `response_format`; `{"type": "text"}` changes nothing (checked on a tiny
random Llama, tests/tiny_models.py, whose constrained and free replies differ at once)."""

from __future__ import annotations

import json

import httpx
import pytest

from driftlab.chat.base import Sampling
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from test_serve import MODEL, served_as, server_backend  # noqa: F401 - fixture

ASK = [{"role": "user", "content": "Describe a person as JSON with their name and age."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def url(server_backend):  # noqa: F811
    app = create_app(server_backend, ServeSettings(max_batch_size=8, max_wait_ms=20, max_tokens_limit=64))
    with serving(app) as base:
        yield base


@pytest.fixture(scope="module")
def tiny_url(tiny_llama):
    """A server of a tiny random Llama (under MODEL's name), for what holds for any weights."""
    from devices import backend_device
    from driftlab.chat.hf import HFChatBackend

    backend = HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0)
    app = create_app(served_as(backend, MODEL), ServeSettings(max_batch_size=8, max_wait_ms=20, max_tokens_limit=64))
    with serving(app) as base:
        yield base


def chat(url: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=300,
                      json={"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 48, **extra})


def reply(url: str, **extra) -> tuple[str, str]:
    r = chat(url, **extra)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_json_object_and_json_schema_replies_parse_and_validate(url):
    text, finish = reply(url, response_format={"type": "json_object"})
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    text, finish = reply(url, response_format=fmt)
    assert finish == "stop", text
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value["name"], str) and isinstance(value["age"], int) and not isinstance(value["age"], bool)
    else:
        jsonschema.validate(value, PERSON)


@pytest.mark.model  # a tiny model, but a server of its own
def test_plain_and_text_requests_decode_as_without_response_format(tiny_url):
    url = tiny_url
    short = {"max_tokens": 12}  # an unconstrained reply runs to the limit: 12 tokens compare as well as 48
    plain = reply(url, **short)
    assert reply(url, response_format={"type": "text"}, **short) == plain
    assert reply(url, response_format=None, **short) == plain
    assert reply(url, response_format={"type": "json_object"}, **short) != plain  # a constraint would show
    assert Sampling().model_dump() == Sampling(json_schema=None).model_dump()  # left out of dumps at its default
    assert "json_schema" not in Sampling().model_dump()


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema"},
    {"type": "yaml"},
])
def test_an_unusable_response_format_is_a_422_naming_it(url, fmt):
    r = chat(url, response_format=fmt)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert "response_format" in (err.get("param") or "") and "response_format" in err["message"], err


def test_the_openai_backend_asks_its_server_for_the_schema(url, server_backend, tmp_path):  # noqa: F811
    """Sampling.json_schema through an OpenAI-compatible backend is sent as response_format (not
    dropped): against driftlab serve, the remote reply is the local constrained one."""
    from driftlab.chat.base import ChatRequest
    from driftlab.chat.constrain import canonical_schema
    from driftlab.chat.openai import OpenAIChatBackend
    from driftlab.chat.spec import Runtime

    sampling = Sampling(max_new_tokens=48, temperature=0, json_schema=canonical_schema(PERSON))
    remote = OpenAIChatBackend(MODEL, Runtime(base_url=f"{url}/v1"), log_dir=tmp_path)
    got = remote.generate(ChatRequest([ASK], sampling))[0].text
    local = server_backend.generate(ChatRequest([ASK], sampling))[0].text
    assert got == local and isinstance(json.loads(got)["age"], int)
