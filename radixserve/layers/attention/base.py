"""The attention backend interface: plan once per step, run once per layer.

The runner describes a step as sequence spans (which rows of the flattened batch belong to
which request, where they sit in its context, and the request's KV slot table). Each backend
turns that into its own metadata once per step and sliding window (`plan`); every layer then
calls `forward` with its q, k, v, its slice of the KV pool and how it attends
(`LayerAttention`: its window, scale and sinks). A step's decode rows and its prefill chunks
go to two backends, one of each role, combined by `StepAttention`, which is all the model ever
sees.
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
    # The same rows in the sliding-window layers' own slot space, where they have one
    # (radixserve/engine/window_kv.py); None: every layer reads the pool's one slot space.
    window_group: StepLayout | None = None


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, where models differ layer by layer (Gemma 3: five of six layers
    local; gpt-oss: alternate layers windowed, sinks everywhere).

    window: a sliding window in tokens (a row at position p attends to positions
    (p - window, p]); None: full attention. scale: the softmax scale; None: head_dim**-0.5.
    sinks: attention sinks, one learned logit per query head that joins the softmax's
    denominator and nothing else (gpt-oss), held as float32 [num_heads]; None: none.
    A layer that passes no LayerAttention gets the model's window (`AttentionEnv.window`),
    head_dim**-0.5 and no sinks.
    """

    window: int | None = None
    scale: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window is at least 1 token, not {self.window}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"the attention scale must be positive, not {self.scale}")
        if self.sinks is not None:
            if self.sinks.dim() != 1:
                raise ValueError("attention sinks are one logit per query head: [num_heads]")
            # The kernels read them as float32, contiguous; converting once here spares it
            # per step.
            object.__setattr__(self, "sinks", self.sinks.detach().float().contiguous())


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
    def plan(self, spans: list[SequenceSpan], window: int | None) -> object:
        """Once per step and window: this backend's metadata for `spans` (non-empty), each
        row attending to its last `window` positions (None: all of them)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                metadata: object, out: torch.Tensor, scale: float,
                sinks: torch.Tensor | None) -> None:
        """Once per layer: writes attention of its spans' rows into `out` ([T, H, D]).

        q is [T, H, D] and k, v are [T, Hkv, D] for the whole step; the step's new K/V are
        already in `cache`. scale and sinks as `LayerAttention`'s (sinks float32 [H])."""

    def attend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                   metadata: object, scale: float,
                   sinks: torch.Tensor | None) -> torch.Tensor | None:
        """Where this backend's rows are all of the step's: their attention [T, H, D] as a
        tensor of its own, sparing the step's output buffer and the copy into it (a decode
        step makes both, per layer, between matmuls that leave the caches cold). None: use
        `forward`."""
        return None


@dataclass(frozen=True)
class RolePlans:
    """Each role's metadata for one window (None: the role has no rows this step)."""

    decode: object | None
    prefill: object | None


@dataclass(frozen=True)
class StepPlan:
    """A step's attention metadata: where new K/V go, and each role's plan per sliding window.

    The model's default window (`window`) is planned with the step; another is planned the
    first time a layer asks for it, then serves every layer with that window (a model has one
    or two: Gemma 3's local and global layers)."""

    write_slots: torch.Tensor
    layout: StepLayout
    window: int | None
    by_window: dict[int | None, RolePlans] = field(compare=False, repr=False)
    # The plan of the sliding-window layers' own slot space, where they have one.
    window_group: StepPlan | None = field(default=None, compare=False, repr=False)

    @property
    def decode(self) -> object | None:
        return self.by_window[self.window].decode

    @property
    def prefill(self) -> object | None:
        return self.by_window[self.window].prefill


@dataclass(frozen=True)
class StepAttention:
    """The decode backend and the prefill backend an engine runs with; `window_group`, the
    same backends built for the sliding-window layers' own slot space, where it has one."""

    decode: AttentionBackend
    prefill: AttentionBackend
    window_group: StepAttention | None = None

    @property
    def name(self) -> str:
        return f"decode {self.decode.describe()}, prefill {self.prefill.describe()}"

    @property
    def env(self) -> AttentionEnv:
        return self.decode.env

    def plan(self, layout: StepLayout) -> StepPlan:
        window = self.env.window
        group = (self.window_group.plan(layout.window_group)
                 if self.window_group is not None and layout.window_group is not None else None)
        return StepPlan(write_slots=layout.write_slots, layout=layout, window=window,
                        by_window={window: self._roles(layout, window)}, window_group=group)

    def _roles(self, layout: StepLayout, window: int | None) -> RolePlans:
        return RolePlans(
            decode=self.decode.plan(layout.decodes, window) if layout.decodes else None,
            prefill=self.prefill.plan(layout.prefills, window) if layout.prefills else None,
        )

    def roles(self, plan: StepPlan, window: int | None) -> RolePlans:
        """The step's plans for `window`, made on first use."""
        roles = plan.by_window.get(window)
        if roles is None:
            roles = plan.by_window[window] = self._roles(plan.layout, window)
        return roles

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                plan: StepPlan, layer: LayerAttention | None = None) -> torch.Tensor:
        """Stores the rows' K/V in the pool, then attends as `layer` says (None: the model's
        window, head_dim**-0.5, no sinks); returns [T, H, D]. A windowed layer with a slot
        space of its own (`cache` is then that space's) goes to the window group."""
        if (plan.window_group is not None and layer is not None and layer.window is not None
                and self.window_group is not None):
            return self.window_group.forward(q, k, v, cache, plan.window_group, layer)
        cache.write(plan.write_slots, k, v)
        if layer is None:
            roles, scale, sinks = plan.by_window[plan.window], self.env.scale, None
        else:
            roles = self.roles(plan, layer.window)
            scale = self.env.scale if layer.scale is None else layer.scale
            sinks = layer.sinks
        if (roles.decode is None) != (roles.prefill is None):  # one role has every row
            backend, metadata = ((self.decode, roles.decode) if roles.decode is not None
                                 else (self.prefill, roles.prefill))
            whole = backend.attend_all(q, k, v, cache, metadata, scale, sinks)
            if whole is not None:
                return whole
        out = torch.empty_like(q)
        if roles.decode is not None:
            self.decode.forward(q, k, v, cache, roles.decode, out, scale, sinks)
        if roles.prefill is not None:
            self.prefill.forward(q, k, v, cache, roles.prefill, out, scale, sinks)
        return out
