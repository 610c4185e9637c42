"""`driftlab pasta tune`: head sets per top-k, the validation run, the choice, resume, the CLI."""

from __future__ import annotations

import json

import pytest

from devices import backend_device
from driftlab.chat import BackendSpec
from driftlab.errors import DriftlabError
from driftlab.pasta.tune import TuneConfig, head_sets
from driftlab.protocol.runner import run_protocol
from driftlab.records.rundir import RunDir
from driftlab.steering.heads import Profile, load_heads


def _profile(path, ranking, model="smollm2-135m", task="json"):
    scores = [(layer, head, -float(i)) for i, (layer, head) in enumerate(ranking)]
    path.write_text(Profile(model=model, task=task, metric="score", alpha=0.01, n=2, scores=scores).model_dump_json())
    return str(path)


def test_head_sets_one_point_per_new_nonempty_set(tmp_path) -> None:
    a = _profile(tmp_path / "a.json", [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)])
    b = _profile(tmp_path / "b.json", [(4, 4), (3, 3), (0, 0), (1, 1), (2, 2)])
    cfg = TuneConfig(task="json", profiles=[a, b], topk=[4, 1, 2, 3, 5])
    assert cfg.topk == [1, 2, 3, 4, 5]
    # top-1 sets {0.0} and {4.4} share nothing; top-2 share nothing; top-3 share (0, 0); top-4
    # adds (1, 1) and (3, 3); top-5 all five.
    points = head_sets(cfg)
    assert [p["topk"] for p in points] == [3, 4, 5]
    assert points[0]["heads"] == [[0, 0]] and points[1]["heads"] == [[0, 0], [1, 1], [3, 3]] and len(points[2]["heads"]) == 5
    # k=6 selects the same 5 heads as k=5: not run twice
    assert [p["topk"] for p in head_sets(TuneConfig(task="json", profiles=[a, b], topk=[5, 6]))] == [5]
    union = head_sets(TuneConfig(task="json", profiles=[a, b], topk=[1], select="union"))
    assert union == [{"topk": 1, "heads": [[0, 0], [4, 4]]}]
    with pytest.raises(DriftlabError, match="selects any head"):
        head_sets(TuneConfig(task="json", profiles=[a, b], topk=[1, 2]))


def test_tune_config_and_profile_errors(tmp_path) -> None:
    from pydantic import ValidationError

    a = _profile(tmp_path / "a.json", [(0, 0)])
    with pytest.raises(ValidationError, match="at least 1"):
        TuneConfig(task="json", profiles=[a], topk=[0, 4])
    with pytest.raises(DriftlabError, match="takes one profile"):
        TuneConfig(task="json", profiles=[a, a], select="task-specific")
    with pytest.raises(DriftlabError, match="no 'shortened' prompt"):
        TuneConfig(task="biasbios", profiles=[a], prompt="shortened")
    with pytest.raises(DriftlabError, match="come from qwen"):
        head_sets(TuneConfig(task="json", profiles=[_profile(tmp_path / "q.json", [(0, 0)], "qwen2.5-coder-1.5b")]))
    with pytest.raises(DriftlabError, match="does not exist"):
        head_sets(TuneConfig(task="json", profiles=[str(tmp_path / "missing.json")]))


@pytest.mark.model
def test_tune_scores_each_head_count_on_valid_and_resumes(tmp_path, smol32) -> None:
    from driftlab.pasta.tune import HeadTuner, summarize
    from driftlab.report.pasta import write_pasta_figures

    ranking = [(layer, head) for layer in range(30) for head in range(9)]
    prof = _profile(tmp_path / "p.json", ranking, model=str(smol32.name))
    cfg = TuneConfig(backend=BackendSpec(model=str(smol32.name), dtype="float32", device=backend_device()), task="counterfact",
                     profiles=[prof], select="task-specific", topk=[9, 270], n=2)  # (two: still a mean per point)
    run_protocol(HeadTuner(cfg, smol32), tmp_path / "tune", progress=False)
    result = summarize(tmp_path / "tune")
    rd = RunDir(tmp_path / "tune")
    recs = rd.records()
    ids = {r["id"] for r in recs}
    assert len(recs) == 3 * 2 and all(i.startswith("6") or i.startswith("7") for i in ids)  # valid facts: 60-79
    assert [p["n_heads"] for p in result["points"]] == [9, 270]
    es = [p["metrics"]["es"][0] for p in result["points"]]
    best = max(range(2), key=lambda i: (es[i], -result["points"][i]["n_heads"]))
    assert result["best"]["topk"] == result["points"][best]["topk"]
    assert sorted(load_heads(rd.path / "heads.json")) == sorted(map(tuple, result["best"]["heads"]))
    assert write_pasta_figures(rd.path).stat().st_size > 5000 and (rd.path / "tune.png").is_file()
    assert json.loads((rd.path / "tune.json").read_text())["best"]["topk"] == result["best"]["topk"]
    # the summary is the records' mean, point by point (0: the unsteered reference)
    for k, stats in [(0, result["unsteered"]), *((p["topk"], p["metrics"]) for p in result["points"])]:
        values = [r["metrics"]["es"] for r in recs if r["topk"] == k]
        assert len(values) == 2 and stats["es"][0] == pytest.approx(sum(values) / 2)
    # resume: drop the last point's records, run again: the rest is kept, the point comes back
    lines = rd.records_path.read_text().splitlines()
    rd.records_path.write_text("\n".join(lines[:-2]) + "\n")
    run_protocol(HeadTuner(cfg, smol32), tmp_path / "tune", progress=False)
    again = summarize(tmp_path / "tune")
    after = rd.records_path.read_text().splitlines()
    assert after[:-2] == lines[:-2] and len(after) == 6
    assert again["points"] == result["points"]


@pytest.mark.model
def test_tune_cli_prints_the_table_and_writes_heads(tmp_path) -> None:
    """The command in this process (`python -m driftlab` itself is tests/test_cli_errors.py's): no
    interpreter's seconds of imports for what is the command's table and heads.json. On a tiny random
    Qwen2 (3 layers of 4 heads): the tuning itself runs on SmolLM2 above."""
    from typer.testing import CliRunner

    from driftlab.cli import app
    from tiny_models import make_tiny_model

    model = str(make_tiny_model("qwen2", tmp_path / "tiny"))
    prof = _profile(tmp_path / "p.json", [(layer, head) for layer in range(3) for head in range(4)], model=model)
    out = tmp_path / "tune"
    args = ["pasta", "tune", prof, "--task", "json", "--select", "task-specific", "--topk", "3", "--n", "1",
            "--max-new-tokens", "4", "--model", model, "--dtype", "float32", "--device", backend_device(),
            "--out", str(out)]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, (done.output[-3000:], done.exception)
    assert "no steering" in done.stdout and "chosen" in done.stdout
    assert load_heads(out / "heads.json") == ((0, 0), (0, 1), (0, 2))


def test_choice_skips_degenerate_points_and_prefers_fewer_heads(tmp_path) -> None:
    """The paper's fluency floor: a point whose replies babble (mean fluency < 3) is not chosen,
    however high its pronoun accuracy (no pronoun left counts as changed)."""
    from driftlab.pasta.tune import PointRecord, summarize
    from driftlab.report.pasta import plot_tune

    a = _profile(tmp_path / "a.json", [(0, h) for h in range(8)], task="pronouns")
    cfg = TuneConfig(task="pronouns", profiles=[a], select="task-specific", topk=[1, 2, 4, 8], n=2)
    rd = RunDir(tmp_path / "t")
    #              k: (acc per example, fluency per example)
    data = {0: ([0, 0], [5, 5]), 1: ([1, 0], [5, 5]), 2: ([1, 0], [4, 4]), 4: ([1, 1], [4, 2.5]), 8: ([1, 1], [2, 2])}
    with rd.writing():
        rd.start(cfg.model_dump(mode="json"), {"examples": [{}, {}], "points": head_sets(cfg)}, protocol="pasta-tune")
        rd.append([PointRecord(topk=k, id=i, metrics={"score": a, "acc": a, "fluency": f})
                   for k, (accs, flus) in data.items() for i, a, f in zip("xy", accs, flus, strict=True)])
    result = summarize(rd.path)
    assert [p["fluent"] for p in result["points"]] == [True, True, True, False]  # k=4: mean 3.25 passes
    assert result["best"]["topk"] == 4 and result["best"]["n_heads"] == 4
    # without k=4, k=1 and k=2 tie at 0.5: the fewer heads win
    rd.records_path.write_text("".join(line + "\n" for line in rd.records_path.read_text().splitlines()
                                       if json.loads(line)["topk"] != 4))
    result = summarize(rd.path)
    assert result["best"]["topk"] == 1
    assert plot_tune(result, tmp_path / "t.png").stat().st_size > 5000
    rd.records_path.write_text("".join(line + "\n" for line in rd.records_path.read_text().splitlines()
                                       if json.loads(line)["topk"] in (0, 8)))
    assert summarize(rd.path)["best"] is None
