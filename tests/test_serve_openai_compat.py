"""`driftlab serve` with requests as real clients send them (issue 34): stop strings, explicit
nulls, top_logprobs without logprobs, tool-call history, and fields it cannot apply.

All on test_serve's tiny random Llama (a step costs a millisecond): these are about the wire format
and the row's bookkeeping; a real model's reply cut at a stop is test_serve_completions'."""

from __future__ import annotations

import json
import re

import pytest

from driftlab.serve import ServeSettings, TextStream, create_app
from driftlab.serve.background import background as serving
from test_serve import MODEL, _WordTokenizer, body, get, post, tiny_backend  # noqa: F401 - fixture

STORY = [{"role": "user", "content": "Tell me a story about a dragon who lives in a castle."}]


@pytest.fixture(scope="module")
def compat(tiny_backend):  # noqa: F811
    app = create_app(tiny_backend, ServeSettings(max_batch_size=8, max_wait_ms=20, max_tokens_limit=64))
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(compat):
    import openai

    return openai.OpenAI(base_url=f"{compat}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def plain(client):
    """The greedy reply without stop strings, and a stop string from its middle."""
    full = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=32, temperature=0, logprobs=True)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and len(text) > 40, text
    words = text.split(" ")
    stop = " " + words[len(words) // 2]  # a word in the middle, with its leading space
    assert text.find(stop) > 5
    return full, stop


def generated_tokens(url: str) -> float:
    return float(re.search(r"^driftlab_generated_tokens_total (\S+)$", get(f"{url}/metrics").text, re.M).group(1))


@pytest.mark.model
def test_stop_cuts_the_reply_before_the_stop_and_ends_the_row_there(compat, client, plain):
    full, stop = plain
    text = full.choices[0].message.content
    before = generated_tokens(compat)
    cut = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=32, temperature=0, logprobs=True,
                                         stop=[stop, "never appears"])
    decoded = generated_tokens(compat) - before
    choice = cut.choices[0]
    assert choice.message.content == text[: text.find(stop)].strip()
    assert choice.finish_reason == "stop"
    # usage counts the fewest generated tokens that cover the returned text (the tokens of the
    # full reply, whose pieces are the same greedy tokens)
    pieces = [t.token for t in full.choices[0].logprobs.content]
    n = cut.usage.completion_tokens
    assert len(choice.logprobs.content) == n < full.usage.completion_tokens
    assert "".join(pieces[:n]).strip().startswith(choice.message.content)
    assert not "".join(pieces[: n - 1]).strip().startswith(choice.message.content)
    # the row ended at the stop: at most the token that completed it was decoded past the text
    assert decoded <= n + 1 + len(stop)  # a stop string spans at most len(stop) tokens


@pytest.mark.model
def test_stop_as_one_string_and_streamed_never_sends_text_past_it(client, plain):
    full, stop = plain
    want = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=32, temperature=0, stop=stop)
    chunks = list(client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=32, temperature=0,
                                                 stop=stop, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == want.choices[0].message.content == \
        full.choices[0].message.content[: full.choices[0].message.content.find(stop)].strip()
    assert len([p for p in pieces if p]) > 2  # streamed, not one blob at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def test_text_stream_sends_nothing_past_a_request_stop():
    words = _WordTokenizer([" Hello", " wor", "ld", "\n", "\n", "More", " text"])
    stream = TextStream(words.decode, (), ("\n\n",))
    deltas = [stream.push(i) for i in range(7)]
    assert "".join(deltas) == "Hello world" and deltas[-2:] == ["", ""]
    assert stream.finish("Hello world") == ""
    held = TextStream(words.decode, (), ("ld\nX",))  # the last 4 characters could start the stop: held back
    assert [held.push(i) for i in range(3)] == ["H", "ello", " w"]
    assert held.finish("Hello world") == "orld"  # it never came: the rest is sent at the end


@pytest.mark.parametrize("stop, status", [
    ("\n\n", 200), (["a", "b", "c", "d"], 200), ([], 200), (None, 200),
    (["a", "b", "c", "d", "e"], 422), ([""], 422), ([1], 422),
])
@pytest.mark.model
def test_stop_takes_a_string_or_up_to_four(compat, stop, status):
    r = post(f"{compat}/v1/chat/completions", json=body(max_tokens=2, stop=stop))
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["param"].startswith("stop")


@pytest.mark.model
def test_explicit_nulls_read_as_the_defaults(compat):
    nulls = dict.fromkeys(["temperature", "top_p", "n", "logprobs", "top_logprobs", "stream", "max_tokens",
                           "stop", "stream_options"], None)
    req = {"model": MODEL, "messages": STORY, "max_completion_tokens": 6, "seed": 11}
    r = post(f"{compat}/v1/chat/completions", json={**req, **nulls})
    assert r.status_code == 200, r.text
    default = post(f"{compat}/v1/chat/completions", json={**req, "temperature": 1.0, "top_p": 1.0}).json()
    assert r.json()["choices"][0]["message"] == default["choices"][0]["message"]  # temperature 1, same seed
    assert r.json()["choices"][0]["logprobs"] is None
    unseeded = post(f"{compat}/v1/chat/completions", json={**body(max_tokens=2), "seed": None})
    assert unseeded.status_code == 200, unseeded.text


@pytest.mark.parametrize("extra", [{"top_logprobs": 3}, {"top_logprobs": 0, "logprobs": False}])
@pytest.mark.model
def test_top_logprobs_without_logprobs_is_a_400(compat, client, extra):
    import openai

    r = post(f"{compat}/v1/chat/completions", json=body(**extra))
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": "top_logprobs", "code": 400}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, top_logprobs=2)


@pytest.mark.model
def test_tool_calls_and_tool_results_are_read_as_text(compat, tiny_backend):  # noqa: F811
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    r = post(f"{compat}/v1/chat/completions", json={**body(max_tokens=2), "messages": history})
    assert r.status_code == 200, r.text
    as_text = [history[0], {"role": "assistant", "content": '[tool call weather({"city": "Paris"})]'},
               {"role": "user", "content": "[tool result call_1]\nSunny, 21 C"}]
    assert r.json()["usage"]["prompt_tokens"] == len(tiny_backend.render(as_text).ids)
    bad = post(f"{compat}/v1/chat/completions", json={**body(), "messages": [{"role": "user", "content": None}]})
    assert bad.status_code == 422 and bad.json()["error"]["param"].startswith("messages.0"), bad.text


@pytest.mark.parametrize("field, value", [  # the sampling fields driftlab applies: tests/test_sampling_fields.py
    ("tools", [{"type": "function", "function": {"name": "f"}}]),  # response_format: test_response_format.py
    ("tool_choice", "auto"), ("best_of", 2), ("use_beam_search", True),
])
@pytest.mark.model
def test_unapplied_sampling_fields_are_refused_by_name(compat, field, value):
    r = post(f"{compat}/v1/chat/completions", json=body(**{field: value}))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"] and field in err["message"]


@pytest.mark.model
def test_neutral_values_and_informational_fields_are_accepted(compat, client):
    neutral = {"logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0, "top_k": -1, "min_p": 0,
               "repetition_penalty": 1, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
               "user": "u1", "metadata": {"k": "v"}, "store": False}
    r = post(f"{compat}/v1/chat/completions", json=body(max_tokens=2, **neutral))
    assert r.status_code == 200, r.text
    reply = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2, frequency_penalty=0,
                                           user="someone")
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert json.loads(reply.model_dump_json())["object"] == "chat.completion"


def test_a_rerun_after_a_failed_batch_watches_for_stops_afresh():
    """A failed batch is re-run one job at a time: a job's stop watcher must not carry the
    tokens (nor the stop) of the failed run into the re-run."""
    import asyncio

    from driftlab.chat.base import Reply, Sampling
    from driftlab.serve.batcher import Batcher, Job
    from driftlab.steering.interventions import Interventions

    stopped_at_start, cancelled_at_start = [], []

    class Flaky:  # emits the "stop" token 9 in every row, then fails any batch of two
        def generate(self, request):
            stopped_at_start.append(request.cancelled(0))
            for row in range(len(request.conversations)):
                request.on_token(row, 9 if len(request.conversations) > 1 else 1)
            if len(request.conversations) > 1:
                raise RuntimeError("injected")
            cancelled_at_start.append(request.cancelled(0))
            return [Reply(text="ok", n_tokens=1, finish_reason="length", token_ids=[1])]

    def watcher(job):
        def fresh():
            seen = []

            def watch(token):
                seen.append(token)
                if 9 in seen:
                    job.stopped.set()
            return watch
        return fresh

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job([{"role": "user", "content": "hi"}], Sampling(max_new_tokens=4, temperature=0), i,
                    Interventions(), None) for i in range(2)]
        for job in jobs:
            job.future, job.loop, job.watch = loop.create_future(), loop, watcher(job)
        Batcher(Flaky())._run(jobs)
        return [await j.future for j in jobs], jobs

    replies, jobs = asyncio.run(main())
    assert [r.text for r in replies] == ["ok", "ok"]
    assert stopped_at_start == [False, False, False]  # the re-runs start unstopped
    assert cancelled_at_start == [False, False] and not any(j.stopped.is_set() for j in jobs)
