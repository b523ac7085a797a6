"""Timing shared by the micro-benchmarks here (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.kernels.cpu import cpu_flags


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


def cpu_summary() -> dict[str, Any]:
    """The CPU kind a figure ran on, its vector flags and core count (every figure names it)."""
    flags = cpu_flags()
    vector = sorted(f for f in flags if f.startswith("avx512") or f in ("avx2", "fma"))
    kind = ("AVX-512/BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
            else "AVX2-only" if "avx2" in flags else "no AVX2")
    return {"kind": kind, "flags": vector, "cores": os.cpu_count()}


def cold_bytes(floor: int) -> int:
    """Bytes that a benchmark's copies of its weights must add up to so that each call reads
    them from memory: at least `floor`, and twice the largest cache Linux reports (some hosts
    show a last-level cache of several hundred megabytes)."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            largest = max(largest, int(digits) * scale)
    return max(floor, 2 * largest)
