"""DriftlabLM, the lm-evaluation-harness adapter: lm-eval's own HFLM is the reference.

Without a steer its log-likelihoods, greedy flags and greedy generations equal HFLM's on the
same weights; with one, a chat-template prompt is steered as the conversation path steers the
same conversation (the system span is found); `simple_evaluate` runs the fixture tasks of
tests/fixtures/lm_eval offline, and its accuracy equals an argmax computed directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from driftlab.errors import DriftlabError  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
SYSTEM = "Answer with the letter of the right option only."


def _ll(pairs):
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@pytest.fixture(scope="module")
def hflm(smol_dir):
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32)
    return HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(str(smol_dir)), batch_size=4, device="cpu",
                max_length=48)


@pytest.fixture(scope="module")
def plain(smol32):
    from driftlab.integrations.lm_eval import DriftlabLM

    return DriftlabLM(model=smol32, batch_size=4, max_length=48)


def test_loglikelihoods_and_greedy_flags_equal_hflm(hflm, plain):
    reqs = _ll([("The capital of France is", " Paris"), ("The capital of France is ", "London"),  # trailing space
                ("", "Hello world"),  # empty context: the prefix token
                ("2 + 2 =", " 4"), ("2 + 2 =", " 5"), ("2 + 2 =", " 4"),  # options of one question, a duplicate
                ("Q: What color is the sky?\nA:", " blue, mostly"),
                ("word " * 60, "end of a context cut to the window")])  # longer than max_length
    ours, ref = plain.loglikelihood(reqs, disable_tqdm=True), hflm.loglikelihood(reqs, disable_tqdm=True)
    assert [g for _, g in ours] == [g for _, g in ref]
    assert any(g for _, g in ref)
    assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in ref], abs=2e-4)


def test_rolling_windows_equal_hflm(hflm, plain):
    reqs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(
        ["The quick brown fox jumps over the lazy dog. " * 7, "Short text here."])]  # 70 tokens: 2 windows of 48
    assert plain.loglikelihood_rolling(reqs, disable_tqdm=True) == pytest.approx(
        hflm.loglikelihood_rolling(reqs, disable_tqdm=True), abs=5e-4)


def test_greedy_generation_equals_hflm(hflm, plain):
    reqs = [Instance("generate_until", {}, args, i) for i, args in enumerate([
        ("Q: What is 2 + 3?\nA:", {"until": ["\n"], "max_gen_toks": 8}),
        ("List three colors:", {"until": [","], "max_gen_toks": 6}),
        ("1 + 1 = 2\n4 + 4 =", {"until": ["\n", "+"], "max_gen_toks": 6, "do_sample": False})])]
    ours = plain.generate_until(reqs, disable_tqdm=True)
    assert ours == hflm.generate_until(reqs, disable_tqdm=True)
    assert all(ours) and not any("\n" in t for t in ours)
    with pytest.raises(DriftlabError, match="num_beams"):
        plain.generate_until([Instance("generate_until", {}, ("Hi", {"num_beams": 2}), 0)])


def test_steer_acts_on_the_chat_templates_system_span(smol32):
    """A prompt rendered client-side with the chat template is steered as the conversation is."""
    from driftlab.integrations.lm_eval import DriftlabLM
    from driftlab.steering.interventions import Interventions

    conv = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Which is a fruit?\nA. carrot\nB. apple\nC. potato\nAnswer:"}]
    steered = DriftlabLM(model=smol32, steer="instaboost:m=5")
    context = steered.apply_chat_template(conv)
    assert context.startswith("<|im_start|>system\n" + SYSTEM)
    reqs = _ll([(context, c) for c in ("A", "B", "C")])
    ours = steered.loglikelihood(reqs, disable_tqdm=True)
    assert steered._encode(context)[1] == smol32.render(conv).system_span  # the span the conversation path steers
    ref = smol32.loglikelihood([conv] * 3, ["A", "B", "C"], Interventions.parse(["instaboost:m=5"]))
    # As in HFLM, the context's trailing "\n" moves to the continuation: its log-prob (~ -2e-4) is
    # in lm-eval's number, not in the conversation path's (which scores "A" after "assistant\n").
    assert [lp for lp, _ in ours] == pytest.approx([r.logprob for r in ref], abs=1e-3)
    assert [g for _, g in ours] == [r.is_greedy for r in ref]
    unsteered = DriftlabLM(model=smol32).loglikelihood(reqs, disable_tqdm=True)
    assert max(abs(a[0] - b[0]) for a, b in zip(ours, unsteered, strict=True)) > 1e-2
    # A marker names the span in raw text; several steers are separated by ';'.
    two = DriftlabLM(model=smol32, steer="split-softmax:k=0.8;instaboost:m=5", system="until:\nQuestion:")
    assert two.steer.kinds == {"split-softmax", "instaboost"}
    raw = two.loglikelihood(_ll([(f"{SYSTEM}\nQuestion: 1 + 1?\nAnswer:", " 2")]), disable_tqdm=True)
    assert raw[0][0] != pytest.approx(DriftlabLM(model=smol32).loglikelihood(
        _ll([(f"{SYSTEM}\nQuestion: 1 + 1?\nAnswer:", " 2")]), disable_tqdm=True)[0][0], abs=1e-3)


def _pairs(sample):
    """A logged sample's (context, continuation) requests, whatever shape the log gives them."""
    args = sample["arguments"]
    args = list(args.values()) if isinstance(args, dict) else args
    return [tuple(a.values()) if isinstance(a, dict) else tuple(a) for a in args]


def _argmax_accuracy(backend, samples, system, steer=()):
    """Accuracy over the samples' own requests, scored directly with driftlab.chat.text."""
    from driftlab.chat import text
    from driftlab.steering.interventions import Interventions

    iv, right = Interventions.parse(list(steer)), 0
    for sample in samples:
        scores = []
        for context, continuation in _pairs(sample):
            ctx = text.encode(backend, context, system)
            whole = text.encode(backend, context + continuation, system)
            assert whole.system_span == ctx.system_span and (whole.system_span is not None) == bool(steer)
            n = len(whole.ids) - len(ctx.ids)
            scores.append(sum(text.score(backend, [whole], iv, last=[n], generated=[n])[0].logprobs))
        right += max(range(len(scores)), key=scores.__getitem__) == int(sample["target"])
    return right / len(samples)


def test_simple_evaluate_on_fixture_tasks(smol32, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from driftlab.chat.text import SystemSpan
    from driftlab.integrations.lm_eval import DriftlabLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = TaskManager(include_path=str(FIXTURES), include_defaults=False)
    out = lm_eval.simple_evaluate(model=DriftlabLM(model=smol32), tasks=["driftlab_mc", "driftlab_arith"],
                                  task_manager=tasks, limit=4, log_samples=True, verbosity="ERROR")
    res = out["results"]
    assert res["driftlab_mc"]["acc,none"] == _argmax_accuracy(smol32, out["samples"]["driftlab_mc"], SystemSpan())
    assert res["driftlab_arith"]["exact_match,none"] >= 0.5  # "1 + 1 = 2\n5 - 2 = 3\n2 + 3 =" -> " 5"
    assert res["driftlab_mc"]["sample_len"] == 4
    steered = lm_eval.simple_evaluate(
        model=DriftlabLM(model=smol32, steer=["instaboost:m=5"]), tasks=["driftlab_mc"], task_manager=tasks,
        limit=2, log_samples=True, apply_chat_template=True, system_instruction=SYSTEM, verbosity="ERROR")
    samples = steered["samples"]["driftlab_mc"]
    assert all(c.startswith("<|im_start|>system\n" + SYSTEM) for s in samples for c, _ in _pairs(s))
    acc = steered["results"]["driftlab_mc"]["acc,none"]
    assert acc == _argmax_accuracy(smol32, samples, SystemSpan(chat=True), ["instaboost:m=5"])
    assert steered["config"]["driftlab_steer"] == ["instaboost:m=5.0"]


def test_model_args_registry_and_refusals(smol32, monkeypatch):
    import lm_eval.api.registry as registry

    import driftlab.integrations.lm_eval as mod

    assert registry.get_model("driftlab") is mod.DriftlabLM
    seen = {}
    monkeypatch.setattr(mod, "_backend", lambda model, dtype, device: seen.update(model=model, dtype=dtype) or smol32)
    lm = mod.DriftlabLM.create_from_arg_string(
        "pretrained=smollm2-135m,dtype=float32,steer=pasta:alpha=0.01,heads=3.1,span=system;split-softmax:k=0.8,"
        "system=until:Q,max_length=512", {"batch_size": 2, "device": None})
    assert seen == {"model": "smollm2-135m", "dtype": "float32"}
    assert lm.steer.kinds == {"pasta", "split-softmax"} and lm.batch_size == 2 and lm.max_length == 512
    assert lm.system.until == "Q"
    # lm-eval's CLI splits --model_args at every comma into a dict: the steer's settings are put back.
    lm = mod.DriftlabLM.create_from_arg_obj({"pretrained": "x", "steer": "pasta:alpha=0.01", "heads": "3.1", "span": "system"})
    assert lm.steer.specs()[0].startswith("pasta:") and "3.1" in lm.steer.specs()[0]
    with pytest.raises(DriftlabError, match="no argument 'temperature'"):
        mod.DriftlabLM.create_from_arg_obj({"pretrained": "x", "temperature": 1})
    with pytest.raises(DriftlabError, match="edits a conversation"):
        mod.DriftlabLM(model=smol32, steer="spr:p=0.5")
    with pytest.raises(DriftlabError, match="system="):
        mod.DriftlabLM(model=smol32, system="after:X")
    monkeypatch.undo()
    with pytest.raises(DriftlabError, match="local models"):
        mod.DriftlabLM(model="openai:some-served-model")
    with pytest.raises(DriftlabError, match="from_model"):
        mod.DriftlabLM(model=smol32.model)


@pytest.mark.process  # fresh interpreters
def test_driftlab_imports_without_lm_eval_and_cli_wrapper_registers():
    code = "import sys, driftlab, driftlab.integrations; assert 'lm_eval' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "driftlab.integrations.lm_eval", "run", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--model_args" in out.stdout


# `python -m driftlab.integrations.lm_eval ARGS`, run as -m runs a module (runpy, as __main__), less
# lm-eval's index of its own ~14k task files (~6 s of a CPU, lm-eval's work, not the wrapper's): the
# CLI's task manager reads --include_path's fixture tasks only, as _lm_eval's in test_harnesses.py.
_CLI_ON_FIXTURE_TASKS = """
import runpy
import lm_eval.tasks

class FixtureTasksOnly(lm_eval.tasks.TaskManager):
    def __init__(self, *args, include_defaults=False, **kwargs):
        super().__init__(*args, include_defaults=include_defaults, **kwargs)

lm_eval.tasks.TaskManager = FixtureTasksOnly
runpy.run_module("driftlab.integrations.lm_eval", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_lm_eval_cli_runs_driftlab(tmp_path):
    """`python -m driftlab.integrations.lm_eval run --model driftlab ...` end to end (lm-eval 0.4.13 has
    no entry point for models: the wrapper registers "driftlab" before lm-eval's own CLI runs). The
    model is a tiny random Qwen2 (tests/tiny_models.py): what runs here is the wrapper and lm-eval's
    CLI; DriftlabLM's numbers on SmolLM2 are the tests above."""
    from tiny_models import make_tiny_model

    model = make_tiny_model("qwen2", tmp_path / "tiny")
    env = {**__import__("os").environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-c", _CLI_ON_FIXTURE_TASKS, "run", "--model", "driftlab", "--model_args",
         f"pretrained={model},dtype=float32,steer=split-softmax:k=0.8", "--tasks", "driftlab_mc",
         "--include_path", str(FIXTURES), "--limit", "2", "--output_path", str(tmp_path / "out")],
        check=True, env=env, capture_output=True, text=True, timeout=600)
    found = list((tmp_path / "out").rglob("results_*.json"))
    assert found and "driftlab_mc" in json.loads(found[0].read_text())["results"]
