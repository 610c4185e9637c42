"""Shared fixtures: the real default model, loaded once per session, and the test device.

The model comes from the explicit, checksummed provisioning step (`driftlab models pull`,
run by CI's install step); if it is missing, the first fixture use pulls it, which is that
same step.

`--device` (default cpu; e.g. cuda, cuda:1) puts the model-backed test families (attention
engine, PASTA, mitigations, self-chat, serve, backend, steering, decay) on that device;
tests/devices.py holds the device and the per-device tolerances (docs/testing.md).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The suite runs on pytest-xdist workers (`-n auto --dist loadfile`, pyproject's addopts; `-n 0`
# runs it in one process). Workers share the machine's cores, so each gets its share of torch
# threads, set before torch is imported in the worker or in a process a test starts (they
# inherit the environment): more threads than cores let OpenMP barriers wait for descheduled
# threads (tests/attention_reference.py saw a test file run 8x slower so on a shared 2-core
# machine). The test models are tiny: one thread per worker loses little (docs/testing.md).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    # Inductor's compile threads likewise: at its default (one per core) every process that compiles
    # starts a pool of worker interpreters (each imports torch) to run g++ beside a core the other
    # test worker already uses; in-process it costs 4% less CPU (test_benchmarks_gpu.py, 2026-11-29).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
MAX_WORKERS = 4  # each worker holds its own copies of the test models (a few GB)

# Fewer cyclic garbage collections in the test processes. Their tests make and drop many
# mid-lived objects (traces, records, graphs, whole models); at Python's default thresholds
# (700, 10, 10) young collections promote them to the oldest generation, and full collections
# walk a heap of millions of objects again and again (docs/results/suite/gc-2026-11-27.txt).
# These thresholds cost a test run 4% less CPU (docs/results/suite/gc-threshold-2026-11-27.txt).
gc.set_threshold(50_000, 20, 20)


# Seconds (and tests) of the test files that take 5 s or more, whole, and of the many-test light
# ones (one recorded run, 2026-11-29, 2-core Intel Xeon with AMX, unloaded, empty compile caches, at
# 646aa38: docs/results/suite/durations-2026-11-29d.txt; its ratios are what counts); every other file is
# costed at LIGHT_TEST_S a test.
# Workers take whole files (`--dist loadfile`) in the order of the collection, which
# `pytest_collection_modifyitems` below makes longest first, so that no long file starts last
# while the other worker has run dry: xdist's own order (most tests first) put the few-test,
# long files (kill-and-resume, compile cache, tutorial) at the end. To refresh the table from a
# run's `--junitxml`: sum each file's testcase times.
FILE_SECONDS = {
    "test_benchmarks_gpu.py": (163, 19), "test_static_decode.py": (163, 69), "test_serve_faults.py": (55, 11),
    "test_ray.py": (47, 5), "test_resume.py": (47, 9), "test_graph_budget.py": (46, 5), "test_kl.py": (42, 10),
    "test_tutorial.py": (38, 2), "test_activation.py": (30, 17), "test_assets.py": (29, 21),
    "test_continuous.py": (29, 12), "test_directions.py": (28, 5), "test_bench_measures.py": (27, 50),
    "test_pi_floor.py": (25, 63), "test_attention_flex.py": (24, 54), "test_hub.py": (24, 40),
    "test_backend.py": (23, 23), "test_results_figures.py": (23, 10), "test_attention_engine.py": (21, 83),
    "test_cli_errors.py": (20, 127), "test_lm_eval_adapter.py": (20, 8), "test_serve.py": (18, 21),
    "test_sweep_benchmark.py": (18, 8), "test_harnesses.py": (17, 4), "test_plugins.py": (15, 4),
    "test_cli.py": (14, 19), "test_pasta_tasks.py": (12, 24), "test_readme.py": (12, 4),
    "test_report.py": (12, 31), "test_openai_backend.py": (11, 9), "test_serve_telemetry.py": (11, 10),
    "test_stats.py": (11, 65), "test_decay.py": (10, 4), "test_from_model.py": (10, 19),
    "test_sampling_fields.py": (10, 47), "test_pasta_tune.py": (9, 5), "test_serve_completions.py": (9, 19),
    "test_sweep.py": (9, 19), "test_flex_guard.py": (8, 5), "test_pasta_steering.py": (8, 50),
    "test_api.py": (7, 17), "test_bench_personas.py": (7, 360), "test_directions_formats.py": (7, 14),
    "test_judge.py": (7, 23), "test_response_format.py": (7, 8), "test_theory.py": (7, 32),
    "test_mmlu.py": (6, 28), "test_results_contract.py": (6, 12), "test_ifeval.py": (4, 10),
    "test_mitigations.py": (4, 4), "test_options.py": (4, 21), "test_replay.py": (4, 13),
    "test_claims.py": (3, 111), "test_ifbench.py": (3, 12), "test_serve_openai_compat.py": (3, 20),
    "test_warn.py": (3, 13), "test_pasta_data.py": (2, 31), "test_pasta_metrics.py": (2, 27),
    "test_selfchat.py": (2, 30), "test_when_drifting.py": (2, 15), "test_bench_user_personas.py": (0, 15),
    "test_sampling.py": (0, 49), "test_steering.py": (0, 28), "test_vllm.py": (0, 32),
}
LIGHT_TEST_S = 0.3


def pytest_xdist_auto_num_workers(config):
    """How many workers `-n auto` starts: one per core, at most MAX_WORKERS; none (one process)
    on a single core, and with `--device cuda`, where the tests share one GPU and its memory."""
    if config.getoption("--device") != "cpu":
        return 0
    workers = min(MAX_WORKERS, os.cpu_count() or 1)
    return workers if workers > 1 else 0


def pytest_addoption(parser):
    parser.addoption(
        "--device", default="cpu", metavar="DEVICE",
        help="torch device for the model-backed tests: cpu (default), cuda, cuda:N. "
             "Tolerances follow the device (tests/devices.py, docs/testing.md).")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.7: keep the collection's order
        config.option.loadscopereorder = False  # (longest files first: pytest_collection_modifyitems)
    spec = config.getoption("--device")
    if spec != "cpu":  # the default needs nothing (and no torch import before collection)
        import devices

        devices.configure(spec)


def pytest_report_header(config):
    return f"driftlab test device: {config.getoption('--device')}"


@pytest.fixture(autouse=True)
def _torch_config_intact():
    """Fails the test that deleted an entry of a torch config module (tests/config_guard.py), and
    repairs the entry so that the tests after it in this process still compile."""
    yield
    import config_guard

    hidden = config_guard.hidden_entries()
    if hidden:
        config_guard.unhide(hidden)
        names = ", ".join(f"{m.__name__}.{name}" for m, name in hidden)
        pytest.fail(f"this test deleted {names} (monkeypatch on a torch config module undoes by deleting); "
                    "change such a config with its own API: torch._dynamo.config.patch(name=value)", pytrace=False)


@pytest.fixture(scope="session")
def device():
    """The torch.device the tests run on (`--device`)."""
    import devices

    return devices.current()


@pytest.fixture(scope="session")
def tol(device):
    """Tolerances for `device`: `tol(cpu_value, dtype)` and `tol.exact` (tests/devices.py)."""
    import devices

    return devices.Tolerance(device)


@pytest.fixture(scope="session")
def smol_dir():
    from driftlab.assets import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol32(smol_dir, device):
    """SmolLM2-135M in float32: exact comparisons are meaningful there."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(smol_dir), dtype="float32", device=str(device), prefix_cache_bytes=0)


@pytest.fixture(scope="session")
def smol_bf16(smol_dir, device):
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(smol_dir), dtype="bfloat16", device=str(device))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """The directory of a tiny random Llama (tests/tiny_models.py: 3 layers of 4 heads, SmolLM2's
    tokenizer), built once per worker, for the tests where an option's check needs no language.
    Read only: a test that changes a model's files builds its own."""
    from tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama") / "llama")


@pytest.fixture
def holm_reference(monkeypatch):
    """statsmodels' Holm adjustment, the independent reference for driftlab's: p-values -> adjusted.
    Its Holm branch ends with gc.collect(), a full collection of the test worker's whole heap
    (a second or more once models and compiled graphs are in it); the numbers do not depend on it."""
    from statsmodels.stats.multitest import multipletests

    def adjusted(p) -> list[float]:
        with monkeypatch.context() as patch:  # (it imports gc inside the function)
            patch.setattr(gc, "collect", lambda *args: 0)
            return list(multipletests(p, method="holm")[1])

    return adjusted


def unwritable_dir(base: Path, request) -> Path:
    """A directory nobody can write: `base`/read-only (chmod 555), or, as root (who ignores
    permission bits), a directory of a kernel filesystem. Skips where neither exists."""
    ro = base / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    request.addfinalizer(lambda: ro.exists() and ro.chmod(0o755))  # so that tmp_path can be removed
    if not _can_write(ro):
        return ro
    ro.chmod(0o755)
    ro.rmdir()
    for candidate in (Path("/sys/fs"), Path("/proc/sys")):
        if candidate.is_dir() and not _can_write(candidate):
            return candidate
    pytest.skip("no unwritable directory to test with (running as root without /sys?)")


def _can_write(directory: Path) -> bool:
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


# -- driftlab commands, each a process forked from one server ---------------------------------------
# The server (python -c) imports what the commands need once (`preload`) and runs nothing (no thread
# pool exists when it forks), says "ready", then forks one child per job line on its stdin: the child
# takes the job's environment, working directory, stdin and output files, and is what `driftlab ARGS`
# would be (driftlab.cli.main: exit code 0, 2 with a DriftlabError's two lines, or a traceback), less
# the seconds of imports a new interpreter pays (torch and transformers: ~5 s of a CPU). With
# kill_after it sends itself SIGKILL right after its Nth durable append to any run directory.
# Differences from a new interpreter: modules are imported before the job's environment is set
# (only a variable read at import, e.g. huggingface_hub's HF_HOME, would be missed: such a job
# needs its own interpreter), their import-time output goes to the server (`import_output`), and a
# usage line names the program `driftlab` (its console script), not `python -m driftlab`.
_COMMAND_SERVER = r"""
import atexit, json, os, runpy, signal, sys, traceback

for name in json.loads(sys.argv[1]):
    __import__(name)


def child(job):
    os.dup2(os.open(job["stdin"] or os.devnull, os.O_RDONLY), 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdin = open(0, closefd=False)  # not the server's reader of job lines
    if job["env"] is not None:
        os.environ.clear()
        os.environ.update(job["env"])
    if job["cwd"]:
        os.chdir(job["cwd"])
    if job["kill_after"]:
        from driftlab.records import rundir

        calls, append = [0], rundir.RunDir.append

        def append_then_maybe_die(self, records):
            append(self, records)
            calls[0] += bool(records)
            if calls[0] >= job["kill_after"]:
                os.kill(os.getpid(), signal.SIGKILL)

        rundir.RunDir.append = append_then_maybe_die
    sys.argv = [job["script"] or "driftlab", *job["args"]]
    code = 0
    try:
        if job["script"]:  # `python SCRIPT ARGS`: its folder first on the path, as Python puts it
            sys.path.insert(0, os.path.dirname(os.path.abspath(job["script"])))
            runpy.run_path(job["script"], run_name="__main__")
        else:
            from driftlab.cli import main

            main()
    except SystemExit as done:
        if done.code is not None and not isinstance(done.code, int):  # as Python's own exit prints it
            print(done.code, file=sys.stderr)
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(job)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


class CommandServer:
    """`driftlab` commands, each in its own process forked from one server (_COMMAND_SERVER)."""

    def __init__(self, workdir: Path, preload: list[str], env: dict[str, str] | None = None, *,
                 driftlab: bool = True) -> None:
        """The server imports `preload` and, unless `driftlab` is False (for scripts that must meet
        driftlab's imports themselves: tests/test_flex_guard.py), driftlab's command line."""
        self.workdir, self.n = workdir, 0
        self._err = (workdir / "server.err").open("w+")
        preload = [*preload, *(["driftlab.cli", "driftlab.records.rundir"] if driftlab else [])]
        self.server = subprocess.Popen([sys.executable, "-c", _COMMAND_SERVER, json.dumps(preload)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                       env=env, start_new_session=True)
        said = []
        for line in self.server.stdout:
            if line == "ready\n":
                break
            said.append(line)
        else:
            self._err.seek(0)
            raise RuntimeError(f"the command server did not start: {self._err.read()[-3000:]}")
        self._err.seek(0)
        self.import_output = "".join(said) + self._err.read()  # what importing `preload` printed

    def run(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
            stdin: bytes | None = None, kill_after: int = 0, script: Path | None = None) -> subprocess.CompletedProcess:
        """Like subprocess.run([driftlab, *args], capture_output=True), or [python, script, *args]:
        env (the whole environment, as subprocess.run's) or the server's; the output as text
        (decoded, errors replaced)."""
        self.n += 1
        out, err, given = (self.workdir / f"{self.n}.{part}" for part in ("out", "err", "in"))
        if stdin is not None:
            given.write_bytes(stdin)
        job = {"args": [str(a) for a in args], "stdout": str(out), "stderr": str(err),
               "stdin": str(given) if stdin is not None else None, "env": None if env is None else dict(env),
               "cwd": None if cwd is None else str(cwd), "kill_after": kill_after,
               "script": None if script is None else str(script)}
        self.server.stdin.write(json.dumps(job) + "\n")
        self.server.stdin.flush()
        status = self.server.stdout.readline()
        assert status, f"the command server died running {args}"
        read = lambda path: path.read_bytes().decode("utf-8", "replace")  # noqa: E731
        argv = ["driftlab", *args] if script is None else [sys.executable, str(script), *args]
        return subprocess.CompletedProcess(argv, json.loads(status), read(out), read(err))

    def close(self) -> None:
        self.server.stdin.close()
        try:
            self.server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a command hung (its test failed on the timeout): end it too
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
        self._err.close()


# What the protocol commands of test_resume.py, test_directions.py and test_kl.py import, once, in
# their shared server (each command still imports the rest itself), and the protocols they run
# (their modules import no data and start no thread).
PROTOCOL_PRELOAD = [
    "matplotlib.pyplot", "pandas", "scipy.stats", "torch", "transformers", "transformers.masking_utils",
    "transformers.models.llama.modeling_llama", "driftlab.chat.hf", "driftlab.protocol.runner",
    "driftlab.protocol.selfchat", "driftlab.protocol.replay", "driftlab.protocol.mmlu", "driftlab.protocol.sweep",
    "driftlab.protocol.calibrate", "driftlab.protocol.decay", "driftlab.pasta.profile", "driftlab.pasta.tune",
    "driftlab.report.html"]


@pytest.fixture(scope="session")
def protocol_commands(tmp_path_factory, smol_dir):
    """One command server per test worker for the protocol commands (`driftlab selfchat|kl|directions
    ...`): its start imports PROTOCOL_PRELOAD (seconds of a CPU), paid once, not once per file.
    tests/ is on its PYTHONPATH for the fakes; the caller's PYTHONPATH is kept, so every process
    imports the same driftlab."""
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    server = CommandServer(tmp_path_factory.mktemp("protocol-commands"), PROTOCOL_PRELOAD,
                           {**os.environ, "PYTHONPATH": path})
    yield server
    server.close()


def linked_copy(src: Path, dst: Path, leave_out: str) -> Path:
    """A model directory made of symlinks to `src`'s files, all but `leave_out` (cheap variants)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != leave_out:
            (dst / f.name).symlink_to(f)
    return dst


MODEL_FIXTURES = {"smol_dir", "smol32", "smol_bf16", "smol"}
# Marks of tests that are slow on a CPU: `slow` (over ~20 s), `compile` (torch.compile: dynamo
# and inductor take seconds to minutes per graph there) and `process` (fresh interpreters: a few
# seconds of imports each, so the fast suite's inner loop keeps none of them).
CPU_SLOW_MARKS = ("slow", "compile", "process")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Every test that loads the real model is marked `model`, whether or not it says so; on the
    CPU, so is every `slow`, `compile` or `process` test. Then, once -m/-k have deselected, the longest
    files go first.

    A test uses the real model through these fixtures (or a `smollm2` parameter); marking by
    fixture means a new test cannot forget the marker and slip into the fast suite
    (`-m "not model and not network"`, the README's). With `--device cuda` a `slow` or `compile`
    test keeps its own marks only: `-m "not model"` there runs the compiled paths, which is what
    a GPU run is for (docs/performance.md).
    """
    cpu = config.getoption("--device") == "cpu"
    no_vllm = pytest.mark.skip(reason="vLLM is not installed here; CI runs the vllm tests in its second environment "
                                      "(pip install -e \".[vllm,test]\", .ci/run)")
    has_vllm = None
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.model)
            if has_vllm is None:
                has_vllm = importlib.util.find_spec("vllm") is not None
            if not has_vllm:
                item.add_marker(no_vllm)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (MODEL_FIXTURES & set(item.fixturenames) or "smollm2" in params.values()
                or cpu and any(item.get_closest_marker(name) for name in CPU_SLOW_MARKS)):
            item.add_marker(pytest.mark.model)
    yield  # the other implementations: -m and -k deselect here
    _longest_files_first(items)


def _longest_files_first(items) -> None:
    """The longest files first (FILE_SECONDS), each file's tests in their own order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost(path: str) -> float:
        n = len(files[path])
        seconds, tests = FILE_SECONDS.get(path.rsplit("/", 1)[-1], (LIGHT_TEST_S * n, n))
        return seconds * n / max(tests, n)  # a file's share of its time where -m/-k left part of it

    items[:] = [item for path in sorted(files, key=cost, reverse=True) for item in files[path]]
