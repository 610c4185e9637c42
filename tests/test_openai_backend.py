"""The OpenAI-compatible backend against real loopback servers: `driftlab serve`, and a misbehaving stub.

MMLU's letters are compared on SmolLM2-135M (a random model's letters need not be in the top 20 the
server returns); the self-chat's equality and its resume are bookkeeping, on a tiny random Llama."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from tests.test_mmlu import RAW

from driftlab.chat import BackendSpec, ChatRequest, Sampling, make_backend
from driftlab.chat.openai import REQUEST_LOG, OpenAIChatBackend
from driftlab.chat.spec import Runtime
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS
from driftlab.protocol.mmlu import MMLU, MMLUConfig
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig
from driftlab.records.rundir import RunDir
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from driftlab.steering import Interventions
from test_serve import served_as

MODEL = "smollm2-135m"
FAST = (0.01, 0.05)  # backoff for tests: first delay and cap, seconds


@pytest.fixture(scope="module")
def served(smol32):
    """smol32 served (under MODEL, sharing its weights: no second load of the same model)."""
    with serving(create_app(served_as(smol32, MODEL), ServeSettings(max_wait_ms=20))) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def tiny(tiny_llama, device):
    """A tiny random Llama (tests/tiny_models.py) in float32."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(tiny_llama), dtype="float32", device=str(device), prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def served_tiny(tiny):
    """The tiny model served under MODEL."""
    with serving(create_app(served_as(tiny, MODEL), ServeSettings(max_wait_ms=20))) as url:
        yield f"{url}/v1"


def _records(run) -> dict:
    return {r.key: (r.text, r.n_tokens, r.finish_reason) for r in RunDir(run).records(RECORDS)}


@pytest.mark.model  # seconds: a self-chat twice, and a server
def test_selfchat_over_http_equals_the_local_run_and_resumes_without_resending(served_tiny, tiny, tmp_path):
    config = SelfChatConfig(pairs=2, rounds=2, seed=5, user_probe=True, steer=["spr:p=0.5"],
                            sampling=Sampling(max_new_tokens=6, temperature=1.0, top_p=0.9), probe_tokens=6)
    run_protocol(SelfChat(config, tiny), tmp_path / "local", progress=False)
    remote_spec = BackendSpec(model=f"openai:{MODEL}", runtime=Runtime(base_url=served_tiny, concurrency=3))
    remote_cfg = config.model_copy(update={"backend": remote_spec})
    backend = OpenAIChatBackend(MODEL, remote_spec.runtime, log_dir=tmp_path / "remote")
    run_protocol(SelfChat(remote_cfg, backend), tmp_path / "remote", progress=False)
    local, remote = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert len(local) == 2 * (2 * 2 - 1 + 2 * 2) and remote == local  # same sampled text, token counts, endings
    log = [json.loads(line) for line in (tmp_path / "remote" / REQUEST_LOG).read_text().splitlines()]
    assert len(log) == backend.sent == len(local) and len({e["key"] for e in log}) == len(log)
    assert all(e["response"]["completion_tokens"] > 0 and e["request"]["seed"] >= 0 for e in log)

    # A kill after the requests were answered but before the records were written:
    shutil.copytree(tmp_path / "remote", tmp_path / "killed")
    lines = (tmp_path / "killed" / "records.jsonl").read_text().splitlines()
    (tmp_path / "killed" / "records.jsonl").write_text("\n".join(lines[:3]) + "\n")
    again = OpenAIChatBackend(MODEL, remote_spec.runtime, log_dir=tmp_path / "killed")
    run_protocol(SelfChat(remote_cfg, again), tmp_path / "killed", progress=False)
    assert again.sent == 0 and _records(tmp_path / "killed") == local


QUESTIONS = 6  # each one HTTP request and a local scoring: enough to compare letters and log-probabilities


def test_mmlu_letters_over_http_match_local_loglikelihood(served, smol32, tmp_path):
    config = MMLUConfig(n=QUESTIONS, turn=0, data=str(RAW))
    run_protocol(MMLU(config, smol32), tmp_path / "local", progress=False)
    remote = OpenAIChatBackend(MODEL, Runtime(base_url=served), log_dir=tmp_path / "remote")
    remote_cfg = config.model_copy(update={"backend": BackendSpec(model=f"openai:{MODEL}")})
    run_protocol(MMLU(remote_cfg, remote), tmp_path / "remote", progress=False)
    from driftlab.protocol.mmlu import RECORDS as ANSWERS

    def answers(run):
        return {r.index: r for r in RunDir(run).records(ANSWERS)}

    a, b = answers(tmp_path / "local"), answers(tmp_path / "remote")
    assert a.keys() == b.keys() and len(a) == QUESTIONS
    assert [a[q].predicted for q in a] == [b[q].predicted for q in a]
    for q in a:  # the chosen letter is in the top 20, so it has the local log-probability
        letter = a[q].predicted
        assert abs(a[q].logprobs[letter] - b[q].logprobs[letter]) < 1e-3
    assert remote.sent == QUESTIONS  # the four letters of a question share one request


def test_attention_interventions_and_cfg_are_refused_naming_what_works(tmp_path):
    backend = OpenAIChatBackend("m", Runtime(base_url="http://127.0.0.1:9/v1"))
    for spec in ("split-softmax:k=0.5", "instaboost:m=3", "cfg:alpha=2", "trace"):
        with pytest.raises(DriftlabError, match="cannot apply") as err:
            backend.generate(ChatRequest([[{"role": "user", "content": "hi"}]],
                                         interventions=Interventions.parse([spec])))
        assert "spr" in err.value.hint
    with pytest.raises(DriftlabError, match="--ray"):
        make_backend(BackendSpec(model="openai:m", runtime=Runtime(ray="local")))
    with pytest.raises(ValueError, match="served model's name"):
        BackendSpec(model="openai:")
    with pytest.raises(ValueError, match="http"):
        Runtime(base_url="localhost:8000")


def test_missing_api_key_for_the_hosted_api_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(DriftlabError, match=r"\$NO_SUCH_KEY_VAR is not set"):
        OpenAIChatBackend("gpt-4o-mini", Runtime(api_key_env="NO_SUCH_KEY_VAR"))


class Stub:
    """A loopback chat server that answers each request with the next scripted behaviour."""

    def __init__(self, script: list[str]):
        self.script = list(script)
        self.hits = 0
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.handle)

    async def handle(self, request: Request):
        body = await request.json()
        self.hits += 1
        what = self.script.pop(0) if self.script else "ok"
        if what == "429":
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429, headers={"retry-after": "0"})
        if what == "500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if what == "400":
            return JSONResponse({"error": {"message": "max_tokens is too large"}}, status_code=400)
        if what == "garbage":
            return PlainTextResponse("<html>proxy error</html>", status_code=200)
        if what == "empty":
            return JSONResponse({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []})
        if what == "hang":  # until the client gives up: its timeout, not ours, ends the attempt
            for _ in range(3000):  # at most a minute, should a client never give up
                if await request.is_disconnected():
                    break
                await asyncio.sleep(0.02)
        text = "echo: " + body["messages"][-1]["content"]
        return JSONResponse({
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        })


def _ask(url, tmp_path, retries=5, timeout=2.0, n=1):
    backend = OpenAIChatBackend("m", Runtime(base_url=f"{url}/v1", max_retries=retries, timeout=timeout),
                                log_dir=tmp_path, backoff=FAST)
    convs = [[{"role": "user", "content": f"q{i}"}] for i in range(n)]
    return backend, backend.generate(ChatRequest(convs, Sampling(max_new_tokens=4)))


def test_transient_failures_are_retried_and_recorded_once(tmp_path):
    stub = Stub(["429", "500", "garbage", "empty", "hang"])
    with serving(stub.app) as url:  # the timeout also bounds the good attempt: leave a loaded machine room
        backend, replies = _ask(url, tmp_path, timeout=2.0)
    assert replies[0].text == "echo: q0" and replies[0].n_tokens == 2
    assert stub.hits == 6 and backend.sent == 1
    assert len((tmp_path / REQUEST_LOG).read_text().splitlines()) == 1
    assert json.loads((tmp_path / REQUEST_LOG).read_text())["attempts"] == 6


def test_persistent_failure_ends_in_one_clear_error(tmp_path):
    stub = Stub(["500"] * 10)
    with serving(stub.app) as url, pytest.raises(DriftlabError, match=r"failed 3 times; last: HTTP 500: boom"):
        _ask(url, tmp_path, retries=2)
    assert stub.hits == 3 and not (tmp_path / REQUEST_LOG).exists()


def test_a_hanging_server_times_out(tmp_path):
    stub = Stub(["hang"] * 10)
    with serving(stub.app) as url, pytest.raises(DriftlabError, match=r"failed 2 times; last: no answer within 0.3 s \(--timeout\)"):
        _ask(url, tmp_path, retries=1, timeout=0.3)


def test_client_errors_are_not_retried(tmp_path):
    stub = Stub(["400"])
    with serving(stub.app) as url, pytest.raises(DriftlabError, match=r"refused the request \(400\): max_tokens"):
        _ask(url, tmp_path)
    assert stub.hits == 1


def test_concurrency_is_bounded_and_order_kept(tmp_path):
    stub = Stub([])
    live = {"now": 0, "most": 0}
    inner = stub.handle

    async def counting(request: Request):
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])
        await asyncio.sleep(0.05)
        try:
            return await inner(request)
        finally:
            live["now"] -= 1

    stub.app.router.routes.clear()
    stub.app.post("/v1/chat/completions")(counting)
    with serving(stub.app) as url:
        backend = OpenAIChatBackend("m", Runtime(base_url=f"{url}/v1", concurrency=3), log_dir=tmp_path, backoff=FAST)
        convs = [[{"role": "user", "content": f"q{i}"}] for i in range(12)]
        replies = backend.generate(ChatRequest(convs, Sampling(max_new_tokens=4)))
    assert [r.text for r in replies] == [f"echo: q{i}" for i in range(12)]
    assert live["most"] == 3
