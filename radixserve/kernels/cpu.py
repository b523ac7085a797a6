"""What this CPU can do fast, read once from the kernel's view (/proc/cpuinfo flags).

The engine asks it which dtype to default to; the kernels' own code paths are picked inside
the C++ library by its one probe of the same features (csrc/common/cpu_features.cpp; `kernels.cpu_features`
lists what it found).
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_fast_bf16() -> bool:
    """Native bfloat16 dot products (AVX512-BF16 or AMX): there bfloat16 matmuls beat float32
    (benchmarks/bench_linear_methods.py); elsewhere they are emulated and slower."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe() -> str:
    """The vector extensions that decide which kernel paths run, for logs and benchmarks."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return " ".join(flag for flag in wanted if flag in cpu_flags()) or "none of avx2/avx512"
