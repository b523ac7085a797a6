"""The bfloat16 matmul of a few rows (csrc/bf16_matmul/) on CPUs with AVX512-BF16: a decode
step's projections, where oneDNN's setup costs more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.kernels.build import load_library

SKINNY_MAX_ROWS = 48  # up to here it beats oneDNN (benchmarks/bench_skinny_matmul.py)


def skinny_matmul_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.radixserve.skinny_matmul` where the CPU has AVX512-BF16, else None.

    Signature: (x [M <= SKINNY_MAX_ROWS, K], weight [N, K], bias [N] or None) -> [M, N], all
    bfloat16, K a multiple of 32 and N of 16; see csrc/bf16_matmul/skinny_matmul.cpp.
    """
    if not load_library() or not torch.ops.radixserve.bf16_matmul_runs():
        return None
    return torch.ops.radixserve.skinny_matmul
