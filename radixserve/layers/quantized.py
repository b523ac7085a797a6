"""Projections and embeddings over GGUF-quantized weights, run without dequantizing them.

The loader hands a layer the file's own blocks (`QuantizedWeight`s: one, or several for a
fused qkv or gate/up). `QuantizedLinear.prepare` repacks each once into the kernel's panels
(16 output rows interleaved, about the file's bytes), and `apply` calls the C++ kernel
(radixserve/kernels/gguf_matmul.cpp): activations are quantized per block to int8 as
llama.cpp does, dot products are exact integer sums, and the block scales are applied in one
fixed order, so a row's result does not depend on the batch it runs in and cache on == cache
off holds exactly. Layers whose file tensor is float keep the dense method this one wraps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from radixserve.kernels import gguf_ops
from radixserve.layers.linear import Linear, LinearMethod

# GGUF formats the kernel executes, by name: their GGML type ids.
EXECUTED_TYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# Formats the loader rewrites, without loss, into an executed one (more bytes: Q5_0 takes
# 34 bytes per 32 weights as Q8_0 instead of 22).
REPACKED_TYPES: dict[str, str] = {"Q5_0": "Q8_0"}


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix as the file stores it: `raw[r]` holds row r's blocks."""

    type_name: str
    rows: int  # output features
    cols: int  # input features
    raw: torch.Tensor  # uint8 [rows, bytes per row]

    @property
    def type_id(self) -> int:
        return EXECUTED_TYPES[self.type_name]

    def take_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Row i of the result is row order[i] of this one (blocks never span rows)."""
        return QuantizedWeight(self.type_name, self.rows, self.cols, self.raw[order])

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], decoded as `gguf.quants.dequantize` decodes it."""
        from radixserve.model.gguf_file import GGML_TYPES, GGUFTensor, dequantize

        flat = self.raw.contiguous().numpy().reshape(-1)
        return dequantize(GGUFTensor("", GGML_TYPES[self.type_id], (self.cols, self.rows), 0, flat))


def merge_parts(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Neighbouring parts of one format stacked into one matrix (one panel set, fewer part
    boundaries for the kernel); parts of different formats stay side by side."""
    merged = [parts[0]]
    for part in parts[1:]:
        last = merged[-1]
        if part.type_name == last.type_name and part.cols == last.cols:
            merged[-1] = QuantizedWeight(last.type_name, last.rows + part.rows, last.cols,
                                         torch.cat([last.raw, part.raw]))
        else:
            merged.append(part)
    return merged


@dataclass
class PackedParts:
    """A projection's weight as the kernel takes it: part i has `rows[i]` output rows in
    format `types[i]`, packed into `panels[i]`; outputs follow part order."""

    panels: list[torch.Tensor]
    types: list[int]
    rows: list[int]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.panels)


class QuantizedLinear(LinearMethod):
    """Runs layers holding quantized blocks on the GGUF kernel, the rest on `dense`."""

    name: ClassVar[str] = "gguf"

    def __init__(self, dense: LinearMethod, max_path: int | None = None) -> None:
        ops = gguf_ops()
        if ops is None:
            raise ValueError("the GGUF kernels could not be built here")
        self.ops = ops
        self.dense = dense
        # The most vectorised kernel path allowed (tests pin the portable one, 0).
        self.max_path = ops.path() if max_path is None else max_path

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
        layer.packed = PackedParts([self.ops.pack(p.raw, p.type_id) for p in parts],
                                   [p.type_id for p in parts], [p.rows for p in parts])
        layer.quantized = None  # the file's blocks are no longer needed

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        packed = layer.packed
        if packed is None:
            return self.dense.apply(layer, x)
        return self.ops.linear(x.contiguous(), packed.panels, packed.types, packed.rows,
                               layer.bias, self.max_path)


class QuantizedEmbedding(nn.Module):
    """A token embedding table kept in the file's blocks; looked-up rows are decoded exactly
    as `gguf.quants.dequantize` would decode them."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        ops = gguf_ops()
        if ops is None:
            raise ValueError("the GGUF kernels could not be built here")
        self.ops, self.dtype = ops, dtype
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols
        self.packed = PackedParts([ops.pack(weight.raw, weight.type_id)], [weight.type_id],
                                  [weight.rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.dequantize_rows(self.packed.panels[0], self.packed.types[0],
                                        self.num_embeddings, self.embedding_dim, ids, self.dtype)
