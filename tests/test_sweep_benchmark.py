"""`driftlab sweep --benchmark lm-eval:<task>`: each point priced by an lm-evaluation-harness task.

A two-point sweep (plain, instaboost) of the tiny random model on the fixture task driftlab_mc
(tests/fixtures/lm_eval), 4 items: the report's accuracy and paired drop test are recomputed
from the point's records, the records from lm-eval itself; a point whose records are lost is
redone alone; the early errors (unknown task, a task without a 0/1 metric, lm-eval missing, a
served model, a conversation-editing steer) come before anything is written. Nothing downloads
(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("lm_eval")

from driftlab.chat import BackendSpec, Sampling  # noqa: E402
from driftlab.errors import DriftlabError  # noqa: E402
from driftlab.protocol.runner import run_protocol  # noqa: E402
from driftlab.protocol.sweep import Sweep, SweepConfig, paper_pairs, point_dir  # noqa: E402
from driftlab.records.rundir import RunDir  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
BENCH = "lm-eval:driftlab_mc"
STEER = "instaboost:m=5.0"


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        import datasets.config

        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from driftlab.chat.hf import HFChatBackend
    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")
    return HFChatBackend(str(path), dtype="float32", device="cpu")


def _config(tiny, **kw) -> SweepConfig:
    # seed 3 draws items 1, 3, 4, 6 of the 8, on which instaboost changes the tiny model's answers
    return SweepConfig(backend=BackendSpec(model=tiny.name), grid={"instaboost": [STEER]}, pair_ids=paper_pairs()[:2],
                       rounds=2, sampling=Sampling(max_new_tokens=4), probe_tokens=4, seed=3,
                       benchmark=BENCH, benchmark_include=str(FIXTURES), benchmark_n=4, **kw)


@pytest.fixture(scope="module")
def swept(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "sweep"
    run_protocol(Sweep(_config(tiny), tiny), out, progress=False)
    return out


def _manifest(path: Path) -> dict:
    return RunDir(path).read_manifest()


def _records(path: Path) -> list[dict]:
    return RunDir(path).records()


@pytest.mark.model
def test_the_report_is_what_the_records_say(swept, tiny, monkeypatch):
    from scipy.stats import binomtest

    import driftlab.report.sweep as report

    specs = _manifest(swept)["points"]
    assert specs == ["", STEER]
    assert _manifest(swept)["config"]["benchmark"] == BENCH
    runs = [point_dir(swept, s) / "benchmark" for s in specs]
    assert all((point_dir(swept, s) / "selfchat" / "records.jsonl").is_file() for s in specs)
    assert not any((point_dir(swept, s) / "mmlu").exists() for s in specs)  # priced by the task, not MMLU
    plan = _manifest(runs[0])
    assert plan["items"] == [1, 3, 4, 6] and plan["benchmark"]["metric"] == "acc"
    assert plan["systems"][0]["pair"] == 0 and len(plan["systems"]) == 1  # the first pair's agent persona
    assert _manifest(runs[1])["items"] == plan["items"] and _manifest(runs[1])["systems"] == plan["systems"]
    rows = [{r["doc_id"]: r for r in _records(run)} for run in runs]
    for by_doc, condition in zip(rows, ("plain", "steered"), strict=True):
        assert sorted(by_doc) == plan["items"]
        for r in by_doc.values():
            assert (r["condition"], r["task"], r["metric"], r["dialog"]) == (condition, "driftlab_mc", "acc", 0)
            assert r["value"] in (0.0, 1.0) and len(r["resps"]) == 4  # one (log-likelihood, greedy) per option
            scores = [lp for lp, _ in r["filtered"]]
            assert r["value"] == float(scores.index(max(scores)) == r["target"]) and r["predicted"] == scores.index(max(scores))

    table = report.sweep_table(swept)
    assert list(table.spec) == ["plain", STEER]
    assert not [c for c in table.columns if c.startswith("mmlu_")]  # an lm-eval sweep's columns are bench_*
    assert (table.benchmark == BENCH).all() and (table.bench_metric == "acc").all()
    plain, steered = ({d: r["value"] for d, r in by_doc.items()} for by_doc in rows)
    assert list(table.bench_accuracy) == [sum(plain.values()) / 4, sum(steered.values()) / 4]
    lost = sum(plain[d] == 1 and steered[d] == 0 for d in plan["items"])
    gained = sum(plain[d] == 0 and steered[d] == 1 for d in plan["items"])
    assert lost + gained > 0  # the steer changed some answers, so the counts below can be wrong
    row = table.iloc[1]
    assert (row.bench_lost, row.bench_gained, row.bench_n, row.bench_dialogs) == (lost, gained, 4, 1)
    assert row.bench_drop == pytest.approx((lost - gained) / 4)
    assert row.bench_method == "exact McNemar" and row.bench_ci_method == "newcombe"
    assert row.bench_p == pytest.approx(binomtest(lost, lost + gained, 0.5).pvalue)
    assert row.bench_p_holm == pytest.approx(row.bench_p)  # Holm over one steered point
    assert table.iloc[0].bench_drop == 0 and pd.isna(table.iloc[0].bench_p)

    # The records are lm-eval's own verdicts: the plain point's items evaluated directly.
    import lm_eval

    from driftlab.integrations.lm_eval import DriftlabLM
    from driftlab.protocol.lmeval import load_task, task_manager

    direct = lm_eval.simple_evaluate(
        model=DriftlabLM(model=tiny), tasks=[load_task("driftlab_mc", str(FIXTURES))],
        task_manager=task_manager("driftlab_mc", str(FIXTURES)), samples={"driftlab_mc": plan["items"]},
        apply_chat_template=True, system_instruction=plan["systems"][0]["system"], bootstrap_iters=0)
    assert {s["doc_id"]: float(s["acc"]) for s in direct["samples"]["driftlab_mc"]} == plain

    labels = {}
    monkeypatch.setattr(report, "save_png", lambda fig, path: labels.setdefault(path.name, fig.axes[0].get_xlabel()))
    report.tradeoff_figure(table, swept / "x_tradeoff.png")
    assert labels["x_tradeoff.png"].startswith("driftlab_mc acc drop")
    notes = report.power_notes(table)
    assert "A driftlab_mc acc drop of 0.05 needs about" in notes[-1] and "this sweep has 4" in notes[-1]
    monkeypatch.undo()
    page = report.write_sweep_report(swept).read_text()
    assert "matched driftlab_mc acc drop" in page and "MMLU" not in page
    from driftlab.report.results import summarize

    names = set(summarize(swept).to_pandas()["metric"])
    assert "bench_drop" in names and "mmlu_drop" not in names


@pytest.mark.model
def test_a_point_whose_records_are_lost_is_redone_alone(swept, tiny, tmp_path, monkeypatch):
    from driftlab.protocol import lmeval
    from driftlab.report.sweep import sweep_table

    out = tmp_path / "sweep"
    shutil.copytree(swept, out)
    table = sweep_table(out)
    lost = point_dir(out, STEER) / "benchmark" / "records.jsonl"
    before = _records(lost.parent)
    kept = {p: p.read_bytes() for p in out.rglob("records.jsonl") if p != lost}
    lost.unlink()
    asked = []
    run_unit = lmeval.LMEvalBench.run_unit
    monkeypatch.setattr(lmeval.LMEvalBench, "run_unit",
                        lambda self, unit: asked.append((self.config.condition, unit[1])) or run_unit(self, unit))
    run_protocol(Sweep(_config(tiny), tiny), out, progress=False)
    assert asked == [("steered", [1, 3, 4, 6])]  # only the lost point's items, nothing else
    assert {p: p.read_bytes() for p in kept} == kept
    assert [{k: r[k] for k in ("doc_id", "value", "predicted")} for r in _records(lost.parent)] == [
        {k: r[k] for k in ("doc_id", "value", "predicted")} for r in before]
    pd.testing.assert_frame_equal(sweep_table(out), table)
    with pytest.raises(DriftlabError, match="benchmark_n: 4 -> 5"):  # a resume continues the recorded benchmark
        run_protocol(Sweep(_config(tiny).model_copy(update={"benchmark_n": 5}), tiny), out, progress=False)

    # A point whose benchmark ran on other data cannot be compared: refused, then moved aside and redone.
    manifest = _manifest(lost.parent)
    manifest["inputs"] = {"lm-eval": "0" * 64}
    (lost.parent / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DriftlabError, match="its benchmark run differs in more than the intervention"):
        sweep_table(out)
    asked.clear()
    run_protocol(Sweep(_config(tiny), tiny), out, progress=False)
    assert asked == [("steered", [1, 3, 4, 6])]
    assert _manifest(out / "stale" / f"{lost.parent.parent.name}.1" / "benchmark") == manifest
    pd.testing.assert_frame_equal(sweep_table(out), table)


def test_the_items_spread_over_distinct_agent_personas():
    from driftlab.protocol.lmeval import draw_items, personas_plan
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig

    pairs = paper_pairs()
    plan = SelfChat(SelfChatConfig(pairs=0, pair_ids=[pairs[0], pairs[5], pairs[1]], rounds=1)).plan()
    assert pairs[0][0] == pairs[5][0] != pairs[1][0]
    chosen = personas_plan(plan, 3)
    assert [(p["pair"], p["agent"]) for p in chosen] == [(0, pairs[0][0]), (2, pairs[1][0])]  # one per persona
    assert [p["pair"] for p in personas_plan(plan, 1)] == [0]
    assert draw_items(8, 4, 3) == [1, 3, 4, 6] and draw_items(8, 20, 3) == list(range(8))


def _refused(config: SweepConfig, out: Path) -> str:
    """The one-line error a sweep of `config` stops with, having written nothing."""
    with pytest.raises(DriftlabError) as err:
        run_protocol(Sweep(config), out, progress=False)
    assert not out.exists()
    return f"{err.value.message} | {err.value.hint}"


def _bench_config() -> SweepConfig:
    return SweepConfig(grid={"instaboost": [STEER]}, pair_ids=paper_pairs()[:1], rounds=2,
                       benchmark=BENCH, benchmark_include=str(FIXTURES), benchmark_n=4)


def test_errors_come_first_in_one_line(tmp_path, monkeypatch):
    """Before a model loads or anything is written: no 0/1 metric, no lm-eval, a served model."""
    import importlib.util

    cfg = _bench_config()
    brier = tmp_path / "brier"
    brier.mkdir()
    for name in ("data.py", "mc.jsonl"):
        shutil.copy(FIXTURES / name, brier / name)
    (brier / "brier.yaml").write_text((FIXTURES / "driftlab_mc.yaml").read_text()
                                      .replace("task: driftlab_mc", "task: driftlab_brier")
                                      .replace("metric: acc", "metric: brier_score"))
    said = _refused(cfg.model_copy(update={"benchmark": "lm-eval:driftlab_brier", "benchmark_include": str(brier)}),
                    tmp_path / "out")
    assert "reports brier_score, none of them right or wrong per item" in said
    served = cfg.model_copy(update={"backend": BackendSpec(model="openai:some-served-model")})
    assert "driftlab serve" in _refused(served, tmp_path / "out") and "local-completions" in _refused(served, tmp_path / "out")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    assert "pip install lm-eval" in _refused(cfg, tmp_path / "out")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="spr edits the conversation"):
        SweepConfig(grid={"spr": ["spr:p=1"]}, benchmark=BENCH)
    with pytest.raises(ValueError, match="use 'mmlu' or 'lm-eval:<task>'"):
        SweepConfig(benchmark="lmeval:x")
    with pytest.raises(ValueError, match="apply to --benchmark lm-eval"):
        SweepConfig(benchmark_n=10)


@pytest.mark.slow  # lm-eval indexes its 13k task files to know what exists: about 8 s
def test_an_unknown_task_or_a_group_is_refused_with_what_exists(tmp_path):
    """A task lm-eval does not have gets the nearest name; a group of tasks is not one task."""
    cfg = _bench_config()
    said = _refused(cfg.model_copy(update={"benchmark": "lm-eval:driftlab_mcq"}), tmp_path / "out")
    assert "lm-eval has no task 'driftlab_mcq' (nor in" in said and "did you mean 'driftlab_mc'" in said
    assert "is a group of tasks" in _refused(cfg.model_copy(update={"benchmark": "lm-eval:mmlu"}), tmp_path / "out")


def test_cli_flags_reach_the_config_and_leave_spr_out(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import driftlab.protocol.runner as runner
    from driftlab.cli import app

    seen = {}

    def capture(protocol, out, **kwargs):
        seen["config"] = protocol.config
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_protocol", capture)
    CliRunner().invoke(app, ["sweep", "--benchmark", BENCH, "--benchmark-include", str(FIXTURES), "--benchmark-n", "7",
                             "--out", str(tmp_path / "out"), "--device", "cpu"])
    config = seen["config"]
    assert (config.benchmark, config.benchmark_include, config.benchmark_n) == (BENCH, str(FIXTURES), 7)
    assert list(config.grid) == ["split-softmax", "cfg", "instaboost"]  # spr cannot be priced by raw-text lm-eval
    assert config.bench(None).model_dump(include={"task", "include", "n"}) == {
        "task": "driftlab_mc", "include": str(FIXTURES), "n": 7}
    result = CliRunner().invoke(app, ["sweep", "--benchmark", BENCH, "--point", "spr:p=1", "--out", str(tmp_path / "o")])
    assert isinstance(result.exception, DriftlabError) and "spr edits the conversation" in str(result.exception)
    CliRunner().invoke(app, ["sweep", "--out", str(tmp_path / "out2"), "--device", "cpu"])
    assert seen["config"].benchmark == "mmlu" and "spr" in seen["config"].grid  # the default: as before


def test_mmlu_sweeps_and_sweeps_recorded_before_the_option(tmp_path):
    from driftlab.report.sweep import BENCH_NAMES, COLUMNS

    now = SweepConfig(grid={"instaboost": [STEER]}).model_dump(mode="json")
    assert (now["benchmark"], now["benchmark_include"], now["benchmark_n"]) == ("mmlu", None, None)
    old = {k: v for k, v in now.items() if not k.startswith("benchmark")}
    rd = RunDir(tmp_path / "s")
    with rd.writing():
        rd.start(old, {}, SweepConfig.RESUME_IGNORES, protocol="sweep")
        rd.start(now, {}, SweepConfig.RESUME_IGNORES, protocol="sweep", legacy=SweepConfig.LEGACY)  # resumes as MMLU
        lm = SweepConfig(grid={"instaboost": [STEER]}, benchmark=BENCH).model_dump(mode="json")
        with pytest.raises(DriftlabError, match="benchmark: 'mmlu' \\(recorded before the option existed\\) -> "
                                                "'lm-eval:driftlab_mc'"):
            rd.start(lm, {}, SweepConfig.RESUME_IGNORES, protocol="sweep", legacy=SweepConfig.LEGACY)
    assert [c for c in COLUMNS if c.startswith("mmlu_")] == list(BENCH_NAMES)  # MMLU sweeps keep their columns
    assert BENCH_NAMES["mmlu_drop"] == "bench_drop" and BENCH_NAMES["mmlu_top_letter"] == "bench_top_choice"


@pytest.mark.process
def test_importing_the_sweep_does_not_import_lm_eval():
    code = ("import sys, driftlab.protocol.sweep, driftlab.report.sweep, driftlab.protocol.registry as r; "
            "r.all_protocols(); assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
