"""Attention by our C++ kernel (radixserve/kernels/csrc/attention/attention.cpp), which reads keys and
values where they lie in the paged pool: no gather, no padding, no mask. One backend per role,
one kernel: decode rows and prefill rows run the same arithmetic, row by row.

Why prefill through it too: a row's result then depends only on its query and its context's
K/V, never on how the rows were batched, chunked or cached. A prompt position computed in a
prefill chunk, in a later chunk, or as a decode step (the reply a later turn resends) gets
the same bits, so the K/V it leaves in the pool, and every token after it, are the same with
the prefix cache on or off. PyTorch's SDPA cannot promise that (its blocking follows the
chunk), and with int8-quantized activations (the GGUF kernels) a last-bit difference can flip
a rounding and grow. Its speed against SDPA: benchmarks/bench_decode_attention.py.

CPU only, float32 or bfloat16; the kernel picks its vector path (portable, AVX2, AVX-512,
AVX512-BF16, AMX-BF16 tiles) from the CPU, the dtype and the shape at run time; the start-up
log names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from radixserve.kernels import attention_path_for, paged_attention_op, path_names
from radixserve.layers.attention.base import (
    AttentionBackend,
    AttentionEnv,
    LayerKV,
    SequenceSpan,
    StepAttention,
    StepPlan,
)


@dataclass(frozen=True)
class PagedRows:
    """Rows [first_row, first_row + rows) of the step; row r of them attends to
    slots[begins[r] : begins[r] + lengths[r]], in position order (a sliding window applied)."""

    first_row: int
    rows: int
    slots: torch.Tensor  # int32
    begins: torch.Tensor  # int64 [rows]
    lengths: torch.Tensor  # int64 [rows]


class PagedKernel(AttentionBackend):
    """Both roles' shared part: the kernel, its path cap, the plan."""

    role: ClassVar[Literal["decode", "prefill"]]

    def __init__(self, env: AttentionEnv) -> None:
        super().__init__(env)
        op = paged_attention_op()
        if op is None:
            raise ValueError("the attention kernel could not be built here")
        self.op: Callable[..., torch.Tensor] = op
        # Most vectorised path allowed (an index of path_names("attention")); the kernel also stops at
        # what the CPU has. Tests lower it to check each path.
        self.max_path = len(path_names("attention")) - 1

    @classmethod
    def unavailable(cls, env: AttentionEnv) -> str | None:
        if env.device.type != "cpu" or env.dtype not in (torch.float32, torch.bfloat16):
            return (f"a CPU device and float32 or bfloat16 (this engine runs "
                    f"{str(env.dtype).removeprefix('torch.')} on {env.device})")
        if paged_attention_op() is None:
            return "a C++ compiler to build the kernel"
        return None

    def describe(self) -> str:
        env = self.env
        path = attention_path_for(env.dtype, env.num_heads, env.num_kv_heads, env.head_dim,
                                  self.max_path)
        return f"{self.name} ({path_names('attention')[path]})"

    def plan(self, spans: list[SequenceSpan], window: int | None) -> PagedRows:
        tables: list[np.ndarray] = []
        begins: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        offset = rows = 0
        for span in spans:
            assert span.start == spans[0].start + rows, "a role's rows are contiguous, in order"
            rows += span.length
            ends = np.arange(span.first + 1, span.context + 1, dtype=np.int64)
            lows = np.maximum(ends - window, 0) if window else np.zeros_like(ends)
            table = span.table.slot_array(span.context, int(lows[0]))
            tables.append(table)
            begins.append(offset + lows - lows[0])
            lengths.append(ends - lows)
            offset += len(table)
        return PagedRows(
            first_row=spans[0].start,
            rows=rows,
            slots=torch.from_numpy(np.concatenate(tables)),
            begins=torch.from_numpy(np.concatenate(begins)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                metadata: object, out: torch.Tensor, scale: float,
                sinks: torch.Tensor | None) -> None:
        assert isinstance(metadata, PagedRows)
        rows = slice(metadata.first_row, metadata.first_row + metadata.rows)
        out[rows] = self._attend(q[rows], cache, metadata, scale, sinks)

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                   metadata: object, scale: float,
                   sinks: torch.Tensor | None) -> torch.Tensor | None:
        assert isinstance(metadata, PagedRows)
        if metadata.first_row != 0 or metadata.rows != q.shape[0]:
            return None
        return self._attend(q, cache, metadata, scale, sinks)

    def _attend(self, q: torch.Tensor, cache: LayerKV, metadata: PagedRows, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        return self.op(q.contiguous(), cache.k, cache.v, metadata.slots, metadata.begins,
                       metadata.lengths, scale, self.max_path, sinks)


class PagedDecodeKernel(PagedKernel):
    name = "kernel"
    role = "decode"


class PagedPrefillKernel(PagedKernel):
    name = "kernel"
    role = "prefill"


def whole_step_rows(attention: StepAttention, plan: StepPlan) -> tuple[PagedRows, int] | None:
    """Every row of a step as one call of the kernel at the model's default window, and the
    path cap to run it at, where each role that has rows runs on the kernel at one cap; None
    otherwise. A row's result does not depend on the rows beside it, so this is the roles'
    arithmetic, bit for bit."""
    parts = [(backend, rows) for backend, rows in ((attention.decode, plan.decode),
                                                   (attention.prefill, plan.prefill))
             if rows is not None]
    kernels = [backend for backend, _ in parts if isinstance(backend, PagedKernel)]
    if not parts or len(kernels) != len(parts) or len({k.max_path for k in kernels}) != 1:
        return None
    rows = [r for _, r in parts if isinstance(r, PagedRows)]
    assert len(rows) == len(parts), "a kernel's plan is PagedRows"
    if len(rows) == 1:
        return rows[0], kernels[0].max_path
    decode, prefill = rows
    assert decode.first_row == 0 and prefill.first_row == decode.rows
    return PagedRows(
        first_row=0,
        rows=decode.rows + prefill.rows,
        slots=torch.cat((decode.slots, prefill.slots)),
        begins=torch.cat((decode.begins, prefill.begins + decode.slots.numel())),
        lengths=torch.cat((decode.lengths, prefill.lengths)),
    ), kernels[0].max_path
