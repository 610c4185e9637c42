"""`--ray`: a local model sharded over Ray actors gives the single-process results, survives dead actors."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from driftlab.chat import BackendSpec, ChatRequest, Runtime, Sampling, make_backend
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig
from driftlab.records.rundir import RunDir

TINY = Sampling(greedy=True, max_new_tokens=8)


def _config(smol_dir) -> SelfChatConfig:
    spec = BackendSpec(model=str(smol_dir), dtype="float32", runtime=Runtime(ray="local", actors=2))
    # probe_after "user": the kill schedules below count this placement's generate calls.
    return SelfChatConfig(backend=spec, pairs=2, rounds=2, sampling=TINY, probe_tokens=8, seed=5, probe_after="user")


@pytest.fixture(scope="module")
def ray_cluster():
    import builtins

    import ray

    print_ = builtins.print
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield ray
    ray.shutdown()
    # Ray's progress bars replace builtins.print for the whole process (ray.experimental.tqdm_ray,
    # RAY_TQDM_PATCH_PRINT) and shutdown leaves it so: a later test on this worker that pickles
    # print (test_pasta_data.py's refused pickle) would meet Ray's function instead.
    builtins.print = print_


@pytest.fixture(scope="module")
def pool(ray_cluster, smol_dir):
    """Two CPU actors, each with the float32 model; `make_backend` picks the pool from the spec."""
    from driftlab.chat.ray_pool import RayBackend

    backend = make_backend(_config(smol_dir).backend)
    assert isinstance(backend, RayBackend)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def reference(smol_dir, smol32, tmp_path_factory):
    """The same self-chat in this process, on the plain local backend: {key: (text, n_tokens, finish_reason)}."""
    out = tmp_path_factory.mktemp("single") / "run"
    run_protocol(SelfChat(_config(smol_dir), smol32), out, progress=False)
    return _results(out)


def _results(path) -> dict:
    records = RunDir(path).records(RECORDS)
    keys = [r.key for r in records]
    assert len(keys) == len(set(keys)), "a record was written twice"
    manifest = RunDir(path).read_manifest()
    assert manifest["completed"] and len(keys) == sum(SelfChat.expected(manifest).values())
    return {r.key: (r.text, r.n_tokens, r.finish_reason) for r in records}


class Killing:
    """The pool, with real actor kills before chosen generate calls: {call number: [(actor, restart?, delay)]}.
    A delay kills from a thread while the call runs; Ray restarts an actor killed with restart, the pool
    replaces one killed for good."""

    def __init__(self, pool, kills: dict[int, list[tuple[int, bool, float]]]) -> None:
        self.pool, self.kills, self.calls = pool, kills, 0
        self.name, self.capabilities = pool.name, pool.capabilities

    def generate(self, request: ChatRequest):
        import ray

        self.calls += 1
        for actor, restart, delay in self.kills.get(self.calls, []):
            kill = lambda a=actor, r=restart: ray.kill(self.pool._actors[a], no_restart=not r)  # noqa: E731
            threading.Timer(delay, kill).start() if delay else kill()
        return self.pool.generate(request)

    def describe(self):
        return self.pool.describe()


@pytest.mark.model
def test_selfchat_on_ray_equals_the_single_process_run(pool, reference, smol_dir, tmp_path):
    run_protocol(SelfChat(_config(smol_dir), pool), tmp_path / "run", progress=False)
    assert _results(tmp_path / "run") == reference
    assert len(reference) == 10  # 2 pairs x (3 turns + 2 probes): both actors had rows in every call
    assert RunDir(tmp_path / "run").read_manifest()["models"]["agent"]["ray"] == {"address": "local", "actors": 2}


@pytest.mark.model
def test_dead_actors_rerun_their_shard_once(pool, reference, smol_dir, tmp_path):
    before = list(pool._actors)
    # call 1: actor 0 dies during the call (Ray restarts it, and runs the call again there); call 2: actor 1
    # dies for good (replaced). Two deaths, one of each kind: each death costs a new actor process's imports
    # and model load, of a few seconds.
    killing = Killing(pool, {1: [(0, True, 0.5)], 2: [(1, False, 0.0)]})
    run_protocol(SelfChat(_config(smol_dir), killing), tmp_path / "run", progress=False)
    assert killing.calls == 3
    assert _results(tmp_path / "run") == reference  # complete, no record twice, same texts
    assert pool._actors[0] is before[0] and pool._actors[1] is not before[1]


@pytest.mark.model
def test_loglikelihood_keeps_a_context_on_one_actor_and_matches(pool, smol32):
    questions = [[{"role": "user", "content": f"What is {a}+{a}? A) {a} B) {2 * a} C) 7 D) 9"}] for a in (1, 2, 3)]
    contexts = [q for q in questions for _ in "ABCD"]
    conts = list("ABCD") * len(questions)
    got, want = pool.loglikelihood(contexts, conts, batch_size=2), smol32.loglikelihood(contexts, conts)
    assert [(g.n_tokens, g.is_greedy) for g in got] == [(w.n_tokens, w.is_greedy) for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], rel=1e-4, abs=1e-4)


@pytest.mark.model
def test_errors_inside_an_actor_arrive_as_themselves(pool, smol_dir):
    conv = [{"role": "user", "content": "Hello"}]
    with pytest.raises(DriftlabError) as err:
        pool.generate(ChatRequest([conv] * 3, Sampling(greedy=True, max_new_tokens=9000)))
    assert type(err.value) is DriftlabError  # not Ray's RayTaskError wrapper
    assert "context window" in err.value.message and err.value.hint
    assert [r.text for r in pool.generate(ChatRequest([conv], TINY))]  # the pool still works

    from driftlab.chat.ray_pool import RayBackend

    too_many = BackendSpec(model=str(smol_dir), runtime=Runtime(ray="local", actors=5))
    with pytest.raises(DriftlabError, match="needs 5 CPUs; the Ray cluster has 2"):
        RayBackend(too_many)  # refused at once instead of waiting forever for resources


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets when Ray is not installed
    with pytest.raises(DriftlabError, match="needs Ray") as err:
        make_backend(BackendSpec(runtime=Runtime(ray="local")))
    assert "pip install" in err.value.hint and "\n" not in err.value.message
