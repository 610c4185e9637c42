"""`RayBackend`: a local model sharded over a pool of Ray actors (`--ray ADDRESS --actors N`).

Each actor holds one `HFChatBackend`; every request's rows are split into one contiguous
shard per actor and run at once. Rows carry their own seeds, so the replies do not depend
on the sharding, and the driver stays the only writer of the run directory (protocols
write records after `generate` returns). A shard whose actor dies is run again, on Ray's
restart of that actor or on a fresh one, and its replies are taken once: nothing is
duplicated. Ray is imported lazily, so this module imports without it.

On a remote cluster every node needs driftlab installed and the model pulled; each actor
keeps its own prefix cache, so `prefix_cache_bytes` is per actor (by default a share of its GPU's free
memory, or 2 GiB for a CPU actor: CPU actors share their host's memory).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from driftlab.chat.base import Capabilities, ChatRequest, Conversation, LogLikelihood, Reply
from driftlab.chat.spec import BackendSpec, Runtime
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import KINDS, Interventions

DEFAULT_ACTORS = 2  # CPU actors when the cluster has no GPUs and --actors is not given
RESTARTS = 2  # Ray's own restarts of a dead actor (its pending calls are retried on the new one)
REPLACEMENTS = 2  # then fresh actors per shard and call, before giving up


def _ray():
    """Import Ray, or say in one line how to get it."""
    try:
        import ray
    except ImportError:
        raise DriftlabError("--ray needs Ray, which is not installed.",
                            hint="pip install -e '.[ray]' (or pip install 'ray>=2.40').") from None
    return ray


def connect(address: str) -> None:
    """Join the cluster at `address`, or start a quiet local one for 'local'; reuse a live connection."""
    ray = _ray()
    if ray.is_initialized():
        return
    quiet: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if address == "local":
            ray.init(include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise DriftlabError(f"Cannot reach the Ray cluster at {address!r}: {str(err).splitlines()[0]}",
                            hint="Start one with `ray start --head`, or use --ray local.") from None


CPU_ACTOR_CACHE = 2 << 30  # a CPU actor's prefix cache: its host's memory is shared by every actor on it


class _Worker:
    """One actor's local backend. A load error is kept and raised by every call, so it reaches the
    driver as that error (Ray would otherwise report only a dead actor, and restart it in vain)."""

    def __init__(self, spec: BackendSpec, prefix_cache_bytes: int | None, threads: int | None) -> None:
        self.backend: Any = None
        self.error: BaseException | None = None
        try:
            if threads:
                import torch

                torch.set_num_threads(threads)  # one core per CPU actor: actors do not fight over cores
            from driftlab.chat.hf import HFChatBackend

            self.backend = HFChatBackend.from_spec(spec, prefix_cache_bytes=prefix_cache_bytes)
        except Exception as err:  # raised again by every call
            self.error = err

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.error is not None:
            raise self.error
        return getattr(self.backend, method)(*args, **kwargs)


class RayBackend:
    """A local model on a pool of Ray actors: one per GPU, else `--actors` CPU actors (default 2)."""

    def __init__(self, spec: BackendSpec, *, prefix_cache_bytes: int | None = None) -> None:
        if not spec.runtime.ray:
            raise DriftlabError("RayBackend needs a Ray address.", hint="Use --ray local or --ray ADDRESS.")
        ray = _ray()
        self.name = spec.model
        # Everything the local model applies, but not its token level (that stays in the actors).
        self.capabilities = Capabilities(interventions=frozenset(KINDS), loglikelihood=True)
        self.address = spec.runtime.ray
        connect(self.address)
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        use_gpu = gpus > 0 and spec.device != "cpu"
        n = spec.runtime.actors or (gpus if use_gpu else DEFAULT_ACTORS)
        have, unit = (gpus, "GPU") if use_gpu else (cpus, "CPU")
        if n > have:  # Ray would wait forever for resources that never come
            raise DriftlabError(f"--actors {n} needs {n} {unit}s; the Ray cluster has {have}.",
                                hint=f"Use --actors {max(have, 1)} or fewer, or add nodes.")
        # Inside an actor Ray shows only its own GPU, as cuda:0; runtime reset so it does not recurse.
        device = ("cuda" if spec.device.startswith("cuda") else spec.device) if use_gpu else "cpu"
        self._local = spec.model_copy(update={"runtime": Runtime(), "device": device})
        _download_once(spec.model)
        self._cache_bytes = prefix_cache_bytes if prefix_cache_bytes is not None or use_gpu else CPU_ACTOR_CACHE
        self._threads = None if use_gpu else 1
        self._actor_cls = ray.remote(_Worker).options(
            num_cpus=1, num_gpus=1 if use_gpu else 0, max_restarts=RESTARTS, max_task_retries=RESTARTS)
        self._actors = [self._spawn() for _ in range(n)]
        # Wait for every actor's model (a load error surfaces here, before a run writes anything).
        self._meta: dict[str, Any] = self._map("describe", [((), {})] * n)[0]

    # -- ChatBackend -----------------------------------------------------------------------------
    def generate(self, request: ChatRequest) -> list[Reply]:
        """Each actor continues one contiguous shard of the rows, with those rows' own seeds."""
        self.capabilities.require(self.name, request.interventions)
        if hooks := request.local_only():
            raise DriftlabError(f"A Ray pool does not take {', '.join(hooks)} (a local model's decode-loop hooks).",
                                hint="Serve a local model instead.")
        seeds, store = request.row_seeds(), request.cache_store
        shards = _split([1] * len(request.conversations), len(self._actors))
        jobs = [((ChatRequest([request.conversations[i] for i in rows], request.sampling,
                               seeds=[seeds[i] for i in rows], interventions=request.interventions,
                               cache_store=[store[i] for i in rows] if store is not None else None,
                               logprobs=request.logprobs),), {})
                if rows else None for rows in shards]
        return _merge(shards, self._map("generate", jobs))

    def loglikelihood(
        self,
        contexts: Sequence[Conversation],
        continuations: Sequence[str],
        interventions: Interventions = Interventions(),
        *,
        batch_size: int = 8,
    ) -> list[LogLikelihood]:
        """Shards keep the rows of one context together: the local backend scores them in one pass."""
        if len(contexts) != len(continuations):
            raise DriftlabError(f"{len(contexts)} contexts but {len(continuations)} continuations.")
        self.capabilities.require(self.name, interventions)
        groups: dict[str, list[int]] = {}
        for i, conv in enumerate(contexts):
            groups.setdefault(json.dumps(conv, sort_keys=True), []).append(i)
        order = list(groups.values())
        shards = [[i for g in chunk for i in order[g]]
                  for chunk in _split([len(g) for g in order], len(self._actors))]
        jobs = [(([contexts[i] for i in rows], [continuations[i] for i in rows], interventions),
                 {"batch_size": batch_size}) if rows else None for rows in shards]
        return _merge(shards, self._map("loglikelihood", jobs))

    def describe(self) -> dict[str, Any]:
        return {**self._meta, "ray": {"address": self.address, "actors": len(self._actors)}}

    def close(self) -> None:
        """Kill the actors (their GPUs and memory go back to the cluster); the connection stays."""
        for actor in self._actors:
            self._kill(actor)
        self._actors = []

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _kill(actor) -> None:
        ray = _ray()
        try:
            ray.kill(actor, no_restart=True)
        except ray.exceptions.RayError:
            pass  # already gone

    def _spawn(self):
        return self._actor_cls.remote(self._local, self._cache_bytes, self._threads)

    def _map(self, method: str, jobs: list[tuple[tuple, dict] | None]) -> list[Any]:
        """Call `method` on actor i with jobs[i] (None: nothing), all at once; results in order.

        A dead actor (after Ray's own restarts) is replaced and its job resubmitted, at most
        REPLACEMENTS times; only one result per job is ever taken. An error raised by the
        backend itself is raised here as that error, not as a Ray traceback.
        """
        ray = _ray()
        lost = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
        refs = {i: self._actors[i].call.remote(method, *job[0], **job[1]) for i, job in enumerate(jobs) if job}
        out: list[Any] = [None] * len(jobs)
        for i, ref in refs.items():
            for attempt in range(REPLACEMENTS + 1):
                try:
                    out[i] = ray.get(ref)
                    break
                except ray.exceptions.RayTaskError as err:
                    if isinstance(err.cause, DriftlabError):
                        raise err.cause from None
                    if isinstance(err.cause, Exception):
                        raise err.cause from err  # a bug: keep the remote traceback
                    raise
                except lost as err:
                    if attempt == REPLACEMENTS:
                        raise DriftlabError(
                            f"Ray actor {i} of {len(self._actors)} died {attempt + 1} times running one shard "
                            f"({type(err).__name__}); giving up.",
                            hint="Check the cluster's memory and logs (`ray status`); fewer --actors may help.",
                        ) from None
                    self._kill(self._actors[i])
                    self._actors[i] = self._spawn()
                    job = jobs[i]
                    ref = self._actors[i].call.remote(method, *job[0], **job[1])
        return out


def _split(sizes: Sequence[int], k: int) -> list[list[int]]:
    """Indices of `sizes` in k contiguous chunks of about equal total size (some may be empty)."""
    total = sum(sizes)
    chunks: list[list[int]] = [[] for _ in range(k)]
    done = 0
    for i, size in enumerate(sizes):
        chunks[min(k - 1, done * k // total)].append(i)
        done += size
    return chunks


def _merge(shards: list[list[int]], results: list[list[Any] | None]) -> list[Any]:
    """Put each shard's results back at its rows' positions."""
    out: list[Any] = [None] * sum(len(rows) for rows in shards)
    for rows, res in zip(shards, results, strict=True):
        for i, r in zip(rows, res or [], strict=True):
            out[i] = r
    return out


def _download_once(model: str) -> None:
    """A Hub model that is not cached is downloaded here, once, before the actors start
    (on one machine they share the Hugging Face cache; they would all download it at once)."""
    from driftlab.assets import PRESETS
    from driftlab.assets.hub import parse_hub_id, resolve_hub

    if model in PRESETS or Path(model).expanduser().exists():
        return
    ref = parse_hub_id(model)
    if ref is not None:
        resolve_hub(ref)
