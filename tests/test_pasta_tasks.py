"""PASTA's tasks, evaluation and head profiling: prompts per baseline, and real runs.

The runs use tiny settings (a few examples, a few tokens, one or two layers): what they
check is the protocol — records, resume after kill -9, the ranking and the heatmap, that
each baseline really prompts differently — not the model's accuracy. One eval (every
baseline, resumed) and one profile (the answer's likelihood) run on SmolLM2; the other
options (a scoring task's metrics, generated text's metrics, profiling by a task's metric)
are bookkeeping over the same engine and run on a tiny random Qwen2 (tests/tiny_models.py).
"""

from __future__ import annotations

import json

import pytest

from devices import backend_device
from driftlab.chat import BackendSpec
from driftlab.errors import DriftlabError
from driftlab.pasta.evaluate import PastaEvalConfig
from driftlab.pasta.profile import ProfileConfig
from driftlab.pasta.tasks import BASELINES, PROMPTS, TASKS, Prompt, get_task, they_version
from driftlab.protocol.runner import run_protocol
from driftlab.records.rundir import RunDir


def test_prompt_renders_each_baseline() -> None:
    p = Prompt("Ctx with 2*3. ", "Do *this*.", " Tail")
    assert p.render("zero-shot") == "Ctx with 2*3. Do *this*. Tail"
    assert p.render("marked") == "Ctx with 2*3. *Do *this*.* Tail"
    assert p.render("quoted") == 'Ctx with 2*3. "Do *this*." Tail'
    # pasta: literal asterisks escaped, so only the span becomes emphasis
    from driftlab.steering.emphasis import parse_marked

    text, spans = parse_marked(p.render("pasta"))
    assert text == p.render("zero-shot") and [text[s:e] for s, e in spans] == ["Do *this*."]


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_builds_its_examples_and_emphasises_its_span(name) -> None:
    task = get_task(name)
    train, test = task.examples("train"), task.examples("test")
    assert len(train) == 28 if name != "counterfact" else len(train) == 20
    assert len(test) == 84 if name != "counterfact" else len(test) == 40
    ex = test[0]
    shots = task.examples("train", 3)
    convs = {b: task.conversation(ex, b, shots) for b in BASELINES}
    assert len(convs["few-shot"]) == 7 and all(len(c) == 1 for b, c in convs.items() if b != "few-shot")
    # few-shot asks the zero-shot text; pasta's markup is marked's text, which the backend
    # turns into emphasis (the model then sees the zero-shot text)
    assert len({c[-1]["content"] for c in convs.values()}) == 3
    assert convs["pasta"][-1]["content"] == convs["marked"][-1]["content"] or "*" in ex.prompt.before
    if task.mode == "score":
        assert ex.candidates[ex.target] == ex.answer and len(set(ex.candidates)) == len(ex.candidates)
    emphasised = {"json": "generate the answer as json", "pronouns": "substitute 'she' and 'he'",
                  "biasbios": ex.prompt.span, "counterfact": "Currently,"}[name]
    assert emphasised in ex.prompt.span


@pytest.mark.parametrize("name", ["json", "pronouns"])
def test_prompt_wordings_change_only_the_emphasised_instruction(name) -> None:
    """App. A.1's three wordings (Table 4): same bio and answer, another instruction, always the span."""
    task = get_task(name)
    exs = {p: task.examples("test", 2, None, p)[1] for p in PROMPTS}
    bio = exs["original"].extra["bio"]
    assert len({e.prompt.span for e in exs.values()}) == 3 and len({e.answer for e in exs.values()}) == 1
    for e in exs.values():
        text = e.prompt.render("zero-shot")
        assert bio.rstrip() in text and bio.split(".")[0] not in e.prompt.span
        assert ("json format" if name == "json" else "'they'") in e.prompt.span
    if name == "json":
        assert exs["original"].prompt.render("zero-shot").endswith("Now generate the answer.")
        assert "Here is an example" not in exs["shortened"].prompt.render("zero-shot")
        rephrased = exs["rephrased"].prompt
        assert rephrased.before == "" and rephrased.render("zero-shot").startswith("Answer the occupation of")
        assert rephrased.after.endswith("Now generate the answer.")
    else:
        assert "replace 'she' and 'he'" in exs["rephrased"].prompt.span


def test_they_version_rewrites_pronouns() -> None:
    out = they_version("She is a nurse. Her patients love her, and he said his mother knew him herself.")
    assert out == "They are a nurse. Their patients love them, and they said their mother knew them themselves."
    from driftlab.pasta.metrics import pronoun_scores

    assert pronoun_scores(out) == (True, True)


def test_json_and_pronoun_scoring_of_replies() -> None:
    json_task, pron = get_task("json"), get_task("pronouns")
    ex = json_task.examples("test", 1)[0]
    good = json.dumps({"name": "x", "occupation": ex.extra["occupation"].replace("_", " ")})
    assert json_task.score_reply(ex, f"Sure: {good}") == {"format_acc": 1.0, "prediction_acc": 1.0, "score": 1.0}
    assert json_task.score_reply(ex, '{"name": "x", "occupation": "astronaut"}')["prediction_acc"] == 0.0
    assert json_task.score_reply(ex, "She is a nurse.")["score"] == 0.0
    pex = pron.examples("test", 1)[0]
    good = pron.score_reply(pex, they_version(pex.extra["bio"]))
    assert good["acc"] == good["all_acc"] == 1.0 and good["fluency"] > 3.0
    assert pron.score_reply(pex, pex.extra["bio"])["acc"] == 0.0
    # No pronoun is also "changed" (pastalib's definition); fluency and consistency expose it.
    off_topic = pron.score_reply(pex, "I like trains. I like trains. I like trains.")
    assert off_topic["acc"] == 1.0 and off_topic["fluency"] < 3.0 and off_topic["consistency"] < good["consistency"]
    assert good["they_acc"] == 1.0 and off_topic["they_acc"] == 0.0  # the stricter check sees it


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"task": "poems"}, "unknown task"),
        ({"task": "json", "baselines": ["zero-shot", "loud"]}, "unknown baseline"),
        ({"task": "json", "baselines": ["pasta"]}, "needs heads"),
        ({"task": "json", "steer": ["pasta:heads=1,span=system"]}, "span=marked"),
        ({"task": "biasbios", "prompt": "rephrased"}, "no 'rephrased' prompt"),
        ({"task": "json", "prompt": "longer"}, "original"),
        ({"task": "json", "split": "train"}, "valid"),
        ({"task": "json", "baselines": ["zero-shot"], "generate_tokens": 8}, "already generates"),
    ],
)
def test_eval_config_errors(kwargs, match) -> None:
    from pydantic import ValidationError

    with pytest.raises((ValidationError, DriftlabError), match=match):
        PastaEvalConfig(**kwargs)


def test_profile_config_takes_layers_only() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="layers only"):
        ProfileConfig(task="json", layers="3.1")
    assert ProfileConfig(task="json", layers="0-2+5").layers == "0-2+5"
    with pytest.raises(DriftlabError, match="no 'shortened' prompt"):
        ProfileConfig(task="counterfact", prompt="shortened")


# -- real runs: SmolLM2 once per feature, the options on a tiny model ------------------------------
TINY_HEADS = "0-2"  # every layer of the tiny Qwen2 (3 layers of 4 heads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen2 with SmolLM2's tokenizer: the options' bookkeeping in milliseconds a pass."""
    from driftlab.chat.hf import HFChatBackend
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("pasta") / "qwen2")
    return HFChatBackend(str(path), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


@pytest.mark.model
def test_eval_runs_every_baseline_and_resumes(tmp_path, smol32) -> None:
    from driftlab.pasta.evaluate import PastaEval, summarize
    from driftlab.report.pasta import write_pasta_figures

    cfg = PastaEvalConfig(task="json", n=2, max_new_tokens=6, backend=BackendSpec(dtype="float32", device=backend_device()),
                          baselines=list(BASELINES), steer=["pasta:heads=all,alpha=0.01"])
    run_protocol(PastaEval(cfg, smol32), tmp_path / "eval", progress=False)
    rd = RunDir(tmp_path / "eval")
    recs = rd.records()
    assert len(recs) == 2 * len(BASELINES)
    texts = {b: [r["text"] for r in recs if r["baseline"] == b] for b in BASELINES}
    assert texts["pasta"] != texts["zero-shot"]  # steering changed the replies
    s = summarize(rd.path)
    assert set(s) == set(BASELINES) and set(s["zero-shot"]) == {"format_acc", "prediction_acc", "score"}
    assert write_pasta_figures(rd.path).stat().st_size > 5000 and (rd.path / "eval.png").is_file()
    size = rd.records_path.stat().st_size
    run_protocol(PastaEval(cfg, smol32), tmp_path / "eval", progress=False)  # resume: nothing to do
    assert rd.records_path.stat().st_size == size


@pytest.mark.model
def test_counterfact_eval_scores_es_and_ps(tmp_path, tiny) -> None:
    """A scoring task's records (on the tiny model: which metrics, not their values)."""
    from driftlab.pasta.evaluate import PastaEval

    cfg = PastaEvalConfig(task="counterfact", n=2, backend=BackendSpec(dtype="float32", device=backend_device()), baselines=["zero-shot", "pasta"],
                          steer=[f"pasta:heads={TINY_HEADS},alpha=0.01"])
    run_protocol(PastaEval(cfg, tiny), tmp_path / "cf", progress=False)
    recs = RunDir(tmp_path / "cf").records()
    assert len(recs) == 4 and all(set(r["metrics"]) == {"es", "ps"} for r in recs)
    assert all(r["metrics"]["ps"] in (0.0, 0.5, 1.0) for r in recs)


@pytest.mark.model
def test_scoring_tasks_also_score_generated_text(tmp_path, tiny) -> None:
    """--generate-tokens (App. E): BiasBios gets fluency and consistency, CounterFact fluency (on the
    tiny model: which metrics a record gets, not how fluent its text is)."""
    from driftlab.pasta.evaluate import PastaEval

    for task, extra in (("biasbios", {"acc", "fluency", "consistency"}), ("counterfact", {"es", "ps", "fluency"})):
        # One example, 16 tokens: which metrics a record gets does not depend on how many there are.
        cfg = PastaEvalConfig(task=task, n=1, generate_tokens=16, backend=BackendSpec(dtype="float32", device=backend_device()),
                              baselines=["zero-shot"])
        run_protocol(PastaEval(cfg, tiny), tmp_path / task, progress=False)
        recs = RunDir(tmp_path / task).records()
        assert len(recs) == 1 and all(set(r["metrics"]) == extra and r["text"] for r in recs)
        assert all(0.0 < r["metrics"]["fluency"] < 10.0 for r in recs)


@pytest.mark.model
@pytest.mark.parametrize("task, score, model, layer, heads", [
    pytest.param("counterfact", "metric", "tiny", 1, 4, id="counterfact-metric"),
    pytest.param("json", "likelihood", "smol32", 5, 9, id="json-likelihood"),
])
def test_profile_scoring_modes(tmp_path, request, task, score, model, layer, heads) -> None:
    """Log-likelihood profiling (a scoring task's metric, or the answer's likelihood): every head of one
    layer. The answer's likelihood on SmolLM2 (9 heads of layer 5); the metric's bookkeeping on the tiny
    model (4 heads of layer 1)."""
    from driftlab.pasta.profile import HeadProfiler, build_profile

    backend = request.getfixturevalue(model)
    # One example: a metric is its 0, 0.5 or 1 either way, and single heads move one answer's likelihood differently.
    cfg = ProfileConfig(task=task, n=1, layers=str(layer), score=score, backend=BackendSpec(dtype="float32", device=backend_device()))
    run_protocol(HeadProfiler(cfg, backend), tmp_path / "p", progress=False)
    profile = build_profile(tmp_path / "p")
    assert [(lay, h) for lay, h, _ in profile.scores] != [] and {lay for lay, _, _ in profile.scores} == {layer}
    assert len(profile.scores) == heads and profile.baseline is not None
    values = [s for _, _, s in profile.scores]
    assert values == sorted(values, reverse=True)
    assert len(set(values)) > 1  # single heads move the answer's likelihood (the tiny model's metric) differently
    if score == "likelihood":
        assert profile.metric == "answer_logprob_per_token" and all(v < 0 for v in values)
    else:
        assert profile.metric == "es" and all(v in (0.0, 0.5, 1.0) for v in values)


def test_paired_gains_are_exact_paired_tests_holm_corrected_across_baselines(tmp_path) -> None:
    from scipy import stats

    from driftlab.pasta.evaluate import ExampleRecord, paired_gains

    rd = RunDir(tmp_path / "e")
    cfg = PastaEvalConfig(task="counterfact", baselines=["zero-shot", "marked", "few-shot"])
    ids = [f"x{i}" for i in range(8)]
    zero = {"es": dict.fromkeys(ids, 0.0), "ps": dict(zip(ids, [0.1, 0.2, 0.0, 0.5, 0.3, 0.3, 0.0, 0.4], strict=True))}
    marked = {"es": {**dict.fromkeys(ids, 0.0), "x0": 1.0, "x1": 1.0, "x2": 1.0},  # 3 better, 0 worse
              "ps": dict(zip(ids, [0.3, 0.6, 0.2, 0.5, 0.9, 0.4, 0.1, 0.8], strict=True))}
    few = {"es": {**dict.fromkeys(ids, 0.0), "x3": 1.0}, "ps": zero["ps"]}
    with rd.writing():
        rd.start(cfg.model_dump(mode="json"), {"examples": [{}] * 8, "baselines": cfg.baselines},
                 protocol="pasta-eval")
        rd.append([ExampleRecord(baseline=b, id=i, metrics={m: v[m][i] for m in v})
                   for b, v in (("zero-shot", zero), ("marked", marked), ("few-shot", few)) for i in ids])
    gains = paired_gains(rd.path)
    assert set(gains) == {"marked", "few-shot"}
    es = gains["marked"]["es"]  # 0/1 metric: exact McNemar, 3 vs 0 -> p = 0.25 (paired by example)
    assert (es.method, es.n, es.better, es.worse, es.tied) == ("exact McNemar", 8, 3, 0, 5)
    assert es.p == pytest.approx(0.25) and es.diff.estimate == pytest.approx(3 / 8)
    assert es.p_holm == pytest.approx(min(1.0, 2 * 0.25)) and "too few pairs" in es.warning()
    assert gains["few-shot"]["es"].p == pytest.approx(1.0) and gains["few-shot"]["es"].p_holm == pytest.approx(1.0)
    ps = gains["marked"]["ps"]  # graded metric: Wilcoxon signed-rank on the per-example differences
    diffs = [marked["ps"][i] - zero["ps"][i] for i in ids]
    nonzero = [d for d in diffs if abs(d) > 1e-12]
    assert ps.method == "Wilcoxon signed-rank (exact)" and ps.tied == 1
    assert ps.p == pytest.approx(stats.wilcoxon(nonzero, method=stats.PermutationMethod(n_resamples=float("inf"))).pvalue)
    assert gains["few-shot"]["ps"].tied == 8 and gains["few-shot"]["ps"].p == 1.0
    assert paired_gains(rd.path, reference="pasta") == {}  # no such baseline in the run
