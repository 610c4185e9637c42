"""`driftlab serve`'s `/v1/completions` and tokenizer routes (issue 34, items 1, 2 and 7): raw
text in, OpenAI's completions wire format out, as lm-eval's `local-completions` reads it;
log-probabilities equal the backend's own scoring, steered or not; `n` choices; a steer named
in the model; bad input a 4xx that leaves other requests alone.

A raw continuation and its stop on the real model (SmolLM2-135M); the rest, equalities of numbers
and fields, on test_serve's tiny random Llama (a step costs a millisecond), where each steer is
checked to change the log-probs it is compared under."""

from __future__ import annotations

import json
import math

import pytest

from driftlab.chat import text as T
from driftlab.chat.base import ChatRequest, Sampling
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from driftlab.steering.interventions import Interventions
from test_serve import MODEL, server_backend, tiny_backend  # noqa: F401 - fixtures

SYSTEM = "Always reply in French."
CONV = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of Italy?"}]


def _served(backend):
    app = create_app(backend, ServeSettings(max_batch_size=8, max_wait_ms=20, max_tokens_limit=64))
    with serving(app) as base:
        yield base


@pytest.fixture(scope="module")
def url(tiny_backend):  # noqa: F811
    yield from _served(tiny_backend)


@pytest.fixture(scope="module")
def real_url(server_backend):  # noqa: F811
    yield from _served(server_backend)


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    import httpx

    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    return r.status_code, r.json()


def complete(url: str, **body) -> dict:
    status, out = post(url, "/v1/completions", {"model": MODEL, **body})
    assert status == 200, out
    return out


@pytest.mark.model
def test_echo_logprobs_equal_the_backends_scores_plain_and_steered(url, tiny_backend):  # noqa: F811
    """What lm-eval sends for a log-likelihood request (token ids, max_tokens 1, echo, logprobs 1)
    scores the prompt's tokens exactly as `loglikelihood` scores the conversation's reply, also
    under a steer named in the model (its system span found through the chat template)."""
    rendered = tiny_backend.render(CONV)
    cont = " The capital is Rome."
    scores = []  # the continuation's log-probs under each steer
    for steer in ([], ["split-softmax:k=0.8"], ["instaboost:m=5"]):
        iv = Interventions.parse(steer)
        ll = tiny_backend.loglikelihood([CONV], [cont], iv)[0]
        model = "+".join([MODEL, *steer])
        out = complete(url, model=model, prompt=rendered.text + cont, max_tokens=1, temperature=0, echo=True,
                       logprobs=1)
        choice = out["choices"][0]
        lps = choice["logprobs"]["token_logprobs"]
        assert lps[0] is None and choice["logprobs"]["top_logprobs"][0] is None
        n_prompt = out["usage"]["prompt_tokens"]
        scored = lps[n_prompt - ll.n_tokens : n_prompt]  # the continuation's tokens; the last entry is generated
        assert math.isclose(sum(scored), ll.logprob, abs_tol=1e-4), (steer, sum(scored), ll.logprob)
        scores.append(scored)
        assert out["driftlab"]["steer"] == iv.specs()
        assert choice["text"].startswith(rendered.text + cont)
        ids = tiny_backend.tokenizer(rendered.text + cont, add_special_tokens=False)["input_ids"]
        as_ids = complete(url, model=model, prompt=[ids], max_tokens=0, echo=True, logprobs=0)  # as lm-eval sends
        assert as_ids["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lps[:-1], abs=1e-5)
    assert scores[1] != scores[0] and scores[2] != scores[0]  # the steers change the scores compared
    plain = complete(url, prompt=rendered.text + cont, max_tokens=0, echo=True, logprobs=0)
    steered = complete(url, prompt=rendered.text + cont, max_tokens=0, echo=True, logprobs=0,
                       driftlab={"steer": "split-softmax:k=0.8", "system": "none"})  # no span: nothing to steer
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == steered["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.model
def test_logprob_fields_are_consistent_as_lm_eval_reads_them(url, tiny_backend):  # noqa: F811
    text = "The capital of France is Paris"
    ids = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"]
    assert ids == tiny_backend.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = complete(url, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=3, seed=1234)
    lp = out["choices"][0]["logprobs"]
    n = len(ids) + 1
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for tok, own, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[tok] == own and 3 <= len(top) <= 4 and max(top.values()) >= own
    ref = T.score(tiny_backend, [T.encode(tiny_backend, text, special=False)])[0]
    assert lp["token_logprobs"][1:-1] == pytest.approx(ref.logprobs, abs=1e-5)
    assert post(url, "/detokenize", {"tokens": ids})[1]["prompt"] == text
    info = post(url, "/tokenize", {"prompt": "x"})[1]
    assert info["max_model_len"] == tiny_backend.shape.max_context and info["count"] == len(info["tokens"])


def test_generation_is_the_raw_continuation_cut_at_stop(real_url, server_backend):  # noqa: F811
    url = real_url
    prompt = "1, 2, 3, 4,"
    greedy = server_backend.generate(ChatRequest([T.encode(server_backend, prompt)], Sampling(max_new_tokens=12,
                                                                                                temperature=0)))[0]
    raw = server_backend.decode(greedy.token_ids)
    out = complete(url, prompt=prompt, max_tokens=12, temperature=0)
    assert out["choices"][0]["text"] == raw and raw.startswith(" ")  # not stripped: harnesses compare raw text
    stop = raw.strip()[2:4]
    cut = complete(url, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert cut["choices"][0] == {"index": 0, "text": raw[: raw.find(stop)], "finish_reason": "stop", "logprobs": None}
    echoed = complete(url, prompt=prompt, max_tokens=12, temperature=0, echo=True)
    assert echoed["choices"][0]["text"] == prompt + raw
    events = _stream(url, prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == raw[: raw.find(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def _stream(url: str, **body) -> list[dict]:
    import httpx

    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.model
def test_n_choices_and_several_prompts_each_with_their_own_seed(url):
    one = [complete(url, prompt="Once upon a time", max_tokens=8, seed=7 + k)["choices"][0]["text"] for k in range(3)]
    three = complete(url, prompt="Once upon a time", max_tokens=8, seed=7, n=3)["choices"]
    assert [c["text"] for c in three] == one and [c["index"] for c in three] == [0, 1, 2]
    assert len(set(one)) > 1  # sampled: the seeds differ
    two = complete(url, prompt=["Once upon a time", "The sky is"], max_tokens=4, temperature=0)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == complete(url, prompt="Once upon a time", max_tokens=4,
                                                 temperature=0)["choices"][0]["text"]


@pytest.mark.model
def test_chat_completions_give_n_choices_with_consecutive_seeds(url):
    messages = [{"role": "user", "content": "Tell me a story."}]
    status, many = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                      "seed": 3, "n": 2})
    assert status == 200 and len(many["choices"]) == 2
    assert many["choices"][0]["message"] != many["choices"][1]["message"]  # the seeds differ, and so do the replies
    for k, choice in enumerate(many["choices"]):
        _, one = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                    "seed": 3 + k})
        assert choice["message"]["content"] == one["choices"][0]["message"]["content"]
    status, err = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "n": 2, "stream": True})
    assert status == 422 and err["error"]["param"] == "stream"


@pytest.mark.model
@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": [[10**7]], "max_tokens": 1}, 422, "prompt"),  # token ids outside the vocabulary
    ({"prompt": "hi", "max_tokens": 0}, 422, "max_tokens"),  # nothing asked
    ({"prompt": "hi", "max_tokens": 1, "logprobs": 21}, 422, "logprobs"),  # above the limit
    ({"prompt": "hi", "max_tokens": 65}, 422, "max_tokens"),  # above the server's limit
    ({"prompt": "hi " * 9000, "max_tokens": 1, "echo": True}, 422, "prompt"),  # beyond the context window
    ({"prompt": "hi", "driftlab": {"steer": "split-softmax:k=0.5", "system": {"chars": [0, 10]}}}, 422,
     "driftlab.system"),  # a span outside the prompt
    ({"prompt": "hi", "driftlab": {"system": {"until": "###"}}}, 422, "driftlab.system"),  # a marker not there
    ({"prompt": "hi", "suffix": "there"}, 422, "suffix"),
    ({"prompt": "hi", "stream": True, "n": 2}, 422, "stream"),
    ({"prompt": []}, 422, "prompt"),
    ({"prompt": "hi", "model": MODEL + "+nonsense:k=1"}, 422, "model"),
    ({"prompt": "hi", "model": "other"}, 404, "model"),
])
def test_bad_input_is_a_4xx_naming_the_field_and_others_are_unaffected(url, body, status, param):
    got, out = post(url, "/v1/completions", {"model": MODEL, **body})
    assert got == status and out["error"]["param"] == param, out
    assert complete(url, prompt="Hello", max_tokens=2, temperature=0)["choices"][0]["text"]


@pytest.mark.model
def test_a_marker_or_character_range_places_the_steer(url, tiny_backend):  # noqa: F811
    """The same text steered with its system span given three ways scores the same; the span
    found by the marker equals the one the chat template marks."""
    text = tiny_backend.render(CONV).text + " Rome."
    start = text.index(SYSTEM)
    ways = [{"chars": [start, start + len(SYSTEM)]}, "chat"]
    got = [complete(url, prompt=text, max_tokens=0, echo=True, logprobs=0,
                    driftlab={"steer": "split-softmax:k=0.5", "system": w})["choices"][0]["logprobs"]["token_logprobs"]
           for w in ways]
    assert got[0] == got[1]
    plain = complete(url, prompt=text, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]["token_logprobs"]
    assert plain != got[0]
    span = T.SystemSpan(until="<|im_end|>").locate(text[start:], None)
    assert span == (0, len(SYSTEM))


@pytest.mark.model
def test_streamed_chat_chunks_carry_the_log_probs_of_their_tokens(url):
    """A stream's chunks carry the log-probs of the tokens their text came from: together, the
    plain reply's list, entry for entry."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    _, plain = post(url, "/v1/chat/completions", body)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ") and ln[6:] != "[DONE]"]
    carried = [e for ev in events for e in ((ev["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert carried == plain["choices"][0]["logprobs"]["content"] and len(carried) == 12
    with_text = [ev for ev in events if ev["choices"][0]["delta"].get("content")]
    assert all(ev["choices"][0]["logprobs"] for ev in with_text)  # no text without its tokens' log-probs
