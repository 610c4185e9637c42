"""The OpenAI/vLLM sampling fields (issue 34): `top_k`, `min_p`, `repetition_penalty`,
`frequency_penalty`, `presence_penalty` and `logit_bias`, applied by the local backend with
vLLM's meaning, accepted and applied by `driftlab serve`, and sent by the OpenAI backend.

Each field is checked against an independent reference: transformers' own `generate` for the
repetition penalty, a slow decode loop that recomputes the whole sequence for the OpenAI
penalties, sampling distributions for top-k and min-p, and greedy decoding where a setting
must reduce to it. Most tests run on a tiny random model (fast, and its greedy output loops);
one compares with transformers on SmolLM2-135M.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pydantic import ValidationError

from devices import backend_device
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.sampling import sample, warpers
from driftlab.errors import DriftlabError
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from driftlab.steering import Interventions
from test_serve import post
from tiny_models import VOCAB, make_tiny_model

STORY = [{"role": "user", "content": "Tell me a story about a dragon who lives in a castle."}]
OTHER = [{"role": "user", "content": "What is the capital of France?"}]
PERSONA = [{"role": "system", "content": "You are a pirate. Always talk like one."}, *STORY]
TOKEN = 42  # an ordinary token id of SmolLM2's tokenizer
N = 16  # tokens per reply


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("sampling_fields") / "qwen2")


def _backend(path, name="tiny"):
    from driftlab.chat.hf import HFChatBackend

    backend = HFChatBackend(str(path), dtype="float32", device=backend_device(), prefix_cache_bytes=0)
    backend.name = name
    return backend


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return _backend(tiny_dir)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    """The same weights as plain transformers (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).to(backend_device()).eval()


def greedy(**fields) -> Sampling:
    return Sampling(greedy=True, max_new_tokens=N, ignore_eos=True, **fields)


def tokens(backend, conv, sampling: Sampling, **request) -> list[int]:
    return backend.generate(ChatRequest([conv], sampling, **request))[0].token_ids


# -- the settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({"top_k": -2}, "greater than or equal to -1"),
    ({"min_p": 1.5}, "less than or equal to 1"),
    ({"repetition_penalty": 0.0}, "greater than 0"),
    ({"repetition_penalty": float("inf")}, "finite number"),
    ({"frequency_penalty": 2.5}, "less than or equal to 2"),
    ({"presence_penalty": -2.5}, "greater than or equal to -2"),
    ({"logit_bias": {"42": 100.5}}, r"outside \[-100, 100\]"),
    ({"logit_bias": {"x": 1}}, "not a non-negative integer"),
    ({"logit_bias": {"-3": 1}}, "not a non-negative integer"),
    ({"logit_bias": {"3": "x"}}, "valid number"),
    ({"logit_bias": {"3": float("nan")}}, r"outside \[-100, 100\]"),
    ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "given twice"),
])
def test_out_of_range_settings_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        Sampling(**fields)


def test_neutral_settings_change_nothing_not_even_a_dump():
    old = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 0.9, "greedy": False, "ignore_eos": False}
    neutral = Sampling(top_k=-1, min_p=0, repetition_penalty=1, frequency_penalty=0, presence_penalty=0, logit_bias={})
    # configs and manifests recorded before these fields existed dump and compare as they did
    assert Sampling().model_dump(mode="json") == neutral.model_dump(mode="json") == old
    assert neutral == Sampling() and hash(neutral) == hash(Sampling()) and Sampling.model_validate(old) == neutral
    assert not neutral.penalized and Sampling(top_k=0) == Sampling(top_k=-1)  # vLLM's two "off" values
    biased = Sampling(logit_bias={"7": 2, 3: -1.5}, presence_penalty=0.5, top_k=5)
    assert biased.logit_bias == ((3, -1.5), (7, 2.0)) and biased.penalized
    dumped = biased.model_dump(mode="json")
    assert dumped["logit_bias"] == {"3": -1.5, "7": 2.0} and dumped["top_k"] == 5 and "min_p" not in dumped
    assert Sampling.model_validate(dumped) == biased == Sampling.model_validate_json(biased.model_dump_json())
    assert hash(biased) == hash(Sampling(logit_bias={"3": -1.5, "7": 2.0}, presence_penalty=0.5, top_k=5))


def test_neutral_settings_decode_bit_identically(tiny):
    plain = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=N)
    neutral = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=N, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                       frequency_penalty=0.0, presence_penalty=0.0, logit_bias={})
    runs = [tiny.generate(ChatRequest([STORY, OTHER], s, seeds=[3, 4], logprobs=2)) for s in (plain, neutral)]
    assert [(r.token_ids, r.logprobs) for r in runs[0]] == [(r.token_ids, r.logprobs) for r in runs[1]]


# -- the warpers: top_k and min_p ------------------------------------------------------------------
def _frequencies(logits: torch.Tensor, sampling: Sampling, draws: int = 4000) -> torch.Tensor:
    drawn = sample(logits.expand(draws, -1), warpers(sampling), list(range(draws)), [0] * draws)  # a seed per row
    counts = torch.bincount(drawn, minlength=logits.shape[-1]).float()
    return counts / counts.sum()


@pytest.mark.parametrize("fields, kept", [
    ({"top_k": 2}, lambda p: p >= p.sort(descending=True).values[1]),
    ({"min_p": 0.3}, lambda p: p >= 0.3 * p.max()),
])
def test_top_k_and_min_p_sample_from_the_kept_tokens_in_proportion(fields, kept):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, -1.0, -3.0]])
    probs = torch.softmax(logits[0], -1)
    keep = kept(probs)
    assert 1 < int(keep.sum()) < len(probs)  # the setting cuts something, and leaves a choice
    expected = torch.where(keep, probs, 0.0) / probs[keep].sum()
    freq = _frequencies(logits, Sampling(temperature=1.0, top_p=1.0, **fields))
    assert bool((freq[~keep] == 0).all()) and (freq - expected).abs().max() < 0.03


def test_top_k_one_and_min_p_one_sample_the_greedy_token(tiny):
    want = tokens(tiny, STORY, greedy())
    seeds = [0, 1, 2, 3]
    hot = dict(temperature=1.0, top_p=1.0, max_new_tokens=N, ignore_eos=True)
    for fields in ({}, {"top_k": 1}, {"min_p": 1.0}):
        replies = tiny.generate(ChatRequest([STORY] * 4, Sampling(**hot, **fields), seeds=seeds))
        same = [r.token_ids == want for r in replies]
        assert all(same) if fields else not any(same), fields  # plain sampling at T=1 is not greedy


def test_top_k_and_min_p_leave_greedy_decoding_alone():
    assert warpers(Sampling(greedy=True, top_k=5, min_p=0.5)) is None


# -- logit_bias ----------------------------------------------------------------------------------
def test_logit_bias_is_added_to_the_logits_and_logprobs_stay_the_models(tiny, hf_tiny):
    forced = tiny.generate(ChatRequest([STORY], greedy(logit_bias={str(TOKEN): 100}), logprobs=1))[0]
    assert forced.token_ids == [TOKEN] * N
    # the reported log-probability is the model's own, before the bias (as vLLM reports it)
    ids = torch.tensor([list(tiny.render(STORY).ids)], device=hf_tiny.device)
    with torch.no_grad():
        model = torch.log_softmax(hf_tiny(ids).logits[0, -1].float(), -1)[TOKEN].item()
    assert forced.logprobs[0].logprob == pytest.approx(model, abs=1e-4) and model < -5
    plain = tokens(tiny, STORY, greedy())
    banned = plain[0]
    without = tokens(tiny, STORY, greedy(logit_bias={str(banned): -100}))
    assert banned not in without and without != plain
    # a small bias moves the argmax exactly as adding it to the logits says
    with torch.no_grad():
        logits = hf_tiny(ids).logits[0, -1].float()
    second = int(logits.topk(2).indices[1])
    gap = (logits[banned] - logits[second]).item()
    assert tokens(tiny, STORY, greedy(logit_bias={str(second): gap + 0.01}))[0] == second
    assert tokens(tiny, STORY, greedy(logit_bias={str(second): gap - 0.01}))[0] == banned


def test_a_logit_bias_token_outside_the_vocabulary_is_a_clear_error(tiny):
    with pytest.raises(DriftlabError, match=f"logit_bias: token id {VOCAB} is not in the model's vocabulary"):
        tiny.generate(ChatRequest([STORY], greedy(logit_bias={str(VOCAB): 1})))


# -- penalties -------------------------------------------------------------------------------------
def _reference_greedy(model, prompt: list[int], penalize) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step (no cache, no batching), with
    `penalize(logits, prompt, generated)` applied to the last position's logits."""
    generated: list[int] = []
    for _ in range(N):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated], device=model.device)).logits[0, -1].float()
        generated.append(int(penalize(logits, prompt, generated).argmax()))
    return generated


def _openai(frequency: float, presence: float):
    """OpenAI's definition: logit -= frequency * count + presence * (count > 0), over the reply."""
    def penalize(logits, prompt, generated):
        for token, count in Counter(generated).items():
            logits[token] -= frequency * count
            logits[token] -= presence
        return logits
    return penalize


@pytest.mark.parametrize("frequency, presence", [(0.0, 1.5), (1.0, 0.0), (0.5, -0.5), (2.0, 2.0)])
def test_frequency_and_presence_penalties_follow_openais_definition(tiny, hf_tiny, frequency, presence):
    prompt = list(tiny.render(STORY).ids)
    got = tokens(tiny, STORY, greedy(frequency_penalty=frequency, presence_penalty=presence))
    assert got == _reference_greedy(hf_tiny, prompt, _openai(frequency, presence))


def test_a_large_penalty_stops_a_looping_model_repeating_itself(tiny):
    long = {"max_new_tokens": 2 * N}
    plain = tokens(tiny, OTHER, greedy().model_copy(update=long))
    assert len(set(plain)) < len(plain) // 2  # the tiny model loops
    for fields in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0, "presence_penalty": 2.0}):
        got = tokens(tiny, OTHER, greedy(**fields).model_copy(update=long))
        assert len(set(got)) == len(got), (fields, got)


def test_repetition_penalty_equals_transformers_generate(tiny, hf_tiny):
    prompt = list(tiny.render(STORY).ids)
    assert _reference_greedy(hf_tiny, prompt, lambda logits, *_: logits) == tokens(tiny, STORY, greedy())
    for penalty in (1.3, 0.8):
        want = hf_tiny.generate(torch.tensor([prompt], device=hf_tiny.device), do_sample=False, max_new_tokens=N,
                                min_new_tokens=N, repetition_penalty=penalty, pad_token_id=2)[0, len(prompt):]
        got = tokens(tiny, STORY, greedy(repetition_penalty=penalty))
        assert got == want.tolist(), penalty
    assert tokens(tiny, STORY, greedy(repetition_penalty=1.3)) != tokens(tiny, STORY, greedy())


def test_penalties_follow_each_row_through_a_batch_whose_rows_leave_early(tiny):
    """Rows of different prompts and lengths in one batch (finished rows leave it): each row's
    penalties read its own prompt and tokens, as when it is decoded alone."""
    sampling = greedy(repetition_penalty=1.2, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"13": 3})
    convs, limits = [STORY, OTHER, PERSONA], [3, N, 9]
    batch = tiny.generate(ChatRequest(convs, sampling, row_max_tokens=limits))
    alone = [tokens(tiny, c, sampling.model_copy(update={"max_new_tokens": n})) for c, n in zip(convs, limits)]
    assert [r.token_ids for r in batch] == alone


def test_penalties_apply_to_guided_logits(tiny):
    cfg = Interventions.parse(["cfg:alpha=1.5"])
    assert tokens(tiny, PERSONA, greedy(logit_bias={str(TOKEN): 100}), interventions=cfg) == [TOKEN] * N
    plain = tokens(tiny, PERSONA, greedy(), interventions=cfg)
    penalized = tokens(tiny, PERSONA, greedy(presence_penalty=2.0), interventions=cfg)
    assert penalized != plain and len(set(penalized)) == len(penalized)


@pytest.mark.model
def test_repetition_penalty_equals_transformers_generate_on_smollm2(smol32):
    """transformers' generate runs on smol32's own weights (not a second load of them), with its own
    attention (sdpa) for the call."""
    from driftlab.attention import ATTENTION_NAME

    model = smol32.model
    prompt = list(smol32.render(STORY).ids)
    n = 16
    model.set_attn_implementation("sdpa")
    try:
        want = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=n,
                              repetition_penalty=1.3, pad_token_id=2)[0, len(prompt):].tolist()
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    got = smol32.generate(ChatRequest([STORY], Sampling(greedy=True, max_new_tokens=n, repetition_penalty=1.3)))[0]
    assert got.token_ids == want[: len(got.token_ids)] and len(got.token_ids) > 10
    plain = smol32.generate(ChatRequest([STORY], Sampling(greedy=True, max_new_tokens=n)))[0]
    assert plain.token_ids != got.token_ids


# -- driftlab serve ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_dir):
    """A short batching window: the requests but one test's come one at a time, and each would wait
    it out (the batching test widens it while its requests are in flight)."""
    app = create_app(_backend(tiny_dir), ServeSettings(max_batch_size=8, max_wait_ms=10, max_tokens_limit=32))
    with serving(app) as url:
        yield url, app


def ask(url: str, messages=STORY, **fields):
    return post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": N,
                                                   "temperature": 0, "ignore_eos": True, **fields})


def test_the_server_applies_the_fields(server, tiny):
    url, _ = server
    r = ask(url, logit_bias={str(TOKEN): 100}, logprobs=True)
    assert r.status_code == 200, r.text
    piece = tiny.decode([TOKEN], skip_special=False)
    assert [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]] == [piece] * N
    cases = [{"presence_penalty": 2.0}, {"frequency_penalty": 1.0, "repetition_penalty": 1.3},
             {"logit_bias": {"13": 5.5}}]
    plain = ask(url).json()["choices"][0]["message"]["content"]
    for fields in cases:
        got = ask(url, **fields).json()["choices"][0]["message"]["content"]
        want = tiny.generate(ChatRequest([STORY], greedy(**fields)))[0].text
        assert got == want != plain, fields
    # top_k=1 and min_p=1 sample the greedy reply, whatever the seed and temperature
    for fields in ({"top_k": 1}, {"min_p": 1.0}):
        got = ask(url, temperature=1.5, seed=7, **fields).json()["choices"][0]["message"]["content"]
        assert got == plain, fields
    assert ask(url, temperature=1.5, seed=7).json()["choices"][0]["message"]["content"] != plain


def test_the_server_never_batches_requests_of_different_settings_together(server, tiny):
    url, app = server
    requests = [({}, STORY), ({}, OTHER), ({"logit_bias": {str(TOKEN): 100}}, STORY),
                ({"logit_bias": {str(TOKEN): 100}}, OTHER), ({"presence_penalty": 2.0}, STORY),
                ({"repetition_penalty": 1.3, "frequency_penalty": 0.5}, OTHER)]
    before, window = app.state.batcher.n_batches, app.state.batcher.max_wait_s
    app.state.batcher.max_wait_s = 0.3  # long enough that the six requests meet in the queue
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            replies = list(pool.map(lambda rq: ask(url, rq[1], **rq[0]), requests))
    finally:
        app.state.batcher.max_wait_s = window
    for (fields, conv), r in zip(requests, replies):
        assert r.status_code == 200, r.text
        want = tiny.generate(ChatRequest([conv], greedy(**fields)))[0].text
        assert r.json()["choices"][0]["message"]["content"] == want, fields
    sizes = app.state.batcher.sizes_since(before)
    assert sum(sizes) == len(requests) and max(sizes) <= 2, sizes  # one batch per distinct setting at most


@pytest.mark.parametrize("field, value", [
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("min_p", 1.5), ("min_p", "0.1"), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("frequency_penalty", 2.5), ("presence_penalty", -3), ("logit_bias", [1]),
    ("logit_bias", {"42": 101}), ("logit_bias", {"abc": 1}), ("logit_bias", {"42": "1"}),
])
def test_out_of_range_fields_are_a_422_naming_the_field(server, field, value):
    r = ask(server[0], **{field: value})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"].split(".")[0] == field, r.text


def test_a_logit_bias_token_the_model_lacks_is_a_422_naming_logit_bias(server):
    r = ask(server[0], logit_bias={str(TOKEN): 1, str(VOCAB + 5): 2})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and str(VOCAB + 5) in err["message"] and "vocabulary" in err["message"]


def test_null_and_neutral_values_read_as_the_defaults(server):
    url, _ = server
    plain = ask(url).json()["choices"][0]["message"]["content"]
    for value in (None, "neutral"):
        fields = {"top_k": -1, "min_p": 0, "repetition_penalty": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
                  "logit_bias": {}} if value else dict.fromkeys(
                      ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias"))
        r = ask(url, **fields)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain, r.text


# -- the OpenAI backend ----------------------------------------------------------------------------
def test_the_openai_backend_sends_the_fields_that_change_something(server, tiny):
    from driftlab.chat.openai import OpenAIChatBackend
    from driftlab.chat.spec import Runtime

    remote = OpenAIChatBackend("tiny", Runtime(base_url=f"{server[0]}/v1"))
    body = remote._body(STORY, Sampling(), 0, None)
    assert not {"top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                "logit_bias"} & set(body)  # plain OpenAI endpoints see what they saw before
    full = dict(top_k=5, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5,
                logit_bias={"7": 3})
    body = remote._body(STORY, Sampling(**full), 0, None)
    assert {k: body[k] for k in full} == {**full, "logit_bias": {"7": 3.0}}
    assert "top_k" not in remote._body(STORY, Sampling(temperature=0, top_k=5), 0, None)  # greedy: no sampling
    json.dumps(body)
    for fields in ({"logit_bias": {str(TOKEN): 100}}, {"repetition_penalty": 1.3, "presence_penalty": 1.0}):
        sampling = greedy(**fields)
        got = remote.generate(ChatRequest([STORY], sampling))[0].text
        assert got == tiny.generate(ChatRequest([STORY], sampling))[0].text, fields
    hot = Sampling(temperature=1.5, top_p=1.0, top_k=1, max_new_tokens=N, ignore_eos=True)
    assert remote.generate(ChatRequest([STORY], hot, seeds=[5]))[0].text == \
        tiny.generate(ChatRequest([STORY], greedy()))[0].text
