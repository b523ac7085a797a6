"""Sliding-window layers' KV in a slot space of their own (`swa_memory="window"`): a local layer
reads only its last `window` positions, so a running request holds those plus the tokens it
computes, and the prefix cache keeps a window's worth only where a later request may resume.

The full-attention layers' slots name the tokens, as without a window group: the prefix cache
and the scheduler deal in them alone. A full page may own one page of the window group (its
"local page", holding the local layers' K/V of the same tokens). A local page lives while a
running request holds it (it is in that request's window) or the cache keeps it (it ends where
a publish ended: a chunk's end, a prompt's end, a finished or preempted request's end) and the
group has room: kept pages no request holds yield, least recently used first, when a request
needs the room (the tree still holds the full KV there), and die with their full page when the
cache evicts that. A cache match is cut back to the last point
whose window is whole (`resumable`): the local K/V at a position depend, through the local
layers below, on up to layers x window positions back, so recomputing only the missing window
would not be exact. `FullKV` is the other strategy: every layer keeps the whole context in the
pool's one slot space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.engine.kv_pool import PageAllocator
from radixserve.engine.request import Request
from radixserve.layers.attention import SequenceSpan, StepLayout

ReleaseFn = Callable[[list[int]], None]


class FullKV:
    """No window group: every layer keeps its K/V for the whole context, so any cached prefix
    is resumable and nothing is held per request."""

    def __init__(self, release: ReleaseFn) -> None:
        self.release_full = release  # what the prefix cache calls for the slots it evicts

    def resumable(self, slots: Sequence[int], length: int) -> int:
        """The longest prefix, at most `length` tokens of a match held in `slots`, that a
        request can resume from."""
        return length

    def adopt(self, request: Request) -> None:
        """Takes a newly admitted request's hold on the window before its cached prefix."""

    def slide(self, request: Request) -> None:
        """Gives back the request's KV that its next position's window no longer reads."""

    def reserve(self, request: Request, count: int) -> int:
        """Holds KV space for as many of the request's next `count` tokens as fit (after
        `slide`), giving up kept resume windows if it must; returns how many."""
        return count

    def admits(self) -> bool:
        """Whether a newly admitted request could get room for its next token now."""
        return True

    def keep(self, request: Request, end: int) -> None:
        """The cache keeps the window before position `end` (just published) for resuming."""

    def repoint(self, request: Request, index: int, old: int, new: int) -> None:
        """Position `index`'s full slot `old` is a duplicate of the cache's `new` (publish
        frees `old` next)."""

    def truncate(self, request: Request, end: int) -> None:
        """Drops the request's holds from position `end` on (a rejected draft's rows; `end`
        on a page boundary), before its full slots there go back."""

    def release(self, request: Request) -> None:
        """Drops every hold of a request leaving the running batch."""

    def local_layout(self, decodes: list[SequenceSpan], prefills: list[SequenceSpan],
                     device: torch.device) -> StepLayout | None:
        """The step's layout for the window group's layers (None: they read the pool's one
        slot space)."""
        return None

    def check(self, requests: Sequence[Request], reads: Sequence[tuple[Request, int]]) -> None:
        """Asserts the group's books for the running `requests`, and that each of a step's
        `reads` (a request, the end of its rows) finds every position its rows read held
        (debug_invariants)."""


@dataclass(eq=False)
class LocalSlotTable:
    """A request's local slot of each position (0 where it holds none, a position its
    window no longer reads), with the int32 copy the decode kernel reads."""

    slots: list[int] = field(default_factory=list)
    array: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int32))
    # Position page -> the full page whose local page the request holds there, ascending.
    held: dict[int, int] = field(default_factory=dict)

    def slot_array(self, end: int, start: int = 0) -> np.ndarray:
        return self.array[start:end]

    def set(self, start: int, values: Sequence[int]) -> None:
        end = start + len(values)
        if end > len(self.slots):
            self.slots.extend([0] * (end - len(self.slots)))
        if end > len(self.array):
            grown = np.zeros(max(end, 2 * len(self.array)), np.int32)
            grown[: len(self.array)] = self.array
            self.array = grown
        self.slots[start:end] = values
        self.array[start:end] = values


class WindowKV(FullKV):
    """The window group's pages (`allocator`) and who holds them; see the module docstring.

    Per full page: its local page (-1: none), how many running requests hold it, and whether
    the cache keeps it. A local page is free exactly when no request holds it and the cache
    does not keep it.
    """

    def __init__(self, allocator: PageAllocator, num_full_pages: int, window: int,
                 release: ReleaseFn) -> None:
        super().__init__(release)
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.window = window
        self._release_pages = release
        self._local = [-1] * num_full_pages
        self._holds = [0] * num_full_pages
        self._kept = bytearray(num_full_pages)
        # Kept pages, least recently kept or resumed from first: what yields when the group
        # runs short (the tree keeps the full KV; matches are cut back to what stays).
        self._kept_order: dict[int, None] = {}
        self._tables: dict[Request, LocalSlotTable] = {}

    @property
    def free_pages(self) -> int:
        return self.allocator.free_slots // self.page_size

    def table(self, request: Request) -> LocalSlotTable:
        table = self._tables.get(request)
        if table is None:
            table = self._tables[request] = LocalSlotTable()
        return table

    # ----- the cache's side -----

    def resumable(self, slots: Sequence[int], length: int) -> int:
        size = self.page_size
        end = length
        while end > 0:
            first = max(0, end - self.window + 1) // size
            missing = next((k for k in range((end - 1) // size, first - 1, -1)
                            if self._local[slots[k * size] // size] < 0), None)
            if missing is None:
                return end
            end = missing * size
        return 0

    def admits(self) -> bool:
        return self.free_pages > 0 or any(not self._holds[p] for p in self._kept_order)

    def release_full(self, slots: list[int]) -> None:
        size = self.page_size
        for i in range(0, len(slots), size):
            page = slots[i] // size
            if self._local[page] >= 0:
                assert self._holds[page] == 0, f"evicting full page {page} a request holds"
                self._free_local(page)
        self._release_pages(slots)

    def keep(self, request: Request, end: int) -> None:
        size = self.page_size
        for k in range(max(0, end - self.window + 1) // size, -(-end // size)):
            page = request.slots[k * size] // size
            if self._local[page] >= 0:
                self._kept[page] = 1
                self._kept_order.pop(page, None)
                self._kept_order[page] = None

    # ----- a request's side -----

    def adopt(self, request: Request) -> None:
        start = request.num_computed
        table = self.table(request)
        size = self.page_size
        for k in range(max(0, start - self.window + 1) // size, -(-start // size)):
            page = request.slots[k * size] // size
            assert self._local[page] >= 0, "admitted past the last resumable point"
            self._hold(table, k, page)
            if page in self._kept_order:  # resumed from: used most recently
                self._kept_order[page] = self._kept_order.pop(page)

    def slide(self, request: Request) -> None:
        table = self._tables.get(request)
        if table is None:
            return
        # Position p reads (p - window, p]: whole pages below the next position's window go.
        below = (request.num_computed - self.window + 1) // self.page_size
        while table.held:
            k = next(iter(table.held))
            if k >= below:
                break
            self._drop(table, k)

    def reserve(self, request: Request, count: int) -> int:
        short = len(self._to_allocate(request, count)) - self.free_pages
        if short > 0:
            self._forget_kept(short)
        size = self.page_size
        start = request.num_computed
        table = self.table(request)
        for k in range(start // size, -(-(start + count) // size)):
            if k in table.held:
                continue
            page = request.slots[k * size] // size
            if self._local[page] < 0:
                if not self.free_pages:
                    return max(0, k * size - start)
                self._local[page] = self.allocator.allocate(1)[0] // size
            self._hold(table, k, page)
        return count

    def repoint(self, request: Request, index: int, old: int, new: int) -> None:
        size = self.page_size
        table = self._tables.get(request)
        if index % size or table is None or index // size not in table.held:
            return
        k, old_page, new_page = index // size, old // size, new // size
        if self._local[new_page] < 0:  # ours becomes the cache page's local page
            self._local[new_page], self._local[old_page] = self._local[old_page], -1
            self._holds[new_page], self._holds[old_page] = self._holds[old_page], 0
            table.held[k] = new_page
        else:  # the cache page has its own: share it, free ours (in place: `held` stays sorted)
            self._holds[old_page] -= 1
            if not self._holds[old_page]:
                self._free_local(old_page)
            self._holds[new_page] += 1
            table.held[k] = new_page
            base = self._local[new_page] * size
            table.set(k * size, range(base, base + size))

    def truncate(self, request: Request, end: int) -> None:
        table = self._tables.get(request)
        if table is None:
            return
        for k in [k for k in table.held if k * self.page_size >= end]:
            self._drop(table, k)

    def release(self, request: Request) -> None:
        table = self._tables.pop(request, None)
        if table is not None:
            for k in list(table.held):
                self._drop(table, k)

    def local_layout(self, decodes: list[SequenceSpan], prefills: list[SequenceSpan],
                     device: torch.device) -> StepLayout | None:
        write: list[int] = []
        spans = []
        for span in [*decodes, *prefills]:
            table = self._tables[span.table]  # type: ignore[index]
            spans.append(SequenceSpan(table, span.start, span.length, span.first))
            write.extend(table.slots[span.first : span.context])
        slots = torch.tensor(write, dtype=torch.int64).to(device, non_blocking=True)
        return StepLayout(spans[: len(decodes)], spans[len(decodes) :], slots)

    def check(self, requests: Sequence[Request], reads: Sequence[tuple[Request, int]]) -> None:
        size = self.page_size
        for request, end in reads:
            table = self._tables.get(request)
            first = max(0, request.num_computed - self.window + 1) // size
            assert table is not None and all(
                k in table.held and table.slots[k * size] // size == self._local[table.held[k]]
                for k in range(first, -(-end // size))), \
                f"{request.request_id} would read local KV it does not hold"
        holds = [0] * len(self._local)
        for request in requests:
            table = self._tables.get(request)
            for k, page in (table.held.items() if table is not None else ()):
                assert request.slots[k * self.page_size] // self.page_size == page, \
                    "a held local page names a full page the request no longer has there"
                holds[page] += 1
        assert holds == self._holds, "local page holds out of step with the requests"
        live = [page for page, local in enumerate(self._local) if local >= 0]
        assert all(self._holds[p] or self._kept[p] for p in live), "a local page nobody holds"
        assert len(live) + self.free_pages == self.allocator.num_pages, \
            "window group pages lost or double counted"

    # ----- pages -----

    def _to_allocate(self, request: Request, count: int) -> list[int]:
        size = self.page_size
        start = request.num_computed
        table = self._tables.get(request)
        held = table.held if table is not None else {}
        return [k for k in range(start // size, -(-(start + count) // size))
                if k not in held and self._local[request.slots[k * size] // size] < 0]

    def _hold(self, table: LocalSlotTable, k: int, page: int) -> None:
        table.held[k] = page
        self._holds[page] += 1
        size = self.page_size
        base = self._local[page] * size
        table.set(k * size, range(base, base + size))

    def _drop(self, table: LocalSlotTable, k: int) -> None:
        page = table.held.pop(k)
        self._holds[page] -= 1
        table.set(k * self.page_size, [0] * self.page_size)
        if not self._holds[page] and not self._kept[page]:
            self._free_local(page)

    def _forget_kept(self, pages: int) -> None:
        """Frees up to `pages` kept local pages that no request holds, least recent first."""
        idle = [page for page in self._kept_order if not self._holds[page]][:pages]
        for page in idle:
            self._free_local(page)

    def _free_local(self, page: int) -> None:
        size = self.page_size
        local = self._local[page]
        self._local[page] = -1
        self._kept[page] = 0
        self._kept_order.pop(page, None)
        self.allocator.release(list(range(local * size, (local + 1) * size)))
