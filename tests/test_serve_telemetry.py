"""Drift telemetry of `driftlab serve` over real HTTP: pi and the persona projection of each reply,
as the local backend measures them, in the reply, in a stream's last chunk and in /metrics.

A reply's pi and the when-drifting gate (whose ratio is the real model's reading of its system
prompt) on the real model (SmolLM2-135M); the other checks, equalities with the backend's own
numbers and /metrics' bookkeeping, on test_serve's tiny random Llama (a step costs a millisecond)."""

from __future__ import annotations

import functools
import json

import httpx
import numpy as np
import pytest

from driftlab.chat import ChatRequest, Sampling
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from driftlab.serve.telemetry import OTHER, PromptLabels
from driftlab.steering.interventions import Interventions, Trace
from test_activation import FRENCH, synthetic
from test_serve import tiny_backend  # noqa: F401 - fixture

post = functools.partial(httpx.post, timeout=300)
N = 10
DIALOG = [{"role": "system", "content": FRENCH}, {"role": "user", "content": "Hi, how are you?"},
          {"role": "assistant", "content": "Bonjour ! Je vais bien."}, {"role": "user", "content": "What is Paris?"}]


def _served(backend):
    app = create_app(backend, ServeSettings(max_wait_ms=20, telemetry_prompts=1))
    with serving(app) as url:
        yield url, backend


@pytest.fixture(scope="module")
def server(tiny_backend):  # noqa: F811
    yield from _served(tiny_backend)


@pytest.fixture(scope="module")
def real_server(smol32):
    yield from _served(smol32)


def ask(url: str, backend, messages=DIALOG, **extra) -> httpx.Response:
    return post(f"{url}/v1/chat/completions", json={"model": backend.name, "messages": messages, "max_tokens": N,
                                                    "temperature": 0, **extra})


def local(backend, messages=DIALOG, steer: Interventions = Interventions()):
    (reply,) = backend.generate(ChatRequest([messages], Sampling(greedy=True, max_new_tokens=N), interventions=steer))
    return reply


def scrape(url: str) -> dict[str, float]:
    """/metrics' samples, by their full name with labels."""
    lines = httpx.get(f"{url}/metrics", timeout=60).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def test_a_reply_carries_the_pi_the_backend_traces_and_changes_no_token(real_server) -> None:
    url, backend = real_server
    plain = ask(url, backend).json()
    r = ask(url, backend, driftlab={"telemetry": {"layers": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"] == plain["choices"]  # tracing changes no token
    assert out["driftlab"]["steer"] == [] and "telemetry" not in plain["driftlab"]
    telemetry = out["driftlab"]["telemetry"]
    assert telemetry["rounds"] == 2 and telemetry["projection"] is None  # no directions on this server
    traced = local(backend, steer=Interventions.of(Trace())).trace.mean()  # [tokens]: pi over layers and heads
    pi = telemetry["pi"]
    assert pi["first"] == pytest.approx(traced[0], abs=1e-5) and pi["last"] == pytest.approx(traced[-1], abs=1e-5)
    assert pi["mean"] == pytest.approx(traced.mean(), abs=1e-5)
    assert 0 < pi["last"] < 1
    layers = pi["layers"]
    assert len(layers["first"]) == backend.shape.layers == len(layers["last"])
    assert np.mean(layers["first"]) == pytest.approx(pi["first"], abs=1e-4)


@pytest.mark.model
def test_a_stream_ends_with_the_same_telemetry(server) -> None:
    url, backend = server
    whole = ask(url, backend, driftlab={"telemetry": True}).json()["driftlab"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300,
                      json={"model": backend.name, "messages": DIALOG, "max_tokens": N, "temperature": 0,
                            "stream": True, "driftlab": {"telemetry": True}}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert [c for c in chunks if "driftlab" in c] == [chunks[-1]]  # only the chunk with the finish reason
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert chunks[-1]["driftlab"] == whole


@pytest.mark.model
def test_a_reply_asked_for_its_kls_carries_those_of_protocol_divergence_whole_or_streamed(server) -> None:
    """"telemetry": {"kl": true}: once the reply is done the server reads it again on the model's thread; the
    numbers are `protocol.divergence`'s on the same dialog and reply (checked against transformers in
    tests/test_kl.py), the tokens those of a plain request, and a stream's last chunk carries the same."""
    from driftlab.protocol.divergence import divergences

    url, backend = server
    plain = ask(url, backend).json()
    out = ask(url, backend, driftlab={"telemetry": {"kl": True}}).json()
    assert out["choices"] == plain["choices"]
    choice = out["choices"][0]
    conv = [*DIALOG, {"role": "assistant", "content": choice["message"]["content"]}]
    (want,) = divergences(backend, [(conv, choice["finish_reason"])], Interventions())
    kl = out["driftlab"]["telemetry"]["kl"]
    assert kl["positions"] == want.positions and kl["reminded"] > 0 and kl["prompt"] > 0
    assert abs(kl["reminded"] - want.reminded) < 1e-5 and abs(kl["prompt"] - want.prompt) < 1e-5, (kl, want)
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300,
                      json={"model": backend.name, "messages": DIALOG, "max_tokens": N, "temperature": 0,
                            "stream": True, "driftlab": {"telemetry": {"kl": True}}}) as r:
        last = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line][-1]
    assert last["driftlab"]["telemetry"]["kl"] == pytest.approx(kl, abs=1e-5)
    counts = {k: v for k, v in scrape(url).items() if k.startswith("driftlab_kl_count")}
    assert len(counts) == 2 and all(v == 2 for v in counts.values()), counts  # reminded and prompt, two replies
    cfg = ask(url, backend, driftlab={"telemetry": {"kl": True}, "steer": "cfg:alpha=1.5"})
    assert cfg.status_code == 422 and "--steer cfg mixes or switches distributions" in cfg.json()["error"]["message"]


@pytest.mark.model
def test_the_openai_client_reads_telemetry_from_extra_body(server) -> None:
    from openai import OpenAI

    url, backend = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(model=backend.name, messages=DIALOG, max_tokens=N, temperature=0,
                                                extra_body={"driftlab": {"telemetry": True}})
    telemetry = completion.model_extra["driftlab"]["telemetry"]
    assert telemetry["rounds"] == 2 and 0 < telemetry["pi"]["first"] <= 1


@pytest.mark.model
def test_without_a_system_prompt_pi_is_null_and_bad_requests_are_one_line_422s(server) -> None:
    url, backend = server
    bare = ask(url, backend, messages=DIALOG[1:], driftlab={"telemetry": True}).json()["driftlab"]["telemetry"]
    assert bare == {"rounds": 2, "pi": None, "projection": None, "gate": None}
    for value in ("yes", 1, {"layers": "yes"}, {"per_layer": True}):
        r = ask(url, backend, driftlab={"telemetry": value})
        assert r.status_code == 422 and r.json()["error"]["param"].startswith("driftlab.telemetry"), (value, r.text)
    text = post(f"{url}/v1/completions", json={"model": backend.name, "prompt": "Hi", "max_tokens": 2,
                                               "driftlab": {"telemetry": True}})
    assert text.status_code == 422 and "telemetry" in text.json()["error"]["param"]


@pytest.mark.model
def test_metrics_count_each_measured_reply_under_a_bounded_prompt_label(server) -> None:
    url, backend = server
    label = PromptLabels(1)(FRENCH)
    before = scrape(url)
    pi = ask(url, backend, driftlab={"telemetry": True}).json()["driftlab"]["telemetry"]["pi"]
    ask(url, backend, messages=[{"role": "system", "content": "Be terse."}, *DIALOG[1:2]],
        driftlab={"telemetry": True})
    ask(url, backend)  # not measured: no telemetry asked, and the server was not started with --telemetry
    after = scrape(url)
    for at in ("first", "last"):
        key = f'driftlab_pi_count{{at="{at}",prompt="{label}"}}'
        assert after[key] - before.get(key, 0) == 1
        other = f'driftlab_pi_count{{at="{at}",prompt="{OTHER}"}}'  # the second prompt is past the limit of 1
        assert after[other] - before.get(other, 0) == 1
    total = f'driftlab_pi_sum{{at="first",prompt="{label}"}}'
    assert after[total] - before.get(total, 0) == pytest.approx(pi["first"], abs=1e-5)


@pytest.mark.model
def test_a_server_started_with_telemetry_measures_every_chat_request(tiny_backend) -> None:  # noqa: F811
    with serving(create_app(tiny_backend, ServeSettings(max_wait_ms=20, telemetry=True))) as url:
        out = ask(url, tiny_backend).json()
        measured = scrape(url)
    assert "telemetry" not in out["driftlab"] and out["driftlab"]["steer"] == []  # not asked: not in the reply
    assert measured[f'driftlab_pi_count{{at="last",prompt="{PromptLabels(1)(FRENCH)}"}}'] == 1


@pytest.mark.model
def test_with_directions_the_reply_carries_its_projection(server) -> None:
    url, backend = server
    directions = synthetic(backend.shape.layers, backend.d_model, [FRENCH])
    backend.use_directions(directions)
    try:
        out = ask(url, backend, driftlab={"telemetry": True, "steer": "cap:q=0.5"}).json()["driftlab"]
        act = local(backend, steer=Interventions.parse(["cap:q=0.5"])).activation
    finally:
        backend.use_directions(None)
    assert out["steer"] == ["cap:q=0.5,layers=band"] or out["steer"][0].startswith("cap:")
    projection = out["telemetry"]["projection"]
    band = directions.personas["p0"].band
    assert projection["direction"] == act["direction"] and projection["band"] == list(band)
    for name, key in (("first", "prompt"), ("last", "last"), ("mean", "reply")):
        assert projection[name] == pytest.approx(np.mean([act[key][i] for i in band]), abs=1e-4)


def test_prompt_labels_are_short_hashes_bounded_in_number() -> None:
    labels = PromptLabels(2)
    a, b = labels("A"), labels("B")
    assert len(a) == 12 and a != b and labels("A") == a
    assert labels("C") == OTHER and labels(None) == "none" and labels("B") == b


STEER = "instaboost:m=20"


def test_when_drifting_steers_a_drifted_conversation_and_not_a_first_turn(real_server) -> None:
    """`when-drifting:r=R` over HTTP: a reply is the always-on steer's where pi_t / pi_1 < R (the
    ratio the backend computes), else plain's; a first turn (ratio 1) is never steered; the
    decision is in the reply without telemetry and counted in /metrics."""
    url, backend = real_server
    steer = Interventions.parse([STEER])
    on, plain = local(backend, steer=steer), local(backend)
    assert on.token_ids != plain.token_ids  # the steer changes this reply, so the comparison has teeth
    ratio = backend.drift_ratio(backend.render(DIALOG, interventions=Interventions.parse([STEER, "when-drifting:r=1"])))
    assert 0 < ratio < 1  # the second turn reads its system prompt less than the first did
    label = PromptLabels(1)(FRENCH)
    before = scrape(url)
    for r, steered in ((1.0, True), (ratio / 2, False)):
        out = ask(url, backend, driftlab={"steer": [STEER, f"when-drifting:r={r}"]}).json()
        gate = out["driftlab"]["gate"]
        assert gate["steered"] is steered and gate["pi_ratio"] == pytest.approx(ratio, abs=1e-5), out
        text = out["choices"][0]["message"]["content"]
        assert text == (on.text if steered else plain.text)
    after = scrape(url)
    for steered in ("true", "false"):
        key = f'driftlab_gate_decisions_total{{prompt="{label}",steered="{steered}"}}'
        assert after[key] - before.get(key, 0) == 1
    first = ask(url, backend, messages=DIALOG[:2], driftlab={"steer": [STEER, "when-drifting:r=1"]}).json()
    assert first["driftlab"]["gate"] == {"r": 1.0, "pi_ratio": 1.0, "steered": False}
    for messages, path in ((DIALOG[1:], "chat/completions"), (None, "completions")):
        body = {"model": backend.name, "max_tokens": 2, "driftlab": {"steer": [STEER, "when-drifting:r=0.9"]},
                **({"messages": messages} if messages else {"prompt": "Hi"})}
        r = post(f"{url}/v1/{path}", json=body)
        assert r.status_code == 422 and "when-drifting" in r.json()["error"]["message"], r.text
    # by projection: a one-line 422 without directions; with them the reply says both projections
    projection = {"model": backend.name, "max_tokens": 2, "messages": DIALOG,
                  "driftlab": {"steer": [STEER, "when-drifting:r=1,by=projection"]}}
    r = post(f"{url}/v1/chat/completions", json=projection)
    assert r.status_code == 422 and "no persona directions" in r.json()["error"]["message"], r.text
    backend.use_directions(synthetic(backend.shape.layers, backend.d_model, [FRENCH]))
    try:
        gate = post(f"{url}/v1/chat/completions", json=projection).json()["driftlab"]["gate"]
        gated = Interventions.parse(projection["driftlab"]["steer"])
        want = backend.projection_drift(backend.render(DIALOG, interventions=gated), FRENCH)
    finally:
        backend.use_directions(None)
    assert gate["by"] == "projection" and gate["r"] == 1.0
    assert [gate["projection_first"], gate["projection"]] == pytest.approx(list(want), abs=1e-5)
