"""benchmarks/gpu.py on the CPU: the tiny shape at a very small context, on the compiled loop.

Runs the benchmark the way a user does (`python benchmarks/run.py gpu --quick`), in its own
process, with settings that keep it short (the tiny shape at 2 layers, 64-token prompt, 4 decode
steps, one round, a one-pair self-chat) and the compiled decode loop (what `auto` means on a GPU),
then reads its RESULT lines: every variant must have a finite, positive time; the sweep of 11 steers must stay
within the graph budget and a second process must load the precompiled steps; every mode
must agree with the independent eager reference in float32 (and change plain's numbers, so the
comparison has teeth); the strength-0 modes must give plain's numbers exactly; on a CPU no GPU
target may be judged. `--paper` runs its tiny size. The file's first test, `driftlab models warm`
on the same tiny shape, saves its plain and steered steps (chat.precompiled).
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

from conftest import CommandServer

ROOT = Path(__file__).resolve().parents[1]
MODES = ["sdpa", "plain", "trace", "split", "instaboost", "pasta", "composed", "bias", "cfg", "spr", "eager"]

pytestmark = pytest.mark.model  # runs a whole (tiny) protocol


RUN = ROOT / "benchmarks" / "run.py"
# The tiny shape at 2 layers, in every run here that builds it (`models warm`'s too, so the benchmark
# loads what it stored): its compiled steps take a third less compiling than at the default 4, and
# every path (PASTA's layer 1 on, the compiled loop, the check) is the same.
TINY = {"GPUBENCH_TINY_LAYERS": "2"}
# Inductor's kernels compiled in the compiling process itself, not in a pool of worker interpreters
# (its default on 2 cores: each worker pays torch's imports, and competes for the 2 cores with the
# other test worker): the same kernels and steps, ~10 s less CPU per process that compiles.
SERIAL_COMPILE = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """`python benchmarks/run.py ...` for the runs that stop at a bad setting and the paper's tiny run:
    each forked from one server that imported torch and transformers once (tests/conftest.py's
    CommandServer), not a new interpreter paying those imports. No such run sets a variable they read
    at import that the run does not set again (OMP_NUM_THREADS: the benchmark pins its threads)."""
    server = CommandServer(tmp_path_factory.mktemp("scripts"), ["torch", "transformers"])
    assert server.import_output == "", server.import_output
    yield server
    server.close()


@pytest.fixture(scope="module")
def driftlab_cache(tmp_path_factory) -> Path:
    """This file's DRIFTLAB_CACHE: `models warm` (the first test) compiles the benchmark's tiny
    shape into it, and the benchmark's processes share it (inductor's kernels, the stored steps)."""
    return tmp_path_factory.mktemp("driftlab-cache")


# The benchmark's tiny shape, saved with random weights and SmolLM2's tokenizer, then warmed by
# `driftlab models warm` at batch 1 (run from benchmarks/, where gpu.py and its imports are).
WARM_TINY = """
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from gpu import shape_config
out, tokenizer = Path(sys.argv[1]), Path(sys.argv[2])
AutoModelForCausalLM.from_config(shape_config("tiny"), dtype=torch.float32).save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(tokenizer / name, out / name)
from driftlab.cli import main
sys.argv = ["driftlab", "models", "warm", str(out), "--batch", "1", "--dtype", "float32", "--device", "cpu"]
main()
"""


@pytest.mark.slow
@pytest.mark.compile
def test_models_warm_compiles_into_the_compile_cache(driftlab_cache, smol_dir, tmp_path) -> None:
    """`driftlab models warm` compiles a plain and a steered step with inductor (the compiled loop's
    backend) into driftlab's compile cache, empty before it, and says so: 2 graphs, each saved as
    a precompiled step (chat.precompiled; aot_compile does not go through inductor's FX graph
    cache: no hits, no misses). It warms the benchmark's tiny shape: the benchmark's sweep then
    runs on its steered step, and its second process loads the steps instead of tracing again."""
    env = {**os.environ, "DRIFTLAB_CACHE": str(driftlab_cache), "OMP_NUM_THREADS": "1", **TINY, **SERIAL_COMPILE,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # inductor sets it in this process once it compiled anything
    assert not (driftlab_cache / "compile").exists()
    done = subprocess.run([sys.executable, "-c", WARM_TINY, str(tmp_path / "tiny"), str(smol_dir)],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"warmed (\d+) graphs .* cache hits (\d+), misses (\d+); precompiled steps saved (\d+), "
                      r"loaded (\d+)", " ".join(done.stdout.split()))
    assert found, done.stdout
    assert tuple(int(x) for x in found.groups()) == (2, 0, 0, 2, 0)
    assert len(list((driftlab_cache / "compile").glob("*/driftlab-aot/*.aot"))) == 2


@pytest.fixture(scope="module")
def bench(tmp_path_factory, smol_dir, driftlab_cache):
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
        "GPUBENCH_LOOP": "compiled",
        "DRIFTLAB_CACHE": str(driftlab_cache),  # what `models warm` compiled above (empty if it did not run)
        "CUDA_VISIBLE_DEVICES": "",  # the CPU path, even on a GPU machine
        **TINY, **SERIAL_COMPILE,
    }
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "gpu", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
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
    assert r["tiny.loop_ran"] == r["loop"] == "compiled"  # the loop that decoded, as the backend says
    assert r["tiny.graphs_compiled_in_timing"] == "0"  # the warm-up compiled everything the timing ran
    assert r["tiny.cudagraph_recordings"] == r["tiny.cudagraph_recordings_in_timing"] == "0"  # none on a CPU
    assert float(r["bandwidth_gb_s"]) > 0 and float(r["tiny.64.floor_ms"]) > 0
    if importlib.util.find_spec("pastalib") is not None:
        assert float(r["tiny.64.pastalib.total_ms"]) > 0


def test_compiling_stays_within_the_budget_and_a_second_process_loads_the_steps(bench):
    _, r, _ = bench
    assert float(r["tiny.first_compile_s"]) > 0
    # No graph at all: `models warm` (this file's first test: another process, the model saved to disk and
    # loaded) stored the steered step, and all 11 steers run on it (the store's key leaves out the metadata
    # saving writes into a config).
    assert r["tiny.sweep11.graphs"] == "0" and r["tiny.sweep11.over_budget"] == "0"
    # The second process traces nothing: it loads the precompiled steps the first saved (chat.precompiled),
    # its plain and steered ones at least, and never reaches inductor's or AOTAutograd's caches.
    assert r["tiny.second_process.graphs"] == "0" and int(r["tiny.second_process.loaded"]) >= 2
    assert r["tiny.second_process.cache_misses"] == r["tiny.second_process.aot_cache_miss"] == "0"
    assert float(r["tiny.sdpa.compile_s"]) > 0 and float(r["tiny.cfg.compile_s"]) > 0  # their own graphs
    assert float(r["tiny.trace.compile_s"]) == 0  # the steered step the sweep ran on


def test_every_mode_matches_the_eager_reference(bench):
    _, r, _ = bench
    for mode in ("plain", "trace", "split", "instaboost", "bias", "composed", "pasta"):
        assert r[f"tiny.check.{mode}.ok"] == "true", (mode, r[f"tiny.check.{mode}.max_logprob_diff"])
        assert r[f"tiny.check.{mode}.tokens_agree"] == "8/8"
    assert float(r["tiny.check.split.max_pi_diff"]) <= 1e-4
    assert r["tiny.check.modes_ok"] == "7/7"
    assert float(r["tiny.check.split_k1.vs_plain"]) == 0 and float(r["tiny.check.instaboost_m1.vs_plain"]) == 0


def test_selfchat_and_targets(bench):
    out, r, data = bench
    for mode in ["naive", "plain", "trace", "split", "instaboost", "pasta", "composed", "bias", "cfg", "spr"]:
        assert float(r[f"tiny.selfchat.{mode}.tok_s"]) > 0, mode
        assert float(r[f"tiny.selfchat.{mode}.warmup_s"]) > 0, mode  # what a cut GPU call keeps of this part
    assert "n/a (not a GPU)" in out
    assert not re.search(r"│ (met|missed)\s+│", out)  # no target judged on a CPU
    assert {rec["variant"] for rec in data["records"] if "variant" in rec} >= set(MODES)
    assert data["results"] == r


def test_the_paper_size_runs_its_tiny_check_on_a_cpu(tmp_path, smol_dir, scripts):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "COLUMNS": "200", "GPUBENCH_TOKENIZER": str(smol_dir), "CUDA_VISIBLE_DEVICES": "",
           "GPUBENCH_PAPER_MODES": "plain,split", "GPUBENCH_PAPER_BATCH": "2", **TINY}
    proc = scripts.run(["gpu", "--paper"], script=RUN, cwd=ROOT, env=env)  # forked: no interpreter's imports to pay
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = dict(line.removeprefix("RESULT ").split("=", 1) for line in proc.stdout.splitlines()
             if line.startswith("RESULT "))
    # 4 pairs x (2 rounds x (agent turn + probe) + the user turn of round 2: round 1's is the starter)
    # x 16 tokens, EOS ignored
    assert r["paper.plain.tokens"] == r["paper.split.tokens"] == str(4 * (2 * 2 + 1) * 16), r
    assert float(r["paper.plain.s"]) > 0 and "n/a (not a GPU)" in proc.stdout
    bad = scripts.run(["gpu", "--paper"], script=RUN, cwd=ROOT, env={**env, "GPUBENCH_PAPER_MODES": "plain,fast"})
    assert bad.returncode != 0 and "unknown mode 'fast'" in bad.stdout + bad.stderr
    # A batch whose KV caches cannot fit in the machine's memory: one line, before any model is built.
    huge = scripts.run(["gpu", "--paper"], script=RUN, cwd=ROOT, env={**env, "GPUBENCH_PAPER_BATCH": str(10**9)})
    said = huge.stdout + huge.stderr
    assert huge.returncode != 0 and "GPUBENCH_PAPER_BATCH=1000000000: 1073741824 rows" in said and "use at most" in said
    assert "Traceback" not in said and "RESULT" not in huge.stdout


def test_the_paper_batch_that_fits_an_80_gb_gpu(monkeypatch) -> None:
    """The paper's Llama-2-7B run in bf16 (8 rounds of 200-token turns, 400-token probes): 16
    conversations fit 80 GiB, 32 do not (their KV caches alone take ~64 GB), nor 16 with CFG's twin
    rows; all fit 141 GiB (an H200). The arithmetic `--paper` checks before it builds the model."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu import paper_fits

    tokens, cuda = 8 * 2 * 200 + 400, torch.device("cuda")
    paper_fits("llama2-7b", 16, False, tokens, torch.bfloat16, cuda, total=80 << 30)
    for batch, twins, most in ((32, False, 16), (16, True, 8)):
        with pytest.raises(SystemExit, match=rf"GPUBENCH_PAPER_BATCH={batch}: 32 rows .* use at most {most}\.$"):
            paper_fits("llama2-7b", batch, twins, tokens, torch.bfloat16, cuda, total=80 << 30)
        paper_fits("llama2-7b", batch, twins, tokens, torch.bfloat16, cuda, total=141 << 30)


@pytest.mark.parametrize("model", ["nope", "/no/such/model/dir"])
def test_a_bad_benchmark_setting_is_one_error_line(model: str, scripts) -> None:
    """`run.py` prints a DriftlabError from any benchmark (here generation's GENBENCH_MODEL) as
    its Error/Hint lines and exits 2, where it was a traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "GENBENCH_MODEL": model, "COLUMNS": "200"}
    proc = scripts.run(["generation", "--quick"], script=RUN, cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Error: " in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert "RESULT" not in proc.stdout


@pytest.mark.parametrize("setting, says", [
    ({"GPUBENCH_SELFCHAT": "2x2"}, "GPUBENCH_SELFCHAT='2x2': use PAIRSxROUNDSxTOKENS"),
    ({"GPUBENCH_SELFCHAT": "2x2x8@llama2-7b"}, "a shape of GPUBENCH_SHAPES (tiny)"),
    ({"GPUBENCH_DTYPE": "int8"}, "GPUBENCH_DTYPE='int8': use bfloat16"),
    ({"GPUBENCH_JSON": "."}, "is a directory"),
    ({"GPUBENCH_TOKENIZER": "/no/such/dir"}, "holds no tokenizer"),
    ({"GPUBENCH_VARIANTS": "split,nope"}, "GPUBENCH_VARIANTS: unknown variant 'nope'; use sdpa, plain"),
    ({"GPUBENCH_TINY_LAYERS": "1"}, "GPUBENCH_TINY_LAYERS='1': use a whole number of at least 2"),
])
def test_a_bad_gpu_benchmark_setting_stops_before_any_model_is_built(setting: dict, says: str, scripts) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": "", **setting}
    proc = scripts.run(["gpu", "--quick"], script=RUN, cwd=ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and says in out and "Traceback" not in out, out[-2000:]
    assert "RESULT" not in proc.stdout


def test_run_py_refuses_a_record_path_it_cannot_write_before_running(tmp_path, scripts) -> None:
    proc = scripts.run(["measures", "--quick", "--record", str(tmp_path)], script=RUN, cwd=ROOT)
    assert proc.returncode == 2 and "is a directory: give a file name in it" in proc.stderr, proc.stderr
    assert "RESULT" not in proc.stdout


@pytest.mark.parametrize("size, settings, event, kept", [
    ("--quick", {"GPUBENCH_SHAPES": "tiny", "GPUBENCH_CONTEXTS": "64", "GPUBENCH_DECODE": "4", "GPUBENCH_PARTS": "modes",
                 "GPUBENCH_LOOP": "dynamic"}, "warm-up", "bandwidth_gb_s"),
    ("--paper", {"GPUBENCH_PAPER_MODES": "plain", "GPUBENCH_PAPER_BATCH": "2"}, "the whole run next",
     "paper.plain.warmup_s"),
])
def test_a_run_stopped_by_sigterm_keeps_what_it_measured(size: str, settings: dict, event: str, kept: str,
                                                         tmp_path, smol_dir) -> None:
    """A lent GPU call ends its command with `timeout` (SIGTERM): the benchmark then prints the
    RESULT lines it has and writes GPUBENCH_JSON, and exits 124, so a cut call keeps its parts.
    Stopped at an event on stderr, not after a delay: the first variant's warm-up, or the paper
    run's first whole run (its warm-up is kept)."""
    import signal

    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "GPUBENCH_TOKENIZER": str(smol_dir), "GPUBENCH_JSON": str(out),
           "CUDA_VISIBLE_DEVICES": "", **TINY, **settings}
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "run.py"), "gpu", size], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if event in line:
                proc.send_signal(signal.SIGTERM)
                break
        stdout, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 124, stdout[-2000:]
    printed = dict(line.removeprefix("RESULT ").split("=", 1) for line in stdout.splitlines()
                   if line.startswith("RESULT "))
    saved = json.loads(out.read_text())
    assert printed["device"] == "cpu" and kept in printed and saved["results"] == printed
    assert saved["notes"][-1] == "stopped early by SIGTERM"
