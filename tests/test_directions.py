"""Persona directions (`driftlab directions`), projections of a recorded run (`driftlab project`) and
`driftlab demo`: separation on a real model against a shuffled control, kill and resume with the
same tensors as an uninterrupted run, teacher-forced projections equal to the recorded ones."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import driftlab as dl
from driftlab.activation.directions import Directions
from driftlab.api import spec_of
from driftlab.protocol.directions import HELD_OUT_EVERY
from driftlab.records.rundir import RunDir

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def commands(protocol_commands):
    """`driftlab` commands, each its own process, forked from the session's server (tests/conftest.py)."""
    return protocol_commands


@pytest.mark.slow
def test_directions_resume_after_a_kill_with_the_tensors_of_an_uninterrupted_run(commands, tmp_path) -> None:
    from tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "llama")
    args = ["directions", "--model", str(model), "--dtype", "float32", "--personas", "reply-in-french",
            "--system", "Answer like a pirate.", "--axis", "--starters", "3", "--max-new-tokens", "6"]
    ref = commands.run([*args, "--out", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = commands.run([*args, "--out", str(tmp_path / "resumed")], kill_after=1)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "completed" not in RunDir(tmp_path / "resumed").read_manifest()
    kept = (tmp_path / "resumed" / "records.jsonl").read_bytes()
    done = commands.run([*args, "--out", str(tmp_path / "resumed")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "resumed" / "records.jsonl").read_bytes().startswith(kept)
    a, b = Directions.load(tmp_path / "ref"), Directions.load(tmp_path / "resumed")
    assert sorted(a.personas) == sorted(b.personas) == ["axis", "reply-in-french", "system-" + _hex("Answer like a pirate.")]
    for pid, p in a.personas.items():
        for name in ("unit", "norm", "with_proj", "without_proj", "auroc"):  # (an interval of one prompt is NaN)
            torch.testing.assert_close(getattr(p, name), getattr(b.personas[pid], name), rtol=0, atol=0,
                                       equal_nan=True, msg=f"{pid} {name}")
    assert a.axis.system_prompt is None and a.for_system("anything at all") is a.axis
    assert a.for_system("Answer like a pirate.").id.startswith("system-")  # a row's own direction first
    manifest = json.loads((tmp_path / "ref" / "directions.json").read_text())
    assert manifest["n_layers"] == 3 and manifest["personas"][0]["n_held_out"] == 1  # 4 prompts: every third held out


def _hex(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:8]


def test_a_prompt_smollm2_follows_separates_held_out_replies_and_a_shuffled_control_does_not(smol32, tmp_path) -> None:
    """reply-in-french: on the held-out prompts, the band's projections of replies with the prompt lie
    above those without (exact Mann-Whitney p < 0.05, recomputed here from the stored activations),
    and a direction taken after shuffling the training labels separates them about as chance does."""
    from safetensors.torch import load_file
    from scipy.stats import mannwhitneyu

    # 8 tokens separate as 16 did (held-out p = 1/70, the exact test's least; control AUROC 0.60 against 0.59), at 70% of the CPU
    run = dl.directions(smol32, personas=["reply-in-french"], starters=11, max_new_tokens=8, out=tmp_path,
                        progress=False)
    p = run.summary.personas["reply-in-french"]
    replies = {(r["prompt"], r["condition"]): r["text"] for r in run.records}
    assert len(replies) == 24 and p.info["n_held_out"] == 4
    acts = load_file(str(tmp_path / "acts" / "0.safetensors"))
    held = [i for i in range(12) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    band = list(p.band)

    def on_band(x: torch.Tensor) -> np.ndarray:
        return torch.einsum("nld,ld->nl", x[held].float(), p.unit)[:, band].mean(1).numpy()

    with_prompt, without = on_band(acts["with"]), on_band(acts["without"])
    assert mannwhitneyu(with_prompt, without, alternative="greater", method="exact").pvalue < 0.05
    assert float(p.auroc[0, band].mean()) >= 0.9 and float(p.auroc[1, band].mean()) > 0.5
    assert abs(p.info["control_auroc"] - 0.5) <= 0.3


def test_held_out_prompts_are_every_third() -> None:
    from driftlab.protocol.directions import _split

    acts = torch.arange(7.0)[:, None, None].expand(7, 2, 3)
    train, held = _split(acts)
    assert held[:, 0, 0].tolist() == [i for i in range(7) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    assert len(train) + len(held) == 7


def test_a_recorded_run_projected_teacher_forced_equals_what_it_recorded(smol32, tmp_path) -> None:
    """`driftlab project` reads a run's dialogs and probes again: where the re-encoded reply has the
    tokens that were generated, its projections equal those recorded live (float32)."""
    from driftlab.protocol.project import Project, ProjectConfig
    from driftlab.report.activation import checks, measures_frame

    found = Directions.load(_directions(smol32, tmp_path))
    smol32.use_directions(found)
    try:
        live = dl.selfchat(smol32, pair=["reply-in-french:very-happy", "secret-number-share:teen-slang"], rounds=2,
                           max_new_tokens=8, probe_tokens=8, greedy=True, steer="trace", out=tmp_path / "run",
                           progress=False)
        spec = spec_of(smol32).model_copy(update={"directions": str(tmp_path / "dirs")})
        projected = dl.run(Project(ProjectConfig(backend=spec, from_run=str(tmp_path / "run")), smol32),
                           out=tmp_path / "projected", progress=False)
    finally:
        smol32.use_directions(None)
    recorded = {(r["pair"], r["round"], r["kind"]): r for r in live.records if r.get("activation")}
    assert len(recorded) == 8  # 2 pairs x 2 rounds x (turn + probe)
    same = 0
    for r in projected.records:
        rec = recorded[(r["pair"], r["round"], r["what"])]
        if r["positions"] == rec["n_tokens"] + (rec["finish_reason"] == "stop"):
            np.testing.assert_allclose(r["reply"], rec["activation"]["reply"], atol=1e-4)
            np.testing.assert_allclose(r["prompt"], rec["activation"]["prompt"], atol=1e-4)
            same += 1
    assert same >= 6, same  # the re-encoding keeps most replies' tokens
    frame = measures_frame(tmp_path / "projected")
    assert len(frame) == 8 and frame.pi.notna().all() and frame.projection.notna().all()
    assert checks(frame).fall is not None


def _directions(backend, tmp_path: Path) -> Path:
    """Directions of the two agents of the test's run, small and greedy, kept in tmp_path/dirs."""
    dl.directions(backend, personas=["reply-in-french", "secret-number-share"], starters=2, max_new_tokens=8,
                  greedy=True, out=tmp_path / "dirs", progress=False)
    return tmp_path / "dirs"


@pytest.mark.slow
def test_the_demo_measures_drift_five_ways_into_one_report(monkeypatch, tmp_path) -> None:
    """The demo's command, in this process, at the smallest sizes that still give a drift to
    report (two rounds: the first and the last): what it writes does not depend on its sizes."""
    import importlib

    from typer.testing import CliRunner

    from driftlab.cli import app
    from tiny_models import make_tiny_model

    demo = importlib.import_module("driftlab.cli.demo")  # (driftlab.cli.demo is the command's function)
    for name, value in {"ROUNDS": 2, "TURN_TOKENS": 8, "PROBE_TOKENS": 8, "STARTERS": 3, "DIRECTION_TOKENS": 8}.items():
        monkeypatch.setattr(demo, name, value)
    model = make_tiny_model("llama", tmp_path / "llama")
    done = CliRunner().invoke(app, ["demo", "--model", str(model), "--dtype", "float32", "--out", str(tmp_path / "demo")])
    assert done.exit_code == 0, (done.output[-3000:], done.exception)
    page = (tmp_path / "demo" / "report.html").read_text()
    assert "Drift measured side by side" in page and "drift signals, tested per conversation" in page
    assert (tmp_path / "demo" / "three_ways.png").is_file()
    assert Directions.load(tmp_path / "demo" / "directions").meta["n_layers"] == 3
    records = RunDir(tmp_path / "demo").records()
    agent = [r for r in records if r["kind"] == "turn" and r["speaker"] == "agent"]
    assert agent and all(r["pi"] and r["activation"] and r["kl"] for r in agent)
