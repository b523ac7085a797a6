"""Projections and embeddings over GGUF-quantized weights, run without dequantizing them.

The loader hands a layer GGUF blocks (`QuantizedWeight`s: one, or several for a fused qkv or
gate/up): the file's own, rewritten from a format the kernel does not execute
(REPACKED_TYPES), or quantized from float at load (`quantization=int8|int4`).
`QuantizedLinear.prepare` packs each part once into the kernel's panels (16 output rows
interleaved, about the blocks' bytes), and `apply` calls the C++ kernel
(radixserve/kernels/gguf_matmul.cpp): activations are quantized per block to int8 as
llama.cpp does, dot products are exact integer sums, and the block scales are applied in one
fixed order, so a row's result does not depend on the batch it runs in and cache on == cache
off holds exactly. Layers whose weights are float keep the dense method this one wraps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from radixserve.kernels import GGUFOps, PanelArena, gguf_ops
from radixserve.layers.linear import Linear, LinearMethod, NativeProjection

# GGUF formats the kernel executes, by name: their GGML type ids.
EXECUTED_TYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# Formats the loader rewrites once, at load, into an executed one (radixserve/model/quantize.py),
# and what that costs. Error added: RMS of (rewritten - file's values) over the RMS of the
# weights the file was made from, on Gaussian, Student-t(4) and SmolLM2's weights (quantized
# with gguf-py for Q5_1, with a min/max quantizer of ours for Q5_K):
# - Q5_0 -> Q8_0: nothing lost (q = u - 16, same d); 34 bytes per 32 weights instead of 22.
# - Q5_1 -> Q8_0: x = d * u + m is an offset grid Q8_0 cannot hold, so each block's decoded
#   values are requantized: 0.53-0.73% added to the file's own 3.8-4.5%, whose total grows
#   1.0-1.3%; 34 bytes per 32 weights instead of 24.
# - Q5_K -> Q8_0: the same per sub-block of 32 (x = d * sc * u - dmin * m), 8 Q8_0 blocks per
#   Q5_K block: 0.54-0.73% added, total 1.0-1.3% larger; 272 bytes per 256 instead of 176.
#   (Q6_K would take 210, but rounds to 64 levels per 16 weights, about 4x coarser.)
# - Q3_K -> Q6_K: nothing lost (Q6_K's int8 scales hold Q3_K's 6-bit ones and its 6-bit
#   quants hold q in -4..3, over the same sub-blocks of 16); 210 bytes per 256 instead of 110.
REPACKED_TYPES: dict[str, str] = {"Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q5_K": "Q8_0", "Q3_K": "Q6_K"}


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix in GGUF blocks: row i is `raw[row_order[i]]` (or `raw[i]`), a row's
    blocks are contiguous and never span rows. `raw` may be a read-only view of the file."""

    type_name: str
    rows: int  # output features
    cols: int  # input features
    raw: torch.Tensor  # uint8 [rows, bytes per row]
    row_order: torch.Tensor | None = None  # int64 [rows]; None: rows in order

    @property
    def type_id(self) -> int:
        return EXECUTED_TYPES[self.type_name]

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Row i of the result is row order[i] of this one; the bytes stay where they are
        (the kernel's pack gathers them)."""
        combined = order if self.row_order is None else self.row_order[order]
        return replace(self, row_order=combined.contiguous())

    def pack(self, ops: GGUFOps, arena: PanelArena | None = None) -> torch.Tensor:
        """The kernel's panels of this matrix (about its bytes; see GGUFOps.pack)."""
        return ops.pack(self.raw, self.type_id, self.row_order, arena)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], decoded by the kernel as `gguf.quants.dequantize` decodes it
        (bitwise): for fused projections whose other parts are float."""
        ops = _gguf_ops()
        return ops.dequantize_rows(self.pack(ops), self.type_id, self.rows, self.cols,
                                   torch.arange(self.rows), torch.float32)


def merge_parts(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """A fused projection's parts as `QuantizedLinear` packs them: each on its own, side by
    side (the kernel takes a list of parts and writes each at its column offset, so nothing
    is concatenated, and row orders apply as the panels are gathered)."""
    return list(parts)


def _gguf_ops() -> GGUFOps:
    ops = gguf_ops()
    if ops is None:
        raise ValueError("the GGUF kernels could not be built here")
    return ops


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
        self.ops = ops = _gguf_ops()
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
        self.ops, self.dtype = _gguf_ops(), dtype
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols
        self.packed = PackedParts([weight.pack(self.ops)], [weight.type_id], [weight.rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.dequantize_rows(self.packed.panels[0], self.packed.types[0],
                                        self.num_embeddings, self.embedding_dim, ids, self.dtype)
