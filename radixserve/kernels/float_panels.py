"""Float32 matmuls on weights packed into panels of 16 output rows held in 16-bit (or 32-bit)
values (csrc/float_panels/), any number of rows, for CPUs without bfloat16 dot products.
"""

from __future__ import annotations

import functools

import torch

from radixserve.kernels.arena import PanelArena, empty_on_huge_pages
from radixserve.kernels.build import load_library
from radixserve.kernels.paths import best_path, path_names


class FloatPanelOps:
    """The float matmul of csrc/float_panels/: a weight packed once into panels of 16 output rows,
    k-major, in bfloat16, float16 or float32, multiplied in float32 arithmetic by x of any
    number of rows. Each output is one chain of FMAs over k, so a row's result is bitwise the
    same whatever the batch, thread count or path; `max_path` caps the path (an index of
    `path_names("float_panels")`) so tests can run each one.
    """

    PANEL = 16  # output rows per panel

    def path(self) -> int:
        """The best path this CPU runs (an index of `path_names("float_panels")`)."""
        return best_path("float_panels")

    def path_name(self, max_path: int | None = None) -> str:
        """The path `linear` takes on this CPU when capped at `max_path`."""
        best = self.path()
        return path_names("float_panels")[best if max_path is None else min(max_path, best)]

    def pack(self, weight: torch.Tensor, dtype: torch.dtype,
             arena: PanelArena | None = None) -> torch.Tensor:
        """Panels [ceil(N / 16), K, 16] in `dtype` of a weight [N, K]: panel p holds rows
        16p..16p+15 k-major, rows past N are zero. On 2 MB pages (csrc/common/huge_pages.h), as a slice of
        the arena's buffers where one is given: a decode step streams the panels."""
        rows, cols = weight.shape
        count = -(-rows // self.PANEL)
        padded = weight.to(dtype)
        if rows % self.PANEL:
            padded = torch.cat([padded, padded.new_zeros(count * self.PANEL - rows, cols)])
        shape = [count, cols, self.PANEL]
        if arena is None:
            panels = empty_on_huge_pages(shape, dtype)
        else:
            size = count * cols * self.PANEL * padded.element_size()
            panels = arena.take(size).view(dtype).view(shape)
        return panels.copy_(padded.reshape(count, self.PANEL, cols).transpose(1, 2))

    def linear(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
               max_path: int) -> torch.Tensor:
        """x [M, K] float32 contiguous @ W^T + bias (float32 [n] or None) -> float32 [M, n], W
        the [n, K] weight `pack` made `panels` of."""
        return torch.ops.radixserve.float_panels_linear(x, panels, n, bias, max_path)


@functools.cache
def float_panel_ops() -> FloatPanelOps | None:
    """The float matmul kernel, built if needed; None where it cannot be."""
    return FloatPanelOps() if load_library() else None
