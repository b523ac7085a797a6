"""Quantized weights as the loader hands them to layers (`QuantizedWeight`: a matrix in GGUF
blocks) and as the GGUF kernel runs them (`PackedParts`), with the formats the kernel executes
or rewrites at load. Their own module, so that `Linear` (linear.py) can hold them and the
quantized methods (quantized.py) can run them without either importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from radixserve.kernels import GGUFOps, PanelArena, gguf_ops

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
# - MXFP4 -> Q8_0 (gpt-oss's experts): nothing lost (q = the doubled E2M1 value times 2^s, d
#   the block's power-of-two scale over 2^s, exact in fp16) for every block whose largest
#   weight lies in 4e-7 .. 2^18; 34 bytes per 32 weights instead of 17, so such experts read
#   twice the file's bytes per token.
REPACKED_TYPES: dict[str, str] = {"Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q5_K": "Q8_0", "Q3_K": "Q6_K",
                                  "MXFP4": "Q8_0"}


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
        ops = required_gguf_ops()
        return ops.dequantize_rows(self.pack(ops), self.type_id, self.rows, self.cols,
                                   torch.arange(self.rows), torch.float32)


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


def required_gguf_ops() -> GGUFOps:
    """The GGUF kernels; a ValueError where they cannot be built here."""
    ops = gguf_ops()
    if ops is None:
        raise ValueError("the GGUF kernels could not be built here")
    return ops
