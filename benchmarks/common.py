"""Shared pieces of the benchmarks: the result type, a timer, thread pinning, sizes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    """A further table of a result, printed after the main one."""

    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)


@dataclass
class Result:
    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)  # optional extra tables, after the main one


def best_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Best of `repeats` wall-clock timings after `warmup` untimed calls (less noise than a mean)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def sync() -> None:
    """Wait for the GPU (no-op on a CPU): a timed region must end when its kernels do."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TimedForward:
    """Times each forward of an HFChatBackend's decode loop while `on` (first = prefill, the
    rest = decode steps), by wrapping its `_forward`, which every step goes through."""

    def __init__(self, backend) -> None:
        self.calls: list[float] = []
        self.on = True
        self._forward = backend._forward
        backend._forward = self._timed

    def _timed(self, *args, **kwargs):
        if not self.on:
            return self._forward(*args, **kwargs)
        sync()
        t = time.perf_counter()
        out = self._forward(*args, **kwargs)
        sync()
        self.calls.append(time.perf_counter() - t)
        return out


SIZES = ("quick", "default", "full")  # run.py: --quick | (nothing) | --full


def unwritable(path: Path) -> str | None:
    """Why a run's output file cannot be written (checked before the run, which would lose its
    figures at the end), or None: a directory, or a place the file cannot be created."""
    if path.is_dir():
        return "is a directory: give a file name in it"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as err:
        return f"cannot write there ({err.strerror})"
    return None


def size_of(quick: bool, full: bool) -> str:
    """The size a module's `run(quick, full)` was asked for."""
    if quick and full:
        raise ValueError("--quick and --full exclude each other")
    return "quick" if quick else "full" if full else "default"


_DEFAULT_THREADS: list[int] = []  # the process's own count, before the first pin


def pin_threads() -> tuple[int, int]:
    """Pin torch's intra-op threads for the whole run on a CPU; returns (pinned, process default).

    BENCH_THREADS=N sets the count; the default is 1. With 2 OpenMP threads on a 2-core machine
    that other jobs also load, every parallel region waits at its barrier for a descheduled
    thread: measured on this project's 2-core CPU under a load average of ~6, SmolLM2-135M fp32
    took 6.4x as long for 16 greedy tokens at batch 1 (14.0 s vs 2.2 s) and 8.1x at batch 32 as
    with 1 thread. One thread keeps a benchmark's time and ratios stable on a shared machine;
    absolute speeds are then per core. On CUDA the count is left as it is. run.py pins before a
    benchmark starts; calling it again changes nothing.
    """
    import torch

    from driftlab.errors import DriftlabError

    if not _DEFAULT_THREADS:
        _DEFAULT_THREADS.append(torch.get_num_threads())
    default = _DEFAULT_THREADS[0]
    if torch.cuda.is_available():
        return torch.get_num_threads(), default
    text = os.environ.get("BENCH_THREADS", "1")
    if not text.isdigit() or int(text) < 1:
        raise DriftlabError(f"BENCH_THREADS={text!r}: expected a positive whole number of threads.",
                            hint="Leave it unset for 1 thread (stable on a shared machine), or e.g. BENCH_THREADS=2.")
    torch.set_num_threads(int(text))
    return int(text), default


def selfchat_config(**fields):
    """A SelfChatConfig whose probes decode with the turn's token budget, in the same call as the
    agent's turn (what the self-chat benchmarks measure), on any driftlab that has the option."""
    from driftlab.protocol.selfchat import SelfChatConfig

    if "probe_tokens" in SelfChatConfig.model_fields:
        fields.setdefault("probe_tokens", "turn")
    return SelfChatConfig(**fields)
