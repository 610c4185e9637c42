"""benchmarks/gpu.py (issue 21 point 4) on the CPU: the tiny shape at a very small context.

Runs the benchmark the way a user does (`python benchmarks/run.py gpu --quick`), in its own
process, with settings that keep it short (64-token prompt, 4 decode steps, one round, a
one-pair self-chat), then reads its RESULT lines: every variant must have a finite, positive
time; split-softmax must give the same greedy tokens as the benchmark's independent eager
reference, and must change plain's tokens (so that comparison has teeth); tracing and the
strength-0 modes must give plain's tokens; on a CPU no GPU target may be judged.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODES = ["sdpa", "plain", "trace", "split", "instaboost", "pasta", "composed", "bias", "cfg", "spr", "eager"]

pytestmark = pytest.mark.model  # runs a whole (tiny) protocol


@pytest.fixture(scope="module")
def bench(tmp_path_factory, smol_dir):
    out = tmp_path_factory.mktemp("gpubench") / "gpu.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
        "GPUBENCH_SHAPES": "tiny",
        "GPUBENCH_CONTEXTS": "64",
        "GPUBENCH_DECODE": "4",
        "GPUBENCH_REPEATS": "1",
        "GPUBENCH_SELFCHAT": "1x1x4@tiny",
        "GPUBENCH_TOKENIZER": str(smol_dir),
        "GPUBENCH_JSON": str(out),
        "CUDA_VISIBLE_DEVICES": "",  # the CPU path, even on a GPU machine
    }
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "gpu", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            m = re.fullmatch(r"RESULT ([\w.+-]+)=(\S+)", line)
            assert m, f"malformed RESULT line: {line!r}"
            results[m.group(1)] = m.group(2)
    return proc.stdout, results, json.loads(out.read_text())


def test_every_mode_has_a_finite_positive_time(bench):
    _, r, _ = bench
    assert r["device"] == "cpu"
    for mode in MODES:
        for key in ("prefill_ms", "decode_ms", "total_ms"):
            value = float(r[f"tiny.64.{mode}.{key}"])
            assert math.isfinite(value) and value > 0, (mode, key, value)
        assert float(r[f"tiny.64.{mode}.decode_vs_plain"]) > 0
    assert float(r["tiny.64.plain.decode_vs_plain"]) == 1.0
    assert r["tiny.loop_ran"] == r["loop"] == "dynamic"  # the loop that decoded, as the backend says
    assert float(r["bandwidth_gb_s"]) > 0 and float(r["tiny.64.floor_ms"]) > 0
    if importlib.util.find_spec("pastalib") is not None:
        assert float(r["tiny.64.pastalib.total_ms"]) > 0


def test_split_softmax_matches_the_eager_reference(bench):
    _, r, _ = bench
    n = 5  # 1 prefill + 4 decode steps
    assert r["tiny.split_matches_eager_reference"] == f"{n}/{n}", r["tiny.split_first_divergence"]
    assert r["tiny.split_changes_plain"] == "true"  # else the comparison above could not fail
    assert r["tiny.trace_matches_plain"] == f"{n}/{n}"
    assert r["tiny.neutral_matches_plain"] == "3/3"


def test_selfchat_and_targets(bench):
    out, r, data = bench
    for mode in ["naive", "plain", "trace", "split", "instaboost", "pasta", "composed", "bias", "cfg", "spr"]:
        assert float(r[f"tiny.selfchat.{mode}.tok_s"]) > 0, mode
    assert "n/a (not a GPU)" in out
    assert not re.search(r"│ (met|missed)\s+│", out)  # no target judged on a CPU
    assert {rec["variant"] for rec in data["records"] if "variant" in rec} >= set(MODES)
    assert data["results"] == r


@pytest.mark.parametrize("model", ["nope", "/no/such/model/dir"])
def test_a_bad_benchmark_setting_is_one_error_line(model: str) -> None:
    """`run.py` prints a DriftlabError from any benchmark (here generation's GENBENCH_MODEL) as
    its Error/Hint lines and exits 2, where it was a traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "GENBENCH_MODEL": model, "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "generation", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Error: " in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert "RESULT" not in proc.stdout
