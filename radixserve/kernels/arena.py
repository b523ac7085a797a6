"""Buffers on 2 MB pages for packed weights (csrc/common/huge_pages.cpp), and `PanelArena`, which lays a
model's small packed weights side by side in them: a decode step streams every weight, and
huge pages spare it the TLB misses of 4 KB ones.
"""

from __future__ import annotations

import torch

from radixserve.kernels.build import load_library


class PanelArena:
    """A model's small packed weights side by side in buffers of 2 MB pages (csrc/common/huge_pages.h): a
    weight under 4 MB gets no huge page of its own (SmolLM2-135M's are all under 1 MB, a 1B
    model's k and v 1.1 MB), and side by side they share them, in the order the layers are
    prepared. A weight of 4 MB or more gets a buffer of its own. One that does not fit the
    current buffer starts the next; the rest of the old one is never touched, so it holds at
    most the huge page its last weight ends in."""

    SMALL_BYTES = 4 << 20  # below this a weight shares a buffer

    def __init__(self, buffer_bytes: int = 32 << 20) -> None:
        self.buffer_bytes = buffer_bytes
        self._buffer: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 [nbytes] slice, contiguous, 64-byte aligned."""
        if nbytes >= self.SMALL_BYTES:
            return empty_on_huge_pages([nbytes], torch.uint8)
        if self._buffer is None or self._used + nbytes > self._buffer.numel():
            self._buffer = empty_on_huge_pages([max(self.buffer_bytes, nbytes)], torch.uint8)
            self._used = 0
        out = self._buffer[self._used:self._used + nbytes]
        self._used += -(-nbytes // 64) * 64  # the next weight starts on a cache line
        return out


def empty_on_huge_pages(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on 2 MB pages where the kernels' library is built and Linux
    gives them (csrc/common/huge_pages.cpp); torch.empty's otherwise."""
    if not load_library():
        return torch.empty(shape, dtype=dtype)
    return torch.ops.radixserve.empty_on_huge_pages(shape, dtype)
