"""Projections and the methods that run them.

A model's projection is a `Linear` layer holding its weight; how `y = x W^T + b` is computed
is its `LinearMethod`'s business, so a layer never knows whether it runs on oneDNN, on our
skinny bfloat16 kernel, on our float32 kernel over packed panels, widened to float32 or on quantized weights.
A method may repack the weights once after loading (`prepare`) and decides per call, from the
input's shape, which path to take.

Adding a method: subclass `LinearMethod` (its `name`, `unavailable(device, dtype)`,
`apply(layer, x)`, optionally `prepare(layer)`), then add it to `LINEAR_METHODS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import SKINNY_MAX_ROWS, PanelArena, float_panel_ops, skinny_matmul_op
from radixserve.kernels.cpu import has_fast_bf16
from radixserve.layers.quantized_weight import PackedParts, QuantizedWeight


@dataclass(frozen=True)
class NativeProjection:
    """How C++ runs a layer's projection with the arithmetic its method's `apply` has (for the
    decoder stack, radixserve/kernels/csrc/decoder_stack/decoder_stack.cpp): `kind` GGUF_PARTS is gguf_linear's
    arguments (`panels`, `types`, `rows`), FLOAT_PANELS float_panels_linear's (one tensor of
    panels, a float32 bias)."""

    GGUF_PARTS: ClassVar[int] = 0  # the C++ side's Kind values
    FLOAT_PANELS: ClassVar[int] = 1

    kind: int
    out_features: int
    panels: list[torch.Tensor] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    bias: torch.Tensor | None = None
    max_path: int = 0


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

    def native(self, layer: Linear) -> NativeProjection | None:
        """`apply`'s arithmetic for C++ to run, whatever the rows; None where only `apply`
        can run this layer (the model then keeps its Python layers)."""
        return None


class DenseLinear(LinearMethod):
    """nn.Linear's arithmetic (oneDNN on CPU, cuBLAS on CUDA)."""

    name = "torch"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class SkinnyLinear(DenseLinear):
    """Our C++ bfloat16 matmul for inputs of at most SKINNY_MAX_ROWS rows (decode steps):
    it streams each weight matrix once, where oneDNN reads the weights well under the memory
    bandwidth at these row counts (benchmarks/bench_skinny_matmul.py measures both). Larger
    inputs, and shapes the kernel does not take (in_features % 32, out_features % 16), go to
    oneDNN."""

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
        # No rows (the last layer of a prompt chunk that samples nothing) go to oneDNN.
        if (1 <= x.shape[0] <= SKINNY_MAX_ROWS and layer.in_features % 32 == 0
                and layer.out_features % 16 == 0):
            return self.op(x.contiguous(), layer.weight, layer.bias)
        return super().apply(layer, x)


class PanelFloatLinear(LinearMethod):
    """Our C++ float matmul (kernels/csrc/float_panels/) for every row count, on CPUs with AVX2+FMA+F16C
    or AVX-512F: where bfloat16 dot products are missing (AVX2-only machines), oneDNN emulates
    half-precision matmuls and runs float32 ones well under the memory bandwidth at few rows.
    This kernel streams each weight once and widens it in registers, computing in float32; it
    keeps up with oneDNN float32 at prefill sizes too, so it runs every row count
    (benchmarks/bench_skinny_matmul.py compares them by row count).

    `prepare` repacks each weight into panels of 16 output rows, held at the narrowest width
    that keeps every value: bfloat16 for a BF16 file, float16 for an F16 one (2 bytes per
    parameter, nothing lost), float32 otherwise (F32 files and GGUF blocks dequantized at load:
    rounding the default model's to bfloat16 moved its logits by up to 0.14 and changed the
    greedy text of 4 prompts in 8 within 48 tokens; float16, 0.04 and none). Each output is one
    chain of float32 FMAs, so a row's result is bitwise the same whatever the batch, thread
    count or vector path: cache on == cache off holds exactly through the projections. Inputs
    in bfloat16 or float16 are widened and the results rounded once."""

    name = "float-panels"

    def __init__(self, max_path: int | None = None) -> None:
        ops = float_panel_ops()
        if ops is None:
            raise ValueError("the C++ kernels could not be built here")
        self.ops = ops
        # The most vectorised path allowed (an index of path_names("float_panels"); tests pin each one).
        self.max_path = ops.path() if max_path is None else max_path
        self.held: dict[torch.dtype, int] = {}  # matrices prepared, by the dtype kept
        self.arena = PanelArena()  # the model's panels side by side, on huge pages

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"a CPU and a float dtype (this engine runs {dtype} on {device})"
        ops = float_panel_ops()
        if ops is None:
            return "the C++ kernels, which could not be built here (see the log)"
        if ops.path() == 0:
            return "a CPU with AVX2, FMA and F16C or with AVX-512 (this one has neither)"
        return None

    def describe(self) -> str:
        held = ", ".join(f"{count} {str(dtype).removeprefix('torch.')}"
                         for dtype, count in self.held.items())
        return f"{self.name} on the {self.ops.path_name(self.max_path)} path (weights: {held})"

    def prepare(self, layer: Linear) -> None:
        if layer.weight is None:  # quantized blocks, another method's business
            return
        weight = layer.weight.detach()
        dtype = narrowest_exact_dtype(weight)
        layer.panels = nn.Parameter(self.ops.pack(weight, dtype, self.arena),
                                    requires_grad=False)
        layer.weight = None
        self.held[dtype] = self.held.get(dtype, 0) + 1

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.panels is None:
            raise RuntimeError(f"{self.name}: prepare(layer) was not called after loading")
        bias = None if layer.bias is None else layer.bias.float()
        rows = x.reshape(-1, layer.in_features).float().contiguous()
        out = self.ops.linear(rows, layer.panels, layer.out_features, bias, self.max_path)
        return out.reshape(*x.shape[:-1], layer.out_features).to(x.dtype)

    def native(self, layer: Linear) -> NativeProjection | None:
        if layer.panels is None:
            return None
        bias = None if layer.bias is None else layer.bias.float()
        return NativeProjection(NativeProjection.FLOAT_PANELS, layer.out_features,
                                panels=[layer.panels], bias=bias,
                                max_path=self.max_path)


def narrowest_exact_dtype(weight: torch.Tensor) -> torch.dtype:
    """bfloat16 or float16 where every value of `weight` survives the round trip (checked a
    slice of rows at a time, so the copies stay small), else `weight`'s own dtype."""
    rows = max(1, (1 << 20) // max(1, weight.shape[-1]))
    for dtype in (torch.bfloat16, torch.float16):
        if dtype == weight.dtype or all(
                torch.equal(part.to(dtype).to(weight.dtype), part) for part in weight.split(rows)):
            return dtype
    return weight.dtype


class PanelEmbedding(nn.Module):
    """The token embedding table of a model whose LM head shares it (tied weights), read from
    the head's panels once PanelFloatLinear has repacked them: the table is then held once,
    at the panels' width, instead of beside them. Row t is column t % 16 of panel t // 16,
    bitwise the table's row (panels keep every value)."""

    def __init__(self, head: Linear, dtype: torch.dtype) -> None:
        super().__init__()
        if head.panels is None:
            raise ValueError("the LM head holds no panels to read the table from")
        self.panels = head.panels  # the head's own Parameter, not a copy
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        panel = self.panels.shape[-1]
        return self.panels[ids // panel, :, ids % panel].to(self.dtype)


class WideningLinear(DenseLinear):
    """Half-precision weights on a CPU without native bfloat16/float16 dot products (AVX2-only
    machines). There oneDNN emulates half-precision matmuls: fine for a few rows, which are
    bound by reading the weights (half the bytes of float32), but far slower than float32 for
    a long prefill. From `min_rows` rows up this method widens the weights to float32 for the
    call and rounds the result back: the same products, accumulated in float32 as the
    emulation does, at float32 speed (benchmarks/bench_linear_methods.py measures the
    crossing)."""

    name = "widen"
    # Below this the emulated matmul wins: widening costs one pass over the weights, which
    # only enough rows pay back (the crossing: benchmarks/bench_linear_methods.py).
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
LINEAR_METHODS: list[type[LinearMethod]] = [SkinnyLinear, PanelFloatLinear, WideningLinear,
                                            DenseLinear]


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
        # The weight repacked by a float method's `prepare` (PanelFloatLinear), in place of
        # `weight`.
        self.panels: nn.Parameter | None
        self.register_parameter("panels", None)
        self.method = method
        # Quantized GGUF blocks in place of `weight`: the file's parts until the method's
        # `prepare` repacks them, then the packed parts (see radixserve/layers/quantized.py).
        self.quantized: list[QuantizedWeight] | None = None
        self.packed: PackedParts | None = None

    def load_quantized(self, parts: list[QuantizedWeight]) -> None:
        """Takes the file's blocks (one matrix, or a fused projection's parts in output
        order) in place of a float weight."""
        rows = sum(p.rows for p in parts)
        if rows != self.out_features or any(p.cols != self.in_features for p in parts):
            raise ValueError(f"quantized parts of {rows} rows x {parts[0].cols} do not fit a "
                             f"{self.out_features}x{self.in_features} projection")
        self.weight = None
        # Each part stays on its own: the kernel takes a list of parts and writes each at its
        # column offset, so nothing is concatenated, and row orders apply as panels gather.
        self.quantized = list(parts)
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
