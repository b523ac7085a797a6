"""Timing shared by the micro-benchmarks here (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_ms(fn: Callable[[], object], repeat: int, warmup: int = 3, rounds: int = 3) -> float:
    """Milliseconds per call: the best of `rounds` timings of `repeat` calls, after warm-up
    (the best, not the mean: on a shared machine slow spells only ever add time)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat * 1e3)
    return best
