"""One implementation of each option: the CLI's flags and the API's keywords reach the same code.

`driftlab run/mmlu/sweep/calibrate` and `dl.selfchat/mmlu/sweep/calibrate` both turn their
options into configs through `driftlab.api.options`. The real check: a run the CLI made is
resumed by the API with the same options as keywords, which the runner refuses unless the two
configs are equal (every option and every default), and it generates nothing new. Errors name
the option as each caller spells it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import driftlab as dl
from driftlab.api.options import FLAGS, KEYWORDS, calibrate_config, mmlu_config, selfchat_config, sweep_config
from driftlab.chat.spec import BackendSpec
from driftlab.cli import app
from driftlab.errors import DriftlabError

RAW = Path(__file__).parent / "fixtures" / "mmlu_raw_sample.jsonl"


# -- the mapping, without a model --------------------------------------------------------------------
def test_the_command_lines_shapes_and_pythons_give_one_config(tmp_path):
    personas = tmp_path / "p.jsonl"
    personas.write_text(json.dumps({"id": "terse-x", "category": "format", "system_prompt": "Be terse.",
                                    "probe": "Tell me about Rome.", "measure": "sentence_count",
                                    "params": {"n": 1}}) + "\n")
    spec = BackendSpec()
    as_flags = selfchat_config(spec, FLAGS, {"pair": ["reply-in-french:very-happy", "say-hi:teen-slang"],
                                             "pairs": None, "categories": "language, persona", "rounds": 3,
                                             "persona_file": personas, "probe_tokens": "12", "max_new_tokens": 8,
                                             "temperature": 0.5, "top_p": 0.8, "greedy": False, "steer": None,
                                             "system": None, "probe": None, "measure": None,
                                             "measure_params": None, "judge": None})
    as_keywords = selfchat_config(spec, KEYWORDS, {"pair": [("reply-in-french", "very-happy"), "say-hi:teen-slang"],
                                                   "categories": ["language", "persona"], "rounds": 3,
                                                   "persona_file": str(personas), "probe_tokens": 12,
                                                   "max_new_tokens": 8, "temperature": 0.5, "top_p": 0.8})
    assert as_flags == as_keywords and as_flags.pairs == 0  # named pairs are the run
    assert as_flags.categories == ["language", "persona"] and as_flags.sampling.top_p == 0.8
    assert selfchat_config(spec, FLAGS, {"categories": ""}).categories is None  # empty: no filter

    own = selfchat_config(spec, FLAGS, {"system": "Answer in one sentence.", "probe": "Tell me about London.",
                                        "measure": "sentence_count", "measure_params": '{"n": 1}', "pairs": 2})
    same = selfchat_config(spec, KEYWORDS, {"system": "Answer in one sentence.", "probe": "Tell me about London.",
                                            "measure": "sentence_count", "measure_params": {"n": 1}, "pairs": 2})
    assert own == same and own.agents == [own.personas[0].id] and own.personas[0].params == {"n": 1}


def test_a_sweeps_grid_and_pairs_from_methods_points_and_counts():
    from driftlab.protocol.sweep import GRID, paper_pairs

    spec = BackendSpec()
    by_methods = sweep_config(spec, KEYWORDS, {"methods": "cfg, instaboost", "pairs": 3, "histories": 2,
                                               "ties": "first"})
    assert list(by_methods.grid) == ["cfg", "instaboost"] and by_methods.grid["cfg"] == GRID["cfg"]
    assert by_methods.pair_ids == paper_pairs()[:3] and (by_methods.mmlu_histories, by_methods.mmlu_ties) == (2, "first")
    by_points = sweep_config(spec, FLAGS, {"point": ["cfg:alpha=2", "cfg:alpha=3", "instaboost:m=4"], "pairs": 20,
                                           "personas": "reference"})
    assert [p.spec() for p in by_points.grid["cfg"]] == ["cfg:alpha=2.0", "cfg:alpha=3.0"]
    assert by_points.pair_ids == paper_pairs("reference")
    assert sweep_config(spec, KEYWORDS, {}) == sweep_config(spec, FLAGS, {"pairs": 20, "methods": None})
    lm_eval = sweep_config(spec, KEYWORDS, {"benchmark": "lm-eval:arc_easy"})  # raw text: no spr by default
    assert "spr" not in lm_eval.grid and set(lm_eval.grid) == set(GRID) - {"spr"}

    cal = calibrate_config(spec, FLAGS, {"method": "cfg", "max_mmlu_drop": 0.05, "n": 30, "histories": 3, "turn": 4})
    assert (cal.method, cal.max_drop, cal.mmlu.n, cal.mmlu.histories) == ("cfg", 0.05, 30, 3)
    assert mmlu_config(spec, KEYWORDS, {"steer": "cfg:alpha=2", "data": RAW}).data == str(RAW)


@pytest.mark.parametrize(("verb", "options", "flag_error", "keyword_error"), [
    (selfchat_config, {"rounds": 0}, "Invalid --rounds 0: input should be", "Invalid rounds=0: input should be"),
    (selfchat_config, {"max_new_tokens": -1}, "Invalid --max-new-tokens -1", "Invalid max_new_tokens=-1"),
    (selfchat_config, {"pair": "nope"}, "--pair 'nope' is not AGENT_ID:USER_ID", "pair 'nope' is not AGENT_ID:USER_ID"),
    (selfchat_config, {"measure_params": "{", "system": "s", "probe": "p", "measure": "has_digit"},
     "--measure-params is not JSON", "measure_params is not JSON"),
    (selfchat_config, {"starters": "mine"}, "Invalid --starters mine: use one of reference, driftlab",
     "Invalid starters='mine': use one of reference, driftlab"),
    (selfchat_config, {"roundz": 3}, "unknown option: --roundz; did you mean --rounds?",
     "unknown keyword for driftlab.selfchat(): roundz=; did you mean rounds=?"),
    (mmlu_config, {"n": 0}, "Invalid --n 0", "Invalid n=0"),
    (sweep_config, {"pairs": 21}, "Invalid --pairs 21: use 1 to 20", "Invalid pairs=21: use 1 to 20"),
    (sweep_config, {"methods": "cfg,nope"}, "Invalid --methods cfg,nope: unknown method nope",
     "Invalid methods='cfg,nope': unknown method nope"),
    (sweep_config, {"methods": ""}, "Invalid --methods : no method named", "Invalid methods='': no method named"),
    (selfchat_config, {"pair": 5}, "--pair 5 is not AGENT_ID:USER_ID", "pair 5 is not AGENT_ID:USER_ID"),
    (sweep_config, {"histories": 0}, "Invalid --histories 0", "Invalid histories=0"),
    (sweep_config, {"methods": "cfg", "point": ["cfg:alpha=2"]}, "Give one of --methods, --point",
     "Give one of methods=, point="),
    (calibrate_config, {"method": "cfg", "max_mmlu_drop": 2.0}, "Invalid --max-mmlu-drop 2.0",
     "Invalid max_mmlu_drop=2.0"),
])
def test_errors_name_the_option_as_each_caller_spells_it(verb, options, flag_error, keyword_error):
    for spelling, expected in ((FLAGS, flag_error), (KEYWORDS, keyword_error)):
        with pytest.raises(DriftlabError) as err:
            verb(BackendSpec(), spelling, dict(options))
        assert expected in err.value.message and "\n" not in err.value.message


# -- the CLI's runs, resumed by the API ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    with dl.load(str(tiny_dir), dtype="float32", device="cpu") as backend:
        yield backend


def _cli(tiny_dir: Path, *args: str) -> None:
    result = CliRunner().invoke(app, [*args, "--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu"])
    assert result.exit_code == 0, result.output


def _records(out: Path) -> dict[str, list[str]]:
    """Every run directory under `out` (a sweep's points too): its records as sorted JSON lines."""
    from driftlab.records.rundir import RunDir

    return {str(m.parent.relative_to(out)): sorted(json.dumps(r, sort_keys=True) for r in RunDir(m.parent).records())
            for m in sorted(out.rglob("manifest.json"))}


def _resumed_by_the_api(out: Path, call) -> None:
    """The API, given the CLI's options as keywords, resumes the CLI's run: same configs, nothing new."""
    before = _records(out)
    manifests = {p: p.read_text() for p in out.rglob("manifest.json")}
    run = call(out)
    assert run.path == out and _records(out) == before and before
    for path, text in manifests.items():  # the same configs (a resume compares them, and refuses others)
        assert json.loads(path.read_text())["config"] == json.loads(text)["config"]


def test_a_cli_selfchat_is_resumed_by_dl_selfchat(tiny_dir, tiny, tmp_path):
    out = tmp_path / "run"
    _cli(tiny_dir, "run", "--out", str(out), "--pair", "reply-in-french:very-happy", "--rounds", "1",
         "--max-new-tokens", "3", "--probe-tokens", "4", "--temperature", "0.7", "--seed", "3", "--user-probe",
         "--steer", "split-softmax:k=0.5", "--batch-size", "4", "--no-report")
    _resumed_by_the_api(out, lambda o: dl.selfchat(tiny, out=o, pair="reply-in-french:very-happy", rounds=1,
                                                   max_new_tokens=3, probe_tokens=4, temperature=0.7, seed=3,
                                                   user_probe=True, steer="split-softmax:k=0.5", batch_size=4,
                                                   progress=False))
    assert (out / "results.json").exists()


def test_a_cli_mmlu_and_calibration_are_resumed_by_dl_mmlu_and_dl_calibrate(tiny_dir, tiny, tmp_path):
    mmlu = tmp_path / "mmlu"
    _cli(tiny_dir, "mmlu", "--out", str(mmlu), "--n", "4", "--turn", "0", "--steer", "instaboost:m=3",
         "--data", str(RAW), "--batch-size", "2")
    _resumed_by_the_api(mmlu, lambda o: dl.mmlu(tiny, out=o, n=4, turn=0, steer="instaboost:m=3", data=RAW,
                                                batch_size=2, progress=False))
    cal = tmp_path / "cal"
    _cli(tiny_dir, "calibrate", "--out", str(cal), "--method", "instaboost", "--max-mmlu-drop", "0.5", "--n", "4",
         "--turn", "0", "--steps", "1", "--data", str(RAW))
    _resumed_by_the_api(cal, lambda o: dl.calibrate(tiny, out=o, method="instaboost", max_mmlu_drop=0.5, n=4, turn=0,
                                                    steps=1, data=RAW, progress=False))
    found = dl.results(cal)
    assert found.protocol == "calibrate" and (cal / "results.json").exists()


def test_a_cli_sweep_is_resumed_by_dl_sweep(tiny_dir, tiny, tmp_path):
    out = tmp_path / "sweep"
    _cli(tiny_dir, "sweep", "--out", str(out), "--point", "split-softmax:k=0.5", "--pairs", "1", "--rounds", "1",
         "--max-new-tokens", "3", "--probe-tokens", "3", "--mmlu-n", "3", "--mmlu-turn", "2", "--batch-size", "2",
         "--data", str(RAW))
    _resumed_by_the_api(out, lambda o: dl.sweep(tiny, out=o, point="split-softmax:k=0.5", pairs=1, rounds=1,
                                                max_new_tokens=3, probe_tokens=3, mmlu_n=3, mmlu_turn=2,
                                                batch_size=2, data=RAW, progress=False))


def test_dl_run_runs_any_protocol_object_to_its_results(tiny, tmp_path):
    from driftlab.api import spec_of
    from driftlab.protocol.mmlu import MMLU

    config = mmlu_config(spec_of(tiny), KEYWORDS, {"n": 4, "turn": 0, "steer": "cfg:alpha=2", "data": RAW})
    run = dl.run(MMLU(config, tiny), out=tmp_path / "m", progress=False)
    assert run.protocol == "mmlu" and len(run.records) == 8
    assert run.summary.protocol == "mmlu" and (tmp_path / "m" / "results.json").exists()
    shutil.rmtree(tmp_path / "m")
    in_memory = dl.run(MMLU(config, tiny), progress=False)
    assert in_memory.path is None and in_memory.records == run.records
    with pytest.raises(DriftlabError, match="dl.run takes a protocol object, not str 'mmlu'"):
        dl.run("mmlu")


def test_personas_given_in_code_are_the_runs_agents():
    """`dl.selfchat(personas=[p])` runs over p (a user expects that), not p added to a random pool;
    `agents=` says otherwise."""
    from driftlab.protocol.selfchat import draw_pairs

    spec = BackendSpec(model="smollm2-135m")
    terse = dl.Persona(id="terse-x", system_prompt="Answer in one sentence.", probe="Tell me about London.",
                       measure="sentence_count", params={"n": 1})
    config = selfchat_config(spec, KEYWORDS, {"personas": [terse], "pairs": 6})
    assert config.agents == ["terse-x"]
    pairs = draw_pairs(config)
    assert len(pairs) == 6 and {p.agent.id for p in pairs} == {"terse-x"}
    assert all(p.user.id != "terse-x" for p in pairs)  # users from every other persona
    wider = selfchat_config(spec, KEYWORDS, {"personas": [terse], "agents": [terse, "reply-in-french"], "pairs": 6})
    assert wider.agents == ["terse-x", "reply-in-french"]
