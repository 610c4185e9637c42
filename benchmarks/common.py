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
