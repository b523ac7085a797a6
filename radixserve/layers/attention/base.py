"""The attention backend interface: plan once per step, run once per layer.

The runner describes a step as sequence spans (which rows of the flattened batch belong to
which request, where they sit in its context, and the request's KV slot table). Each backend
turns that into its own metadata once per step (`plan`); every layer then calls `forward` with
its q, k, v and its slice of the KV pool. A step's decode rows and its prefill chunks go to two
backends, one of each role, combined by `StepAttention`, which is all the model ever sees.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

import numpy as np
import torch

from radixserve.kernels import kv_write_op
from radixserve.kernels.cpu import has_fast_bf16


class SlotTable(Protocol):
    """A request's KV slot of each position (the engine's Request is one)."""

    @property
    def slots(self) -> list[int]: ...

    def slot_array(self, end: int, start: int = 0) -> np.ndarray:
        """slots[start:end] as int32."""
        ...


@dataclass(frozen=True)
class SequenceSpan:
    """One request's rows in a step: rows [start, start + length) hold its positions
    [first, first + length); it attends to positions [0, first + length) (minus a window)."""

    table: SlotTable
    start: int
    length: int
    first: int

    @property
    def context(self) -> int:
        return self.first + self.length


@dataclass(frozen=True)
class StepLayout:
    """What attention needs to know about a step. Decode spans (one row each) come first, in
    rows [0, len(decodes)); prefill chunks follow."""

    decodes: list[SequenceSpan]
    prefills: list[SequenceSpan]
    write_slots: torch.Tensor  # [T] int64: the KV slot each row's new K/V goes to


@dataclass(frozen=True)
class AttentionEnv:
    """What a backend is built for: the model's attention shape, the pool, the device."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None  # sliding window in tokens, None for full attention
    num_slots: int  # KV pool size
    device: torch.device
    dtype: torch.dtype
    # The CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); without it half-precision
    # matmuls are emulated, several times slower than float32.
    native_bf16: bool = field(default_factory=has_fast_bf16)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)


@dataclass(frozen=True)
class LayerKV:
    """One layer's slice of the KV pool: head-major `[num_kv_heads, num_slots, head_dim]`."""

    k: torch.Tensor
    v: torch.Tensor

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores rows' keys and values ([T, Hkv, D]) at `slots` (int64)."""
        if (self.k.is_cpu and k.dtype == v.dtype == self.k.dtype and k.stride(-1) == 1
                and v.stride(-1) == 1 and (write := kv_write_op()) is not None):
            write(self.k, self.v, slots, k, v)  # one call for both, read in place
            return
        self.k.index_copy_(1, slots, k.transpose(0, 1))
        self.v.index_copy_(1, slots, v.transpose(0, 1))


class AttentionBackend(ABC):
    """Attention for one role's rows of a step: the decode rows, or the prefill chunks.

    A backend holds no per-request state: everything about a step is in the metadata its
    `plan` returns, which lives for that step only.
    """

    name: ClassVar[str]
    role: ClassVar[Literal["decode", "prefill"]]

    def __init__(self, env: AttentionEnv) -> None:
        self.env = env

    @classmethod
    def unavailable(cls, env: AttentionEnv) -> str | None:
        """Why this backend cannot run for `env` (None: it can)."""
        return None

    def describe(self) -> str:
        """The backend's name for the start-up log and the disk tier's fingerprint, with
        whatever decides its arithmetic here."""
        return self.name

    @abstractmethod
    def plan(self, spans: list[SequenceSpan]) -> object:
        """Once per step: this backend's metadata for `spans` (non-empty)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                metadata: object, out: torch.Tensor) -> None:
        """Once per layer: writes attention of its spans' rows into `out` ([T, H, D]).

        q is [T, H, D] and k, v are [T, Hkv, D] for the whole step; the step's new K/V are
        already in `cache`."""

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                   metadata: object) -> torch.Tensor | None:
        """Where this backend's rows are all of the step's: their attention [T, H, D] as a
        tensor of its own, sparing the step's output buffer and the copy into it (a decode
        step makes both, per layer, between matmuls that leave the caches cold). None: use
        `forward`."""
        return None


@dataclass(frozen=True)
class StepPlan:
    """A step's attention metadata: where new K/V go, and each role's plan (None: no rows)."""

    write_slots: torch.Tensor
    decode: object | None
    prefill: object | None


@dataclass(frozen=True)
class StepAttention:
    """The decode backend and the prefill backend an engine runs with."""

    decode: AttentionBackend
    prefill: AttentionBackend

    @property
    def name(self) -> str:
        return f"decode {self.decode.describe()}, prefill {self.prefill.describe()}"

    def plan(self, layout: StepLayout) -> StepPlan:
        return StepPlan(
            write_slots=layout.write_slots,
            decode=self.decode.plan(layout.decodes) if layout.decodes else None,
            prefill=self.prefill.plan(layout.prefills) if layout.prefills else None,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                plan: StepPlan) -> torch.Tensor:
        """Stores the rows' K/V in the pool, then attends; returns [T, H, D]."""
        cache.write(plan.write_slots, k, v)
        if (plan.decode is None) != (plan.prefill is None):  # one role has every row
            backend, metadata = ((self.decode, plan.decode) if plan.decode is not None
                                 else (self.prefill, plan.prefill))
            whole = backend.attend_all(q, k, v, cache, metadata)
            if whole is not None:
                return whole
        out = torch.empty_like(q)
        if plan.decode is not None:
            self.decode.forward(q, k, v, cache, plan.decode, out)
        if plan.prefill is not None:
            self.prefill.forward(q, k, v, cache, plan.prefill, out)
        return out
