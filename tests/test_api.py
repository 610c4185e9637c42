"""The Python face, `import driftlab as dl`: protocols from code, your own personas and measures.

Fast tests check the keyword mapping and its errors without a model; a tiny random model runs
self-chat and MMLU through the API against the same protocols run by their configs (the CLI's
path), and the real SmolLM2 runs a persona of the test's own with a measure written here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import driftlab as dl
from driftlab import api
from driftlab.chat.spec import BackendSpec
from driftlab.errors import DriftlabError

RAW = Path(__file__).parent / "fixtures" / "mmlu_raw_sample.jsonl"


@pytest.fixture(autouse=True)
def _measures_registered_here_are_forgotten():
    """Measures these tests register stay out of the tests that check every built-in measure."""
    from driftlab.bench import measures

    before = {name: (dict(table)) for name, table in (("m", measures.MEASURES), ("p", measures._PARAMS),
                                                       ("c", measures._CUSTOM))}
    complete = dict(measures._NEEDS_COMPLETE)
    yield
    for name, table in (("m", measures.MEASURES), ("p", measures._PARAMS), ("c", measures._CUSTOM)):
        table.clear()
        table.update(before[name])
    measures._NEEDS_COMPLETE.clear()
    measures._NEEDS_COMPLETE.update(complete)


def test_import_driftlab_is_cheap_and_lists_its_api():
    code = "import sys, driftlab as dl; print('torch' in sys.modules, sorted(dir(dl)))"
    torch_loaded, names = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                         check=True).stdout.split(" ", 1)
    assert torch_loaded == "False"
    for name in ("load", "from_model", "steer", "trace", "selfchat", "mmlu", "sweep", "Persona", "measure"):
        assert f"'{name}'" in names
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dl.nope  # noqa: B018


def test_keywords_map_onto_the_protocol_config():
    from driftlab.api.options import KEYWORDS, selfchat_config

    cfg = selfchat_config(BackendSpec(), KEYWORDS, {"pair": "reply-in-french:very-happy", "max_new_tokens": 12,
                                                    "greedy": True, "steer": "split-softmax:k=0.5", "rounds": 3})
    assert cfg.pair_ids == [("reply-in-french", "very-happy")] and cfg.rounds == 3
    assert cfg.sampling.max_new_tokens == 12 and cfg.sampling.greedy
    assert cfg.steer.specs() == ["split-softmax:k=0.5,heads=all"]
    two = selfchat_config(BackendSpec(), KEYWORDS, {"pair": [("a-b", "c-d"), "e:f"]})
    assert two.pair_ids == [("a-b", "c-d"), ("e", "f")]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: dl.selfchat(None, roundz=3), "unknown keyword for driftlab.selfchat(): roundz=; did you mean rounds=?"),
    (lambda: dl.selfchat(None, rounds=0), "Invalid rounds=0: input should be greater than or equal to 1"),
    (lambda: dl.selfchat(None, pair="french"), "pair 'french' is not AGENT_ID:USER_ID or (agent_id, user_id)"),
    (lambda: dl.selfchat(None, system="Be terse."), "needs system=, probe= and measure=; probe=, measure= missing"),
    (lambda: dl.mmlu(None, n=0), "Invalid n=0"),
    (lambda: dl.load("smollm2-135m", dtpye="float32"), "unknown keyword for driftlab.load(): dtpye=; did you "
                                                        "mean dtype=?"),
    (lambda: dl.load("smollm2-135m", dtype="float8"), "Invalid dtype='float8'"),
])
def test_bad_keywords_are_one_line_errors_before_any_model_loads(call, message):
    with pytest.raises(DriftlabError) as err:
        call()
    assert message in str(err.value) and "\n" not in err.value.message


def test_a_persona_from_code_takes_a_function_as_its_measure():
    def says_bonjour(text: str) -> float:
        return float("bonjour" in text.lower())

    p = dl.Persona(system_prompt="Always greet with 'Bonjour'.", probe="Hello?", measure=says_bonjour)
    assert p.id.startswith("custom-") and p.category == "custom" and p.measure == "says_bonjour"
    assert p.score("Bonjour, ami") == 1.0 and p.score("Hello") == 0.0
    assert dl.Persona.model_validate(p.model_dump()) == p  # what a manifest records reads back
    assert p.score("   ") == 0.0  # a blank reply follows no instruction, whatever the measure


def test_measure_decorator_names_and_guards():
    @dl.measure(name="short-reply")
    def short(text: str) -> float:
        return float(len(text.split()) <= 5)

    assert dl.Persona(id="terse", system_prompt="Be terse.", probe="Hi?", measure="short-reply").score("Ok.") == 1.0
    with pytest.raises(DriftlabError, match="already taken by a built-in measure"):
        dl.measure(short, name="language")
    with pytest.raises(DriftlabError, match="pass name="):
        dl.measure(lambda text: 1.0)
    out_of_range = dl.Persona(id="loud", system_prompt="Shout.", probe="Hi?",
                              measure=dl.measure(lambda t: 2.5, name="two-and-a-half"))
    with pytest.raises(ValueError, match=r"returned 2.5, not a number in \[0, 1\]"):
        out_of_range.score("HI")
    nan = dl.Persona(id="nan", system_prompt="x", probe="y", measure=dl.measure(lambda t: math.nan, name="nan"))
    with pytest.raises(ValueError, match="not a number in"):
        nan.score("hi")


def test_a_model_held_in_memory_is_recorded_but_never_loaded_by_name():
    spec = BackendSpec(model="memory:my-finetune")
    from driftlab.chat.factory import make_backend

    with pytest.raises(DriftlabError, match="held in memory"):
        make_backend(spec)
    with pytest.raises(ValueError, match="needs a name"):
        BackendSpec(model="memory:")


# -- on a tiny random model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")
    return dl.load(str(path), dtype="float32", device="cpu")


def _sans_volatile(records):
    return [{k: v for k, v in r.items() if k not in ("elapsed",)} for r in records]


def test_selfchat_in_memory_equals_the_protocol_run_by_its_config(tiny, tmp_path):
    from driftlab.protocol.runner import run_protocol
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig

    options = {"pair": "reply-in-french:very-happy", "rounds": 2, "max_new_tokens": 6, "probe_tokens": 4,
               "user_probe": True, "seed": 3}
    run = dl.selfchat(tiny, progress=False, **options)
    assert run.path is None and run.protocol == "selfchat" and run.manifest["completed"]
    config = SelfChatConfig(backend=api.spec_of(tiny), pair_ids=[("reply-in-french", "very-happy")], pairs=0, rounds=2,
                            sampling={"max_new_tokens": 6}, probe_tokens=4, user_probe=True, seed=3)
    reference = run_protocol(SelfChat(config, tiny), tmp_path / "ref", progress=False)
    want = reference.records()
    assert _sans_volatile(run.records) == _sans_volatile(want)
    assert len(run.records) == 3 + 4  # turns a_2, b_1, b_2; probes: agent and user in rounds 1 and 2
    frame = run.to_pandas()
    assert set(frame.protocol) == {"selfchat"} and set(frame.dtype) == {"float32"} and set(frame.run_seed) == {3}
    overall = run.summary.overall
    agent = overall[(overall.target == "agent") & (overall.category == "all")]
    assert list(agent.n) == [1]  # one dialog: the unit of the stability mean

    kept = dl.selfchat(tiny, out=tmp_path / "kept", progress=False, **options)
    assert kept.path == tmp_path / "kept" and (tmp_path / "kept" / "manifest.json").is_file()
    again = dl.selfchat(tiny, out=tmp_path / "kept", progress=False, **options)  # resumes: nothing left to do
    assert _sans_volatile(again.records) == _sans_volatile(kept.records)
    with pytest.raises(DriftlabError, match="rounds"):  # a resume with another setting is refused, as in the CLI
        dl.selfchat(tiny, out=tmp_path / "kept", progress=False, **{**options, "rounds": 3})


def test_a_measure_that_fails_is_recorded_and_the_run_goes_on(tiny):
    calls = []

    def flaky(text: str) -> float:
        calls.append(text)
        if len(calls) % 2:
            raise RuntimeError("judge timed out")
        return math.nan

    run = dl.selfchat(tiny, system="Answer in one word.", probe="What colour is the sky?", measure=flaky,
                      pairs=2, rounds=2, max_new_tokens=4, probe_tokens=4, progress=False)
    probes = [r for r in run.records if r["kind"] == "probe"]
    assert len(probes) == 4 == len(calls)
    assert all(r["score"] is None for r in probes)
    errors = sorted(r["error"] for r in probes)
    assert errors[:2] == ["MeasureError: measure 'flaky' returned nan, not a number in [0, 1]"] * 2
    assert errors[2:] == ["RuntimeError: judge timed out"] * 2
    assert {r["persona"] for r in probes} == {dl.Persona(system_prompt="Answer in one word.", probe="x",
                                                         measure="language", params={"lang": "en"}).id}
    assert int(run.summary.truncation.probes_error.sum()) == 4


def test_own_persona_is_the_agent_of_every_pair_and_resumes_when_registered_again(tiny, tmp_path):
    def has_digit(text: str) -> float:
        return float(any(c.isdigit() for c in text))

    options = {"system": "Always include a number.", "probe": "How are you?", "measure": has_digit,
               "pairs": 3, "rounds": 1, "max_new_tokens": 4, "probe_tokens": 4}
    run = dl.selfchat(tiny, out=tmp_path / "own", progress=False, **options)
    pairs = run.manifest["pairs"]
    agent = dl.Persona(system_prompt="Always include a number.", probe="x", measure=has_digit).id
    assert [p["agent"] for p in pairs] == [agent] * 3 and len({p["user"] for p in pairs}) >= 2
    for r in run.records:
        if r["kind"] == "probe":
            assert r["score"] == has_digit(r["text"])
    manifest = json.loads((tmp_path / "own" / "manifest.json").read_text())
    assert manifest["config"]["personas"][0]["measure"] == "has_digit"


def test_mmlu_in_memory_matches_its_summary(tiny, tmp_path):
    from driftlab.protocol.mmlu import summarize

    run = dl.mmlu(tiny, out=tmp_path / "mmlu", n=12, turn=0, data=str(RAW), steer="split-softmax:k=0.5",
                  progress=False)
    same = json.dumps(run.summary, sort_keys=True, default=str) == json.dumps(summarize(tmp_path / "mmlu"),
                                                                             sort_keys=True, default=str)
    assert same and run.summary["n"] == 12  # (json: NaN where the run has no history compares equal)
    assert {r["condition"] for r in run.records} == {"plain", "steered"} and len(run.records) == 24
    assert set(run.to_pandas().steer) == {"split-softmax:k=0.5,heads=all"}


# -- on the real model ------------------------------------------------------------------------------
def test_own_persona_on_the_real_model_scores_with_the_callers_function(smol32):
    def mentions_paris(text: str) -> float:
        return float("paris" in text.lower())

    run = dl.selfchat(smol32, system="You live in Paris and mention Paris in every reply.",
                      probe="Where do you live?", measure=mentions_paris, pairs=1, rounds=1,
                      max_new_tokens=16, probe_tokens=16, greedy=True, progress=False)
    probes = [r for r in run.records if r["kind"] == "probe"]
    assert len(probes) == 1
    assert [r["score"] for r in probes] == [mentions_paris(r["text"]) for r in probes]
    assert run.manifest["models"]["agent"]["dtype"] == "float32"
