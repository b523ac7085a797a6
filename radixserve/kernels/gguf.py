"""Matmuls with GGUF-quantized weights (csrc/gguf/): weights kept as the
file's blocks, repacked into 16-row panels, multiplied with int8-quantized activations.
"""

from __future__ import annotations

import functools

import torch

from radixserve.kernels.arena import PanelArena
from radixserve.kernels.build import load_library
from radixserve.kernels.paths import best_path, path_names


class GGUFOps:
    """The GGUF kernels (csrc/gguf/): weights kept as the file's blocks,
    repacked into 16-row panels, multiplied with int8-quantized activations.

    Types: Q8_0 (8), Q4_0 (2), Q4_1 (3), Q4_K (12), Q6_K (14). A row's result is bitwise the
    same whatever the batch, thread count or path; `max_path` caps the path (an index of
    `path_names("gguf")`) so tests can run each one.
    """

    def path(self) -> int:
        """The best path this CPU runs (an index of `path_names("gguf")`)."""
        return best_path("gguf")

    def path_name(self, max_path: int | None = None) -> str:
        """The path gguf_linear takes on this CPU when capped at `max_path`."""
        best = self.path()
        return path_names("gguf")[best if max_path is None else min(max_path, best)]

    def pack(self, raw: torch.Tensor, ggml_type: int, row_order: torch.Tensor | None = None,
             arena: PanelArena | None = None) -> torch.Tensor:
        """Panels uint8 [ceil(N / 16), K / block * panel block bytes] of a GGUF tensor's blocks
        raw uint8 [N, row_bytes]; panel row n takes raw row row_order[n] where given. About the
        file's bytes (Q4_K: 1.03x); see csrc/gguf/gguf_blocks.h. With an arena, the panels are a slice of
        its buffers; else a buffer of their own."""
        if arena is None or raw.dim() != 2:  # (the op refuses a bad raw)
            return torch.ops.radixserve.gguf_pack(raw, ggml_type, row_order)
        rows, row_bytes = raw.shape
        out = arena.take(torch.ops.radixserve.gguf_packed_bytes(ggml_type, rows, row_bytes))
        torch.ops.radixserve.gguf_pack_into(raw, ggml_type, row_order, out)
        return out.view(-(-rows // 16), -1)

    def dequantize_rows(self, panels: torch.Tensor, ggml_type: int, n_rows: int, k: int,
                        ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of the packed [n_rows, k] weight, [T, k] in `dtype`: bitwise
        gguf.quants.dequantize's values, then cast."""
        return torch.ops.radixserve.gguf_dequantize_rows(panels, ggml_type, n_rows, k, ids, dtype)

    def linear(self, x: torch.Tensor, panels: torch.Tensor | list[torch.Tensor],
               ggml_types: int | list[int], rows: int | list[int], bias: torch.Tensor | None,
               max_path: int) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16, contiguous) @ W^T + bias -> [M, sum(rows)] in x's
        dtype. W is one part (panels, type, rows) or a list of parts side by side, such as a
        fused qkv whose parts differ in type: x is quantized once and nothing is concatenated."""
        if isinstance(panels, torch.Tensor):
            panels, ggml_types, rows = [panels], [ggml_types], [rows]
        return torch.ops.radixserve.gguf_linear(x, panels, ggml_types, rows, bias, max_path)

    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            gate: tuple[torch.Tensor, int], up: tuple[torch.Tensor, int],
            down: tuple[torch.Tensor, int], experts: int, inter: int,
            gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
            activation: int, alpha: float, limit: float, max_path: int) -> torch.Tensor:
        """A mixture-of-experts layer's experts (csrc/gguf/gguf_moe.cpp): x [T, H] (float32 or
        bfloat16, contiguous) -> [T, H] in x's dtype, sum over j of weights[t, j] (float32
        [T, top_k]) times expert ids[t, j]'s (int64 [T, top_k]) down(act(gate x, up x)).
        gate and up are (panels, GGUF type) of all experts' [experts * inter, H] matrices,
        down of [experts * H, inter]; biases float32 [experts, 2 * inter] (gate then up) and
        [experts, H]; activation 0 is silu(gate) * up, 1 gpt-oss's clamped SwiGLU (alpha,
        limit). Only the chosen experts' panels are read, once per call."""
        return torch.ops.radixserve.gguf_moe(x, ids, weights, gate[0], gate[1], up[0], up[1],
                                             down[0], down[1], experts, inter, gate_up_bias,
                                             down_bias, activation, alpha, limit, max_path)


@functools.cache
def gguf_ops() -> GGUFOps | None:
    """The GGUF kernels, built if needed; None where they cannot be."""
    return GGUFOps() if load_library() else None
