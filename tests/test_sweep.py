"""The trade-off sweep: grid validation, the paper's pairs, a tiny end-to-end run that resumes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from driftlab.bench import get_persona
from driftlab.chat import BackendSpec, Sampling
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.sweep import Sweep, SweepConfig, paper_pairs, point_dir
from driftlab.report.sweep import matched_points, sweep_table, write_sweep_report

RAW = Path(__file__).parent / "fixtures" / "mmlu_raw_sample.jsonl"


def test_paper_pairs_are_the_20_ordered_pairs_of_one_persona_per_category():
    pairs = paper_pairs()
    assert len(pairs) == 20 == len(set(pairs))
    ids = {a for a, _ in pairs}
    assert len(ids) == 5 and {get_persona(i).category for i in ids} == {
        "multiple_choice", "persona", "pattern", "memorization", "language"}
    assert all(a != u for a, u in pairs)
    assert len({a for a, _ in pairs[:5]}) == 5  # the first few pairs already spread over the agents


# The reference code's index 0 of each category list (likenneth/persona_drift, hundred_system_prompts.py),
# its system prompts as written there; the pattern one is Table 2's wording in driftlab's data.
REFERENCE_PROMPTS = {
    "multiple_choice": "You are a pretentious academic. Your vocabulary is that of a pretentious academic.",
    "persona": "You love playing tennis. It's your favorite hobby.",
    "memorization": "If you are asked for a book recommendation, suggest the Harry Potter series.",
    "language": "Always reply in French. After every sentence, put in parenthes",
}


def test_reference_persona_set_is_index_0_of_each_category_of_the_reference_code():
    from driftlab.errors import DriftlabError
    from driftlab.protocol.sweep import sweep_personas

    five = sweep_personas("reference")
    personas = [get_persona(i) for i in five]
    assert [p.category for p in personas] == ["multiple_choice", "persona", "pattern", "memorization", "language"]
    for p in personas:
        if p.category in REFERENCE_PROMPTS:
            assert p.system_prompt.startswith(REFERENCE_PROMPTS[p.category]), p.id
    assert get_persona(five[2]).system_prompt == "Always start your words with the letter A."
    pairs = paper_pairs("reference")
    assert len(pairs) == 20 == len(set(pairs)) and {a for a, _ in pairs} == set(five)
    assert paper_pairs() == paper_pairs("table2") != pairs  # the default set is kept, by name
    assert sweep_personas("table2") != five
    cfg = SweepConfig(personas="reference")
    assert cfg.pair_ids == pairs and cfg.model_dump(mode="json")["personas"] == "reference"  # recorded
    assert SweepConfig(personas="reference", pair_ids=pairs[:3]).pair_ids == pairs[:3]  # explicit pairs win
    assert SweepConfig().personas == "table2" and SweepConfig().pair_ids == paper_pairs()
    assert SweepConfig(probe_after="agent").selfchat(None).probe_after == "agent"
    with pytest.raises(DriftlabError, match="Unknown sweep persona set"):
        sweep_personas("paper")


def test_grid_is_validated_and_normalised():
    cfg = SweepConfig(grid={"split-softmax": ["split-softmax:k=.5"]})
    assert cfg.model_dump(mode="json")["grid"] == {"split-softmax": ["split-softmax:k=0.5,heads=all"]}
    assert cfg.grid["split-softmax"][0].k == 0.5 and cfg.points()[0] == ("plain", None)
    with pytest.raises(ValueError, match="unknown method 'ss'"):
        SweepConfig(grid={"ss": ["split-softmax:k=0.5"]})
    with pytest.raises(ValueError, match="must list spr specs"):
        SweepConfig(grid={"spr": ["cfg:alpha=2"]})
    with pytest.raises(ValueError, match="lists spr:p=1.0,seed=0 more than once"):  # one point, two tests
        SweepConfig(grid={"spr": ["spr:p=1", "spr:p=1.0"]})


def test_a_sweep_with_kl_measures_every_point_but_those_whose_replies_are_not_the_models_own():
    """--kl reaches each point's self-chat, except CFG's and any point under when-drifting (a live KL
    would be refused there, so the sweep leaves it out instead of failing the point)."""
    measured = {p.spec() if p else "plain": SweepConfig(kl=True).selfchat(p).kl for _, p in SweepConfig().points()}
    assert measured.pop("plain") and measured and all(v == (not spec.startswith("cfg")) for spec, v in measured.items())
    gated = SweepConfig(kl=True, when_drifting=0.5, grid={"split-softmax": ["split-softmax:k=0.5"]})
    assert not any(gated.selfchat(p).kl for _, p in gated.points() if p is not None)
    assert not any(SweepConfig().selfchat(p).kl for _, p in SweepConfig().points())


def test_matched_points_pick_the_closest_drop_per_method():
    table = pd.DataFrame({
        "method": ["plain", "a", "a", "b", "b"], "spec": ["plain", "a1", "a2", "b1", "b2"],
        "mmlu_drop": [0.0, 0.01, 0.06, 0.04, 0.2], "stability": [0.1, 0.2, 0.3, 0.4, 0.5],
    })
    target, rows = matched_points(table, 0.05)
    assert target == 0.05 and sorted(rows.spec) == ["a2", "b1"]
    target, _ = matched_points(table)
    assert target == pytest.approx(0.05)  # the median drop of the grid points


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from driftlab.chat.hf import HFChatBackend
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")
    return HFChatBackend(str(path), dtype="float32", device="cpu")


@pytest.mark.model
def test_tiny_sweep_end_to_end_and_resume(tiny, tmp_path, holm_reference):
    cfg = SweepConfig(backend=BackendSpec(model=tiny.name),
                      grid={"split-softmax": ["split-softmax:k=0.5"], "spr": ["spr:p=1"]},
                      pair_ids=paper_pairs()[:2], rounds=2, sampling=Sampling(max_new_tokens=4), probe_tokens=4, mmlu_n=4,
                      mmlu_turn=2, history_tokens=4, data=str(RAW))
    run_protocol(Sweep(cfg, tiny), tmp_path / "sweep", progress=False)
    table = sweep_table(tmp_path / "sweep")
    assert list(table.spec) == ["plain", "split-softmax:k=0.5,heads=all", "spr:p=1.0,seed=0"]
    assert table.loc[0, "mmlu_drop"] == 0.0 and (table.n_conversations == 2).all()
    assert table.stability.between(0, 1).all()
    # the paired gain over plain: zero for plain, and (complete runs, same pairs) the difference of the means
    assert table.loc[0, "stability_gain"] == 0.0
    assert (table.stability_gain - (table.stability - table.loc[0, "stability"])).abs().max() < 1e-9
    # each point against plain on the same pairs and questions, Holm over the sweep's points
    steered = table.iloc[1:]
    assert (steered.gain_method.str.startswith("Wilcoxon signed-rank")).all()
    assert (steered.mmlu_method == "exact McNemar").all() and (table.mmlu_n == 4).all() and (table.gain_n == 2).all()
    assert table.loc[0, ["gain_p", "mmlu_p"]].isna().all()  # plain is the baseline, not a comparison
    for col in ("gain_p", "mmlu_p"):
        assert list(steered[f"{col}_holm"]) == pytest.approx(holm_reference(steered[col]))
    assert (steered.mmlu_drop == (steered.mmlu_lost - steered.mmlu_gained) / 4).all()
    assert (steered.gain_better + steered.gain_worse + steered.gain_tied == 2).all()
    assert steered.warning.str.contains("too few pairs|tied").all()  # 2 pairs and 4 questions support nothing
    from driftlab.report.sweep import power_notes
    from driftlab.stats import pairs_needed_proportions

    notes = power_notes(table)
    shares = ((steered.mmlu_lost + steered.mmlu_gained) / 4).median()
    want = pairs_needed_proportions(0.05, min(1.0, max(0.1, shares)))
    assert f"An MMLU drop of 0.05 needs about {want} questions" in notes[-1] and "this sweep has 4" in notes[-1]
    page = write_sweep_report(tmp_path / "sweep")
    text = page.read_text()
    assert "Where n does not support a difference" in text and "What this n can detect" in text
    assert page.stat().st_size > 10_000 and (tmp_path / "sweep" / "sweep_tradeoff.png").is_file()
    records = sorted((tmp_path / "sweep").rglob("records.jsonl"))
    assert len(records) == 3 * 2  # per point: self-chat + MMLU (whose history is the point's own dialog)
    before = [r.read_bytes() for r in records]
    run_protocol(Sweep(cfg, tiny), tmp_path / "sweep", progress=False)  # a finished point is never recomputed
    assert [r.read_bytes() for r in records] == before
    pd.testing.assert_frame_equal(sweep_table(tmp_path / "sweep"), table)
    assert point_dir(tmp_path / "sweep", "spr:p=1.0,seed=0").name == "spr_p1.0_seed0"


@pytest.mark.parametrize("argv, field, value", [
    (["run", "--probe-after", "agent"], "probe_after", "agent"),
    (["run"], "probe_after", "agent"),
    (["sweep", "--personas", "reference", "--pairs", "3", "--probe-after", "agent"], "personas", "reference"),
])
def test_cli_records_probe_after_and_the_persona_set_in_the_config(monkeypatch, tmp_path, argv, field, value):
    """The flags reach the protocol's config (what the manifest records); the run itself is cut off."""
    from typer.testing import CliRunner

    import driftlab.protocol.runner as runner
    from driftlab.cli import app

    seen = {}

    def capture(protocol, out, **kwargs):
        seen["config"] = protocol.config
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_protocol", capture)
    CliRunner().invoke(app, [*argv, "--out", str(tmp_path / "out"), "--device", "cpu"])
    config = seen["config"]
    assert getattr(config, field) == value
    if argv[0] == "sweep":
        assert config.pair_ids == paper_pairs("reference")[:3] and config.probe_after == "agent"
        assert config.selfchat(None).probe_after == "agent"


# -- no confounds by construction ----------------------------------------------------------------
def _tiny_config(tiny, **kw) -> SweepConfig:
    return SweepConfig(backend=BackendSpec(model=tiny.name), grid={"split-softmax": ["split-softmax:k=0.5"]},
                       pair_ids=paper_pairs()[:2], rounds=2, sampling=Sampling(max_new_tokens=4), probe_tokens=4, mmlu_n=4,
                       mmlu_turn=2, data=str(RAW), **kw)


@pytest.fixture(scope="module")
def swept(tiny, tmp_path_factory) -> Path:
    """A finished two-point sweep (plain, split-softmax) on the tiny model; tests copy it before changing it."""
    out = tmp_path_factory.mktemp("swept") / "sweep"
    run_protocol(Sweep(_tiny_config(tiny), tiny), out, progress=False)
    return out


def _manifest(path: Path) -> dict:
    import json

    return json.loads((path / "manifest.json").read_text())


def _records(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (path / "records.jsonl").read_text().splitlines()]


@pytest.mark.model
def test_every_point_runs_the_same_pairs_starters_seeds_and_questions(swept):
    """Read from the points' own records: each point's self-chat has the same pairs, personas,
    starters and per-generation seeds, and its MMLU run the same questions, with the history
    taken from that point's own dialog."""
    from driftlab.protocol.dialog import RECORDS, Dialog, pairs_from_manifest
    from driftlab.records.rundir import RunDir

    specs = _manifest(swept)["points"]
    assert specs == ["", "split-softmax:k=0.5,heads=all"]
    chats = [point_dir(swept, s) / "selfchat" for s in specs]
    mmlus = [point_dir(swept, s) / "mmlu" for s in specs]
    plans = [{k: _manifest(c)[k] for k in ("pairs", "personas", "inputs")} for c in chats]
    assert plans[0] == plans[1] and [p["starter"] for p in plans[0]["pairs"]]  # pairs, personas, starters
    seeds = [{(r["kind"], r["pair"], r["condition"], r["round"], r.get("speaker"), r.get("target")): r["seed"]
              for r in _records(c)} for c in chats]
    assert seeds[0] == seeds[1] and len(seeds[0]) == 2 * (3 + 2)  # 2 pairs x (3 turns + 2 probes), same seeds
    texts = [{k: r["text"] for r in _records(c) if r["kind"] == "turn"
              for k in [(r["pair"], r["round"], r["speaker"])]} for c in chats]
    assert texts[0] != texts[1]  # the intervention did change the dialogs (so the history test below means it)
    questions = [[q["index"] for q in _manifest(m)["questions"]] for m in mmlus]
    assert questions[0] == questions[1] and len(questions[0]) == 4
    assert [sorted(r["index"] for r in _records(m)) for m in mmlus] == [sorted(questions[0])] * 2
    for chat, mmlu in zip(chats, mmlus, strict=True):
        manifest = _manifest(mmlu)
        assert manifest["config"]["history"] == "dialog" and manifest["question_round"] == 2  # paper turn 2
        history = manifest["history"]
        assert {k: history[k] for k in ("from", "pair", "rounds", "agent", "user", "starter")} == {
            "from": "../selfchat", "pair": 0, "rounds": 1, "agent": plans[0]["pairs"][0]["agent"],
            "user": plans[0]["pairs"][0]["user"], "starter": plans[0]["pairs"][0]["starter"]}
        (dialog,) = Dialog.from_records(pairs_from_manifest(_manifest(chat))[:1], ["persona"],
                                         RunDir(chat).records(RECORDS))
        assert history["conversation"] == dialog.agent_view(2, "")[:-1]  # [s_B, a_1, b_1] of this point's dialog
        assert not list(mmlu.glob("history-*"))  # no separate self-chat any more
    from driftlab.protocol.sweep import check_points

    check_points(swept)  # nothing but the intervention differs


def _break_version(m: dict) -> None:
    m["versions"]["driftlab"] = "0.0.1"


def _break_sampling(m: dict) -> None:
    m["config"]["sampling"]["temperature"] = 0.123


def _old_mmlu(m: dict) -> None:
    """A point written before the MMLU turn counting and history source existed (round 2, separate history)."""
    if m["protocol"] == "mmlu":
        del m["config"]["turn_counting"], m["config"]["history"]


def _break_data(m: dict) -> None:
    m["inputs"] = {**m["inputs"], **{k: "0" * 64 for k in m["inputs"]}}


@pytest.mark.model
@pytest.mark.parametrize("child, change, why", [
    ("selfchat", _break_version, "versions.driftlab"),
    ("selfchat", _break_sampling, "config.sampling.temperature"),
    ("mmlu", _old_mmlu, "config.turn_counting: 'round' -> 'paper'"),
    ("mmlu", _break_data, "inputs.mmlu"),
])
def test_a_stale_point_is_refused_by_the_table_then_moved_aside_and_redone(swept, tiny, tmp_path, capsys, child,
                                                                         change, why):
    import json
    import shutil

    from driftlab.errors import DriftlabError

    out = tmp_path / "sweep"
    shutil.copytree(swept, out)
    point = point_dir(out, "split-softmax:k=0.5,heads=all")
    before = {c: (point / c / "records.jsonl").read_bytes() for c in ("selfchat", "mmlu")}
    manifest = _manifest(point / child)
    change(manifest)
    (point / child / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DriftlabError, match=f"point split-softmax:k=0.5,heads=all cannot be compared with plain: "
                                            f"its {child} run differs in more than the intervention") as err:
        sweep_table(out)
    assert why.split(":")[0] in str(err.value) and "re-runs stale points" in err.value.hint

    run_protocol(Sweep(_tiny_config(tiny), tiny), out, progress=False)  # the resume redoes the stale point
    said = capsys.readouterr().err
    assert "sweep: point split-softmax:k=0.5,heads=all was run with other settings" in said and why in said
    assert "moved to" in said and "running it again" in said
    stale = out / "stale" / f"{point.name}.1"
    assert _manifest(stale / child) == manifest  # kept, not deleted
    assert {c: (point / c / "records.jsonl").read_bytes() for c in ("selfchat", "mmlu")} == before  # redone alike
    assert not (out / "stale" / "plain.1").exists()  # the plain point was current: kept
    sweep_table(out)  # comparable again
    if why == "versions.driftlab":  # stale a second time: the earlier stale copy is kept beside the new one
        (point / child / "manifest.json").write_text(json.dumps(manifest))
        run_protocol(Sweep(_tiny_config(tiny), tiny), out, progress=False)
        assert _manifest(out / "stale" / f"{point.name}.2" / child) == manifest and stale.is_dir()


@pytest.mark.model
def test_more_points_join_a_finished_sweep_and_none_can_be_dropped(swept, tiny, tmp_path, capsys, holm_reference):
    """A resume with a larger grid runs only the new point (the finished ones are kept byte for byte)
    and the table tests all of them as one Holm family; a grid without a recorded point is refused."""
    import shutil

    from driftlab.errors import DriftlabError

    out = tmp_path / "sweep"
    shutil.copytree(swept, out)
    old = {p: p.read_bytes() for p in sorted(out.rglob("records.jsonl"))}
    grid = {"split-softmax": ["split-softmax:k=0.5"], "spr": ["spr:p=1"]}
    run_protocol(Sweep(_tiny_config(tiny).model_copy(update={"grid": SweepConfig(grid=grid).grid}), tiny), out)
    assert "sweep: adding 1 point(s)" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in old} == old
    manifest = _manifest(out)
    assert manifest["points"] == ["", "split-softmax:k=0.5,heads=all", "spr:p=1.0,seed=0"] and manifest["completed"]
    assert manifest["config"]["grid"]["spr"] == ["spr:p=1.0,seed=0"]
    table = sweep_table(out)
    assert list(table.spec) == ["plain", "split-softmax:k=0.5,heads=all", "spr:p=1.0,seed=0"]
    steered = table.iloc[1:]
    assert list(steered.mmlu_p_holm) == pytest.approx(holm_reference(steered.mmlu_p))
    with pytest.raises(DriftlabError, match="holds the point\\(s\\) spr:p=1.0,seed=0, which this sweep's grid lacks"):
        run_protocol(Sweep(_tiny_config(tiny), tiny), out, progress=False)
    assert _manifest(out)["points"] == manifest["points"]  # the refused resume changed nothing


def test_sweep_config_records_the_turn_counting_and_refuses_a_dialog_too_short():
    cfg = SweepConfig()
    assert (cfg.mmlu_turn, cfg.mmlu_turn_counting, cfg.mmlu_history) == (4, "paper", "dialog")
    mmlu = cfg.mmlu(None)
    assert (mmlu.round, mmlu.history, mmlu.turn_counting) == (3, "dialog", "paper")  # the paper's 4th turn
    assert SweepConfig(mmlu_turn_counting="round").mmlu(None).round == 4
    assert SweepConfig(mmlu_history="selfchat").mmlu(None).history == "selfchat"
    with pytest.raises(ValueError, match="follows 2 rounds of the point's dialog, which has 1"):
        SweepConfig(rounds=1)
    assert SweepConfig(rounds=1, mmlu_turn=2).mmlu(None).round == 2
    assert SweepConfig.LEGACY == {"mmlu_turn_counting": "round", "mmlu_history": "selfchat", "mmlu_ties": "first",
                                  "mmlu_histories": 1, "probe_after": "user", "probe_tokens": "turn",
                                  "benchmark": "mmlu", "benchmark_include": None, "benchmark_n": None,
                                  "when_drifting": None, "when_drifting_by": "pi", "kl": False}
    with pytest.raises(ValueError, match="MMLU over 3 dialogs needs as many persona pairs; the sweep has 2"):
        SweepConfig(pair_ids=paper_pairs()[:2], mmlu_histories=3)
    assert SweepConfig(mmlu_histories=5, mmlu_ties="first").mmlu(None).model_dump(include={"histories", "ties"}) == {
        "histories": 5, "ties": "first"}


def test_when_drifting_gates_every_steered_point_and_refuses_batch_wide_ones(tmp_path):
    """`--when-drifting R`: each steered point's self-chat and MMLU run under `when-drifting:r=R`;
    plain stays plain; CFG and SPR, which act on a whole batch, are refused before any work."""
    cfg = SweepConfig(grid={"instaboost": ["instaboost:m=10"]}, when_drifting=0.5)
    (_, plain), (_, point) = cfg.points()
    assert cfg.selfchat(plain).steer.specs() == [] and cfg.mmlu(plain).steer.specs() == []
    assert cfg.selfchat(point).steer.specs() == cfg.mmlu(point).steer.specs() == ["instaboost:m=10.0",
                                                                                 "when-drifting:r=0.5"]
    assert SweepConfig(grid={"instaboost": ["instaboost:m=10"]}).selfchat(point).steer.specs() == ["instaboost:m=10.0"]
    for method, spec in (("cfg", "cfg:alpha=2"), ("spr", "spr:p=0.5")):
        with pytest.raises(ValueError, match=f"and {method} acts on the whole batch"):
            SweepConfig(grid={method: [spec]}, when_drifting=0.5)
    # by projection: the gate says so, and a sweep without directions stops before any work
    with pytest.raises(ValueError, match="--when-drifting-by projection reads persona directions"):
        SweepConfig(grid={"instaboost": ["instaboost:m=10"]}, when_drifting=0.5, when_drifting_by="projection")
    from test_activation import synthetic

    backend = BackendSpec(directions=str(synthetic(2, 8, ["Be brief."]).save(tmp_path / "dirs")))
    by = SweepConfig(backend=backend, grid={"instaboost": ["instaboost:m=10"]}, when_drifting=0.5,
                     when_drifting_by="projection")
    assert by.selfchat(by.points()[1][1]).steer.specs() == ["instaboost:m=10.0", "when-drifting:r=0.5,by=projection"]


@pytest.mark.model
def test_a_finished_sweep_is_repriced_over_several_dialogs_without_new_dialogs(swept, tiny, tmp_path):
    """The re-pricing recipe of docs/steering.md: a new sweep directory holding the finished points'
    self-chats, run with --histories 2, scores MMLU only, after each point's own two dialogs."""
    import shutil

    from driftlab.protocol.mmlu import dialogs_of
    from driftlab.report.sweep import sweep_table

    out = tmp_path / "h2"
    for spec in _manifest(swept)["points"]:
        shutil.copytree(point_dir(swept, spec) / "selfchat", point_dir(out, spec) / "selfchat")
    chats = {spec: (point_dir(out, spec) / "selfchat" / "records.jsonl").read_bytes()
             for spec in _manifest(swept)["points"]}
    run_protocol(Sweep(_tiny_config(tiny, mmlu_histories=2), tiny), out, progress=False)
    for spec, before in chats.items():
        assert (point_dir(out, spec) / "selfchat" / "records.jsonl").read_bytes() == before  # no new generation
        mmlu = point_dir(out, spec) / "mmlu"
        planned = [q["index"] for q in _manifest(mmlu)["questions"]]
        assert dialogs_of(mmlu) == {q: i % 2 for i, q in enumerate(planned)}
        assert [e["pair"] for e in _manifest(mmlu)["history"]] == [0, 1]
    assert not (out / "stale").exists()
    table = sweep_table(out)
    row = table[table.method != "plain"].iloc[0]
    assert row.mmlu_dialogs == 2 and row.mmlu_method.startswith("cluster sign-flip")


@pytest.mark.model
def test_finished_points_copied_into_a_new_sweep_directory_are_kept(swept, tiny, tmp_path):
    """A new sweep directory holding finished points (self-chat and MMLU) copied from another run of
    the same plan runs nothing again: the first run compares the copies to its plan as recorded on
    disk, as a resume does (it once compared them to the plan in memory and moved them to stale/)."""
    import shutil

    out = tmp_path / "copied"
    for spec in _manifest(swept)["points"]:
        shutil.copytree(point_dir(swept, spec), point_dir(out, spec))
    before = {p: p.read_bytes() for p in out.rglob("records.jsonl")}
    run_protocol(Sweep(_tiny_config(tiny), tiny), out, progress=False)
    assert not (out / "stale").exists()
    assert {p: p.read_bytes() for p in out.rglob("records.jsonl") if p.parent.parent != out} == before
