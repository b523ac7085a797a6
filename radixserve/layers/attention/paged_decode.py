"""Decode attention by our C++ kernel (radixserve/kernels/decode_attention.cpp), which reads
keys and values where they lie in the paged pool: no gather, no padding, no mask.

CPU only, float32 or bfloat16; the kernel picks its vector path (portable, AVX-512,
AVX512-BF16) from the CPU at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.kernels import decode_attention_op
from radixserve.layers.attention.base import AttentionBackend, AttentionEnv, LayerKV, SequenceSpan


@dataclass(frozen=True)
class PagedDecodeMetadata:
    """Request b (row b) attends to slots[starts[b]:starts[b + 1]], in position order (a
    sliding window already applied)."""

    rows: int
    slots: torch.Tensor  # int32
    starts: torch.Tensor  # int64 [rows + 1]


class PagedDecodeKernel(AttentionBackend):
    name = "kernel"
    role = "decode"

    def __init__(self, env: AttentionEnv) -> None:
        super().__init__(env)
        op = decode_attention_op()
        if op is None:
            raise ValueError("the decode attention kernel could not be built here")
        self.op: Callable[..., torch.Tensor] = op
        # Most vectorised code path allowed: 0 portable C++, 1 AVX-512, 2 AVX-512 BF16 (the
        # kernel also stops at what the CPU has). Tests lower it to check each path.
        self.max_level = 2

    @classmethod
    def unavailable(cls, env: AttentionEnv) -> str | None:
        if env.device.type != "cpu" or env.dtype not in (torch.float32, torch.bfloat16):
            return (f"a CPU device and float32 or bfloat16 (this engine runs "
                    f"{str(env.dtype).removeprefix('torch.')} on {env.device})")
        if decode_attention_op() is None:
            return "a C++ compiler to build the kernel"
        return None

    def plan(self, spans: list[SequenceSpan]) -> PagedDecodeMetadata:
        window = self.env.window
        tables: list[np.ndarray] = []
        starts = [0]
        for span in spans:
            end = span.context
            first = max(0, end - window) if window else 0
            tables.append(span.table.slot_array(end, first))
            starts.append(starts[-1] + end - first)
        return PagedDecodeMetadata(
            rows=len(spans),
            slots=torch.from_numpy(np.concatenate(tables)),
            starts=torch.tensor(starts, dtype=torch.int64),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                metadata: object, out: torch.Tensor) -> None:
        assert isinstance(metadata, PagedDecodeMetadata)
        rows = metadata.rows
        out[:rows] = self.op(q[:rows].contiguous(), cache.k, cache.v, metadata.slots,
                             metadata.starts, self.env.scale, self.max_level)
