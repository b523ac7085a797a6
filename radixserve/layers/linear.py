"""Projections and the methods that run them.

A model's projection is a `Linear` layer holding its weight; how `y = x W^T + b` is computed
is its `LinearMethod`'s business, so a layer never knows whether it runs on oneDNN, on our
skinny bfloat16 kernel, widened to float32 or (next) on quantized weights. A method may
repack the weights once after loading (`prepare`) and decides per call, from the input's
shape, which path to take.

Adding a method: subclass `LinearMethod` (its `name`, `unavailable(device, dtype)`,
`apply(layer, x)`, optionally `prepare(layer)`), then add it to `LINEAR_METHODS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import SKINNY_MAX_ROWS, skinny_matmul_op
from radixserve.kernels.cpu import has_fast_bf16

if TYPE_CHECKING:
    from radixserve.layers.quantized import PackedParts, QuantizedWeight


class LinearMethod(ABC):
    name: ClassVar[str]

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this method cannot run here (None: it can)."""
        return None

    def describe(self) -> str:
        """For the start-up log."""
        return self.name

    def prepare(self, layer: Linear) -> None:  # noqa: B027 (a hook most methods leave alone)
        """Once, after the layer's weights are loaded and cast (repacking goes here)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features]."""


class DenseLinear(LinearMethod):
    """nn.Linear's arithmetic (oneDNN on CPU, cuBLAS on CUDA)."""

    name = "torch"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class SkinnyLinear(DenseLinear):
    """Our C++ bfloat16 matmul for inputs of at most SKINNY_MAX_ROWS rows (decode steps):
    it streams each weight matrix once, where oneDNN reads the weights at well under half the
    memory bandwidth at these row counts. Larger inputs, and shapes the kernel does not take
    (in_features % 32, out_features % 16), go to oneDNN."""

    name = "kernel"

    def __init__(self, op: Callable[..., torch.Tensor] | None = None) -> None:
        found = op or skinny_matmul_op()
        if found is None:
            raise ValueError("the skinny matmul kernel could not be built here")
        self.op: Callable[..., torch.Tensor] = found

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu" or dtype != torch.bfloat16 or skinny_matmul_op() is None:
            return (f"a CPU with AVX512-BF16 and bfloat16 (this engine runs "
                    f"{str(dtype).removeprefix('torch.')} on {device})")
        return None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if (x.shape[0] <= SKINNY_MAX_ROWS and layer.in_features % 32 == 0
                and layer.out_features % 16 == 0):
            return self.op(x.contiguous(), layer.weight, layer.bias)
        return super().apply(layer, x)


class WideningLinear(DenseLinear):
    """Half-precision weights on a CPU without native bfloat16/float16 dot products (AVX2-only
    machines). There oneDNN emulates half-precision matmuls: fine for a few rows, which are
    bound by reading the weights (half the bytes of float32), but 7x slower than float32 for
    a 1,000-row prefill. From `min_rows` rows up this method widens the weights to float32 for
    the call and rounds the result back: the same products, accumulated in float32 as the
    emulation does, at float32 speed."""

    name = "widen"
    # Measured on an AVX2 EPYC, SmolLM2's shapes: the emulated matmul wins up to 8 rows (the
    # widening costs one pass over the weights), float32 from 16 rows (0.49 vs 1.11 ms).
    min_rows = 16

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
            return f"a CPU and bfloat16 or float16 (this engine runs {dtype} on {device})"
        if has_fast_bf16():
            return "a CPU without native bfloat16 dot products (this one has them)"
        return None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            return super().apply(layer, x)
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(x.float(), layer.weight.float(), bias).to(x.dtype)


# In preference order: `auto` takes the first available.
LINEAR_METHODS: list[type[LinearMethod]] = [SkinnyLinear, WideningLinear, DenseLinear]


def choose_linear_method(name: str, device: torch.device, dtype: torch.dtype) -> LinearMethod:
    """The method for setting `matmul_backend`: a named one, or with "auto" the first that
    runs here; a clear ValueError where the named one cannot."""
    for method in LINEAR_METHODS:
        if name not in ("auto", method.name):
            continue
        reason = method.unavailable(device, dtype)
        if reason is None:
            return method()
        if name != "auto":
            raise ValueError(f"matmul_backend={name!r} needs {reason}")
    if name == "auto":
        return DenseLinear()
    raise ValueError(f"unknown matmul_backend {name!r}; known: auto, "
                     f"{', '.join(m.name for m in LINEAR_METHODS)}")


class Linear(nn.Module):
    """A projection: weight [out, in] and optional bias, computed by `method`.

    A layer loaded from quantized blocks holds them in `quantized` instead of a float weight
    until its method's `prepare` repacks them (see radixserve/layers/quantized.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 method: LinearMethod) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias: nn.Parameter | None
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
        self.method = method
        # Quantized GGUF blocks in place of `weight`: the file's parts until the method's
        # `prepare` repacks them, then the packed parts (see radixserve/layers/quantized.py).
        self.quantized: list[QuantizedWeight] | None = None
        self.packed: PackedParts | None = None

    def load_quantized(self, parts: list[QuantizedWeight]) -> None:
        """Takes the file's blocks (one matrix, or a fused projection's parts in output
        order) in place of a float weight."""
        from radixserve.layers.quantized import merge_parts

        rows = sum(p.rows for p in parts)
        if rows != self.out_features or any(p.cols != self.in_features for p in parts):
            raise ValueError(f"quantized parts of {rows} rows x {parts[0].cols} do not fit a "
                             f"{self.out_features}x{self.in_features} projection")
        self.weight = None
        self.quantized = merge_parts(parts)
        # Repack now, so that only one layer's copies of the file's blocks exist at a time.
        self.method.prepare(self)

    def share_packed(self, packed: PackedParts) -> None:
        """Runs on another module's packed blocks (a tied LM head on its embedding table)."""
        if sum(packed.rows) != self.out_features:
            raise ValueError(f"a table of {sum(packed.rows)} rows cannot serve a projection "
                             f"to {self.out_features}")
        self.weight = None
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)
