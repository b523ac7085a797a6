"""TTL pins for prefix-cache entries (cache_control breakpoints): the book both the radix tree
and the block-hash cache keep of which entries are pinned, until when, under a token bound.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from radixserve.cache.base import CacheHandle

NOT_PINNED = -math.inf


@dataclass(eq=False, slots=True, kw_only=True)
class PinnableEntry(CacheHandle):
    """The pin state both caches' entries (tree nodes, hash blocks) carry; see Pinnable."""

    pinned_until: float = NOT_PINNED
    pin_seq: int = 0
    pin_version: int = 0
    alive: bool = True  # False once evicted: a handle to it may no longer be locked


class Pinnable(Protocol):
    """A cache entry (tree node or hash block) that a PinBook can pin."""

    pinned_until: float  # NOT_PINNED when no live pin is recorded
    pin_seq: int  # which pin call last covered it; older calls yield first to the bound
    pin_version: int  # bumped on every change, so older heap records are known to be stale
    depth: int  # deeper entries yield and expire before their ancestors on ties

    @property
    def num_tokens(self) -> int: ...


EntryT = TypeVar("EntryT", bound=Pinnable)


class PinBook(Generic[EntryT]):
    """TTL pins, expired lazily against an injected clock, under an optional token bound.

    Two heaps of versioned records: by expiry time and by pin order (for `max_tokens`). Re-pinning
    bumps an entry's version, so its older records are skipped when popped. Cost: O(log p) per
    entry pinned and per pin that ends; stale records are compacted once they outnumber live pins.
    An ancestor is always pinned at least as long and as recently as its descendants, so pins end
    leaf-first and a pinned entry never sits below an unpinned one.
    """

    def __init__(self, max_tokens: int | None) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0  # tokens under a live pin, locked or not: what the bound counts
        self._live = 0
        self._seq = 0
        self._order = itertools.count()  # unique tie-break, so records never compare entries
        self._by_expiry: list[tuple[float, int, int, EntryT, int]] = []
        self._by_age: list[tuple[float, int, int, EntryT, int]] = []

    def new_pin(self) -> int:
        self._seq += 1
        return self._seq

    def pin(self, entry: EntryT, expires_at: float, seq: int) -> None:
        """Pins `entry` until `expires_at`; a re-pin extends, never shortens."""
        if entry.pinned_until == NOT_PINNED:
            self.tokens += entry.num_tokens
            self._live += 1
        entry.pinned_until = max(entry.pinned_until, expires_at)
        entry.pin_seq = seq
        self.track(entry)

    def track(self, entry: EntryT, adopted: bool = False) -> None:
        """Files a pinned entry's current state; `adopted` for a split-off copy of a pin."""
        self._live += adopted
        entry.pin_version += 1
        order = next(self._order)
        heapq.heappush(
            self._by_expiry, (entry.pinned_until, -entry.depth, order, entry, entry.pin_version)
        )
        if self.max_tokens is not None:
            heapq.heappush(
                self._by_age, (entry.pin_seq, -entry.depth, order, entry, entry.pin_version)
            )
        for heap in (self._by_expiry, self._by_age):
            if len(heap) > 2 * self._live + 64:  # amortised O(1) per push
                heap[:] = [r for r in heap if r[3].pin_version == r[4]]
                heapq.heapify(heap)

    def unpin(self, entry: EntryT) -> None:
        self.tokens -= entry.num_tokens
        self._live -= 1
        entry.pinned_until = NOT_PINNED
        entry.pin_version += 1

    def expired(self, now: float) -> Iterator[EntryT]:
        """Yields entries whose pin ran out (`now > pinned_until`); the caller unpins each."""
        yield from self._pop_while(self._by_expiry, lambda: self._by_expiry[0][0] < now)

    def ending_first(self) -> Iterator[EntryT]:
        """Yields every live pin, the soonest to end first, one per request; the caller
        unpins each it takes."""
        yield from self._pop_while(self._by_expiry, lambda: True)

    def over_bound(self) -> Iterator[EntryT]:
        """Yields the oldest pins while over `max_tokens`; the caller unpins each."""
        bound = self.max_tokens
        yield from self._pop_while(self._by_age, lambda: bound is not None and self.tokens > bound)

    def _pop_while(self, heap: list, more: Callable[[], bool]) -> Iterator[EntryT]:
        while heap and more():
            *_, entry, version = heapq.heappop(heap)
            if entry.pin_version == version:
                yield entry
