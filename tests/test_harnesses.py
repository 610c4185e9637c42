"""The harnesses the field trusts, run against a steered `driftlab serve` on loopback (issue 34,
items 3 and 5): inspect_ai through its OpenAI-compatible provider, lm-evaluation-harness
through `local-completions` and `local-chat-completions`; every score written by the harness
itself and checked against driftlab's own scoring of the same items."""

from __future__ import annotations

import pytest

from driftlab.chat.base import ChatRequest, Sampling
from driftlab.serve import ServeSettings, create_app
from driftlab.serve.background import background as serving
from driftlab.steering.interventions import Interventions
from test_serve import MODEL

STEER = "split-softmax:k=0.8"


@pytest.fixture(scope="module")
def server_backend(smol32):
    """The session's float32 SmolLM2 (no prefix cache, as test_serve's server has), served as MODEL."""
    return smol32


def _serve(backend):
    app = create_app(backend, ServeSettings(max_batch_size=8, max_wait_ms=20, max_tokens_limit=64,
                                            served_model_name=MODEL))
    return serving(app)


@pytest.fixture(scope="module")
def url(server_backend):
    with _serve(server_backend) as base:
        yield base


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    """(backend, url) of a tiny random Qwen2 with SmolLM2's tokenizer (tests/tiny_models.py), served as MODEL:
    for an option whose check is driftlab's numbers against the harness's, not a real model's replies."""
    from driftlab.chat.hf import HFChatBackend
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("harness") / "qwen2")
    backend = HFChatBackend(str(path), dtype="float32", device="cpu", prefix_cache_bytes=0)
    with _serve(backend) as base:
        yield backend, base


@pytest.fixture(scope="module")
def smol_served(server_backend, url):
    return server_backend, url


def test_inspect_ai_evaluates_a_steered_model_with_stop_seqs_and_two_choices(url, server_backend, tmp_path,
                                                                              monkeypatch):
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import MemoryDataset, Sample
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate, system_message

    monkeypatch.setenv("DRIFTLAB_API_KEY", "none")
    monkeypatch.setenv("DRIFTLAB_BASE_URL", f"{url}/v1")
    system = "Answer with the number only."
    samples = [Sample(input=f"What is {a} + {a}?", target=str(2 * a)) for a in range(1, 4)]
    task = Task(dataset=MemoryDataset(samples), solver=[system_message(system), generate()], scorer=includes())
    log = inspect_eval(task, model=f"openai-api/driftlab/{MODEL}+{STEER}", max_tokens=12, temperature=0.0,
                       stop_seqs=["\n"], num_choices=2, log_dir=str(tmp_path), display="none")[0]
    assert log.status == "success", log.error
    assert log.eval.model.endswith(f"{MODEL}+{STEER}")  # the steer is recorded with the results
    # Independently: driftlab's own greedy replies to the same conversations under the same steer.
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": s.input}] for s in samples]
    ours = server_backend.generate(ChatRequest(convs, Sampling(max_new_tokens=12, temperature=0),
                                               interventions=Interventions.parse([STEER])))
    expected = [r.text.split("\n")[0].strip() for r in ours]
    got = {s.id: s for s in log.samples}
    for i in range(1, len(samples) + 1):
        out = got[i].output
        assert [c.message.text for c in out.choices] == [expected[i - 1]] * 2  # greedy: both choices agree
    accuracy = log.results.scores[0].metrics["accuracy"].value
    assert accuracy == pytest.approx(sum(s.target in e for s, e in zip(samples, expected, strict=True)) / len(samples))


FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "lm_eval"


def _lm_eval(model: str, model_args: dict, tasks: list[str], monkeypatch, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args={"num_concurrent": 1, "max_retries": 1, **model_args},
                                   tasks=tasks, log_samples=True,
                                   # The fixture tasks only: indexing lm-eval's own ~14k task files takes ~10 s a call.
                                   task_manager=TaskManager(include_path=str(FIXTURES), include_defaults=False),
                                   **kwargs)


@pytest.mark.model
@pytest.mark.parametrize("steer, served", [pytest.param([], "tiny_served", id="steer0"),
                                           pytest.param([STEER], "smol_served", id="steer1")])
def test_lm_eval_local_completions_scores_multiple_choice_as_driftlab_does(request, steer, served, monkeypatch):
    """lm-eval's log-likelihood path (token ids, echo, logprobs) against the server, with the
    system instruction in the chat template lm-eval renders with the model's tokenizer (its
    remote tokenizer hands chat templates back unrendered), steered by the model name: every log-likelihood lm-eval logs equals driftlab's in-process score of the same
    text, and its accuracy is the argmax over them. Steered on SmolLM2; unsteered on the tiny model
    (the same path, no steer: driftlab's numbers against lm-eval's)."""
    from driftlab.chat import text as T

    server_backend, url = request.getfixturevalue(served)
    model = "+".join([MODEL, *steer])
    out = _lm_eval("local-completions", {"model": model, "base_url": f"{url}/v1/completions", "batch_size": 8,
                                         "tokenizer_backend": "huggingface", "tokenizer": str(server_backend.path)},
                   ["driftlab_mc", "driftlab_arith"], monkeypatch, limit=2, apply_chat_template=True,
                   system_instruction="Always reply in French.")
    assert out["config"]["model_args"]["model"] == model  # the steer is recorded with the results
    iv = Interventions.parse(steer)
    correct = []
    for sample in out["samples"]["driftlab_mc"]:
        fulls, lasts, lls = [], [], []
        for (context, continuation), (ll, _greedy) in zip((a for a in sample["arguments"]),
                                                          (r[0] for r in sample["resps"]), strict=True):
            # lm-eval (TemplateLM._encode_pair) moves the context's trailing whitespace, the "\n" after
            # "assistant", into the continuation: its log-prob is in lm-eval's number (SmolLM2's ~ -2e-4).
            ctx = T.encode(server_backend, context.rstrip(), T.SystemSpan(chat=True), special=False)
            assert ctx.system_span is not None  # the system instruction was found in lm-eval's prompt
            fulls.append(T.encode(server_backend, context + continuation, T.SystemSpan(chat=True), special=False))
            lasts.append(len(fulls[-1].ids) - len(ctx.ids))
            lls.append(ll)
        ours = [sum(s.logprobs) for s in T.score(server_backend, fulls, iv, last=lasts)]
        assert lls == pytest.approx(ours, abs=1e-3)  # float32 sums differ ~1e-4 between batch layouts
        correct.append(float(max(range(len(ours)), key=ours.__getitem__) == sample["target"]))
        assert sample["acc"] == correct[-1]
    assert out["results"]["driftlab_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    for sample in out["samples"]["driftlab_arith"]:  # generate_until through /v1/completions: raw text, cut at until
        (context, gen_kwargs), = sample["arguments"]
        prompt = T.encode(server_backend, context, T.SystemSpan(chat=True), special=False)
        ours = server_backend.generate(ChatRequest([prompt], Sampling(max_new_tokens=gen_kwargs["max_gen_toks"],
                                                                      temperature=0), interventions=iv))[0]
        assert sample["resps"][0][0] == server_backend.decode(ours.token_ids).split("\n")[0]


def test_lm_eval_local_chat_completions_generates_with_the_tasks_stop_and_a_per_request_steer(url, server_backend,
                                                                                              monkeypatch):
    """lm-eval's generate path through chat completions: the task's `until` is sent as `stop`
    (a 422 before issue 34), the steer rides in gen_kwargs' `driftlab` field, and every logged
    response is driftlab's own greedy reply to the same messages, cut at the stop."""
    import json

    out = _lm_eval("local-chat-completions", {"model": MODEL, "base_url": f"{url}/v1/chat/completions"},
                   ["driftlab_arith"], monkeypatch, limit=3, apply_chat_template=True,
                   system_instruction="Answer with the number only.",
                   gen_kwargs={"driftlab": {"steer": [STEER]}, "temperature": 0})
    iv = Interventions.parse([STEER])
    for sample in out["samples"]["driftlab_arith"]:
        (context, *_), _gen_kwargs = sample["arguments"][0]
        messages = json.loads(context)
        ours = server_backend.generate(ChatRequest([messages], Sampling(max_new_tokens=4, temperature=0),
                                                   interventions=iv))[0]
        assert sample["resps"][0][0] == ours.text.split("\n")[0].strip()
    assert "exact_match,none" in out["results"]["driftlab_arith"]
