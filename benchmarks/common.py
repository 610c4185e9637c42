"""Shared pieces of the benchmarks: the result type and a timer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


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
