"""Projections and embeddings over GGUF-quantized weights, run without dequantizing them.

The loader hands a layer GGUF blocks (`QuantizedWeight`s: one, or several for a fused qkv or
gate/up): the file's own, rewritten from a format the kernel does not execute
(REPACKED_TYPES), or quantized from float at load (`quantization=int8|int4`).
`QuantizedLinear.prepare` packs each part once into the kernel's panels (16 output rows
interleaved, about the blocks' bytes), and `apply` calls the C++ kernel
(radixserve/kernels/csrc/gguf/gguf_matmul.cpp): activations are quantized per block to int8 as
llama.cpp does, dot products are exact integer sums, and the block scales are applied in one
fixed order, so a row's result does not depend on the batch it runs in and cache on == cache
off holds exactly. Layers whose weights are float keep the dense method this one wraps.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from radixserve.kernels import PanelArena, gguf_ops
from radixserve.layers.linear import Linear, LinearMethod, NativeProjection
from radixserve.layers.quantized_weight import (
    EXECUTED_TYPES,
    PackedParts,
    QuantizedWeight,
    required_gguf_ops,
)


class QuantizedLinear(LinearMethod):
    """Runs layers holding quantized blocks on the GGUF kernel, the rest on `dense`."""

    name: ClassVar[str] = "gguf"

    def __init__(self, dense: LinearMethod, max_path: int | None = None) -> None:
        self.ops = ops = required_gguf_ops()
        self.dense = dense
        # The most vectorised kernel path allowed (tests pin the portable one, 0).
        self.max_path = ops.path() if max_path is None else max_path
        # The model's panels, side by side in the order the layers are prepared (a decode
        # step's order) and sharing huge pages.
        self.arena = PanelArena()

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return f"a CPU and float32 or bfloat16 (this engine runs {dtype} on {device})"
        if gguf_ops() is None:
            return "the GGUF kernels, which could not be built here (see the log)"
        return None

    def describe(self) -> str:
        return (f"gguf ({', '.join(EXECUTED_TYPES)}) on the {self.ops.path_name(self.max_path)} "
                f"path, float matrices {self.dense.describe()}")

    def prepare(self, layer: Linear) -> None:
        if layer.packed is not None:  # already runs on shared panels
            return
        if layer.quantized is None:
            self.dense.prepare(layer)
            return
        parts = layer.quantized
        layer.packed = PackedParts([p.pack(self.ops, self.arena) for p in parts],
                                   [p.type_id for p in parts], [p.rows for p in parts])
        layer.quantized = None  # the file's blocks are no longer needed

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        packed = layer.packed
        if packed is None:
            return self.dense.apply(layer, x)
        return self.ops.linear(x.contiguous(), packed.panels, packed.types, packed.rows,
                               layer.bias, self.max_path)

    def native(self, layer: Linear) -> NativeProjection | None:
        packed = layer.packed
        if packed is None:
            return self.dense.native(layer)
        return NativeProjection(NativeProjection.GGUF_PARTS, layer.out_features,
                                panels=packed.panels, types=packed.types, rows=packed.rows,
                                bias=layer.bias, max_path=self.max_path)


class QuantizedEmbedding(nn.Module):
    """A token embedding table kept in the file's blocks; looked-up rows are decoded exactly
    as `gguf.quants.dequantize` would decode them."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.dtype = required_gguf_ops(), dtype
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols
        self.packed = PackedParts([weight.pack(self.ops)], [weight.type_id], [weight.rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.dequantize_rows(self.packed.panels[0], self.packed.types[0],
                                        self.num_embeddings, self.embedding_dim, ids, self.dtype)
