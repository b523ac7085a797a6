"""The paged KV pool: per-layer K/V tensors allocated once, indexed by slot, and the page
allocator that hands slots to requests and takes them back.

Slot s lives in page s // page_size. Requests and the prefix cache deal in slots; the
allocator deals in whole pages, so a run of slots given back must cover whole pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.layers.attention import LayerKV


class OutOfSlots(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Free pages as a bitmap; allocation is first-fit and prefers one contiguous run.

    Contiguity is what makes attention cheap: a prompt whose slots form one run can be read
    by decode attention as a view of the pool, with no gather (gathering a long context every
    step can cost more than the model's matmuls; benchmarks/bench_decode_attention.py). So an allocation of n pages takes the
    lowest run of n free pages when one exists (one C-speed scan of the bitmap) and otherwise
    the lowest free pages in order, which still leaves them sorted into as few runs as the
    pool's fragmentation allows.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._is_free = bytearray([1]) * num_pages
        self._num_free = num_pages

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_slots(self) -> int:
        return self._num_free * self.page_size

    def allocate(self, num_pages: int) -> list[int]:
        """Takes `num_pages` free pages and returns all their slots, page by page, ascending."""
        if num_pages > self._num_free:
            raise OutOfSlots(f"asked for {num_pages} pages, {self._num_free} free")
        if num_pages <= 0:
            return []
        free = self._is_free
        first = free.find(b"\x01" * num_pages)
        if first >= 0:
            pages: list[int] | range = range(first, first + num_pages)
            free[first : first + num_pages] = bytes(num_pages)
        else:  # fragmented: the lowest free pages, run by run
            pages = []
            pos = 0
            while len(pages) < num_pages:
                pos = free.find(1, pos)
                end = free.find(0, pos)
                end = min(self.num_pages if end < 0 else end, pos + num_pages - len(pages))
                pages.extend(range(pos, end))
                free[pos:end] = bytes(end - pos)
                pos = end
        self._num_free -= num_pages
        size = self.page_size
        if size == 1:
            return list(pages)
        return [p * size + i for p in pages for i in range(size)]

    def release(self, slots: Sequence[int]) -> None:
        """Gives back whole pages; `slots` must list every slot of each page it touches."""
        size = self.page_size
        if len(slots) % size:
            raise ValueError(f"release of {len(slots)} slots is not whole pages of {size}")
        for i in range(0, len(slots), size):
            page = slots[i] // size
            if slots[i] % size:
                raise ValueError(f"slot run starting at {slots[i]} is not page-aligned")
            if self._is_free[page]:
                raise AssertionError(f"double free of page {page}")
            self._is_free[page] = 1
        self._num_free += len(slots) // size


class KVPool:
    """K and V storage for every layer: `[num_kv_heads, num_slots, head_dim]` each.

    Head-major, so that gathering a request's slots yields attention's `[heads, tokens, dim]`
    layout directly, with no transposing copy of the gathered keys and values. The layers in
    `window_layers` (sliding-window layers with a slot space of their own, see
    radixserve/engine/window_kv.py) hold `window_pages` pages instead, handed out by
    `window_allocator`.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        window_layers: frozenset[int] = frozenset(),
        window_pages: int = 0,
    ) -> None:
        self.allocator = PageAllocator(num_pages, page_size)
        self.window_allocator = (PageAllocator(window_pages, page_size) if window_layers
                                 else None)
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.window_layers = window_layers
        # Not zeroed: a slot is written before attention reads it (a row reads only positions
        # its sequence has computed). Zeroing made the whole pool resident at start, a cost that
        # grows with the pool. The exception is slot 0, which the PyTorch decode backend reads
        # as padding: masked, its weight is 0, but 0 times a NaN left in fresh (GPU) memory
        # would still be NaN.
        def shape(layer: int) -> tuple[int, int, int]:
            pages = window_pages if layer in window_layers else num_pages
            return (num_kv_heads, pages * page_size, head_dim)

        self.layers = [LayerKV(torch.empty(shape(i), dtype=dtype, device=device),
                               torch.empty(shape(i), dtype=dtype, device=device))
                       for i in range(num_layers)]
        for layer in self.layers:
            layer.k[:, 0].zero_()
            layer.v[:, 0].zero_()
