"""What the two caches that own KV slots (radix tree, block hash) share: page size, the pool's
release function for what they evict, the clock, cumulative counters, and TTL pinning of the
path to a handle (each cache says what that path is and what pinning an entry changes)."""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic

from radixserve.cache.base import CacheHandle, CacheStats, ReleaseFn
from radixserve.cache.pins import EntryT, PinBook


class SlotCache(ABC, Generic[EntryT]):
    stores_slots = True  # slots handed to insert belong to the cache (except duplicates)

    def __init__(self, page_size: int, release: ReleaseFn,
                 clock: Callable[[], float] = time.monotonic,
                 max_pinned_tokens: int | None = None) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self._release = release
        self._clock = clock
        self._pins: PinBook[EntryT] = PinBook(max_pinned_tokens)
        self._inserted_total = self._evicted_total = 0

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def _pin_path(self, handle: CacheHandle | None) -> list[EntryT]:
        """The live entries from the root to `handle` (none when it was evicted)."""

    @abstractmethod
    def _pin_entry(self, entry: EntryT, expires_at: float, seq: int) -> None:
        """Records one entry's pin (and whatever the cache's own counters make of it)."""

    @abstractmethod
    def _unpin(self, entry: EntryT) -> None: ...

    def pin(self, handle: CacheHandle | None, expires_at: float) -> None:
        """Pins root→handle until the clock passes `expires_at`; a no-op for an evicted handle."""
        now = self._clock()
        self._expire_pins(now)
        path = self._pin_path(handle)
        if not path or expires_at < now:
            return
        seq = self._pins.new_pin()
        for entry in path:
            self._pin_entry(entry, expires_at, seq)
        for entry in self._pins.over_bound():
            self._unpin(entry)

    def reset(self) -> None:
        """Drops every unlocked, unpinned entry; locked and pinned paths stay."""
        self.evict(sys.maxsize)

    def _expire_pins(self, now: float) -> None:
        for entry in self._pins.expired(now):
            self._unpin(entry)

    def yield_pins(self, num_tokens: int) -> int:
        self._expire_pins(self._clock())
        released = 0
        pins = self._pins.ending_first()  # leaves first: an ancestor ends no sooner
        while released < num_tokens and (entry := next(pins, None)) is not None:
            released += entry.num_tokens
            self._unpin(entry)
        return released

    def stats(self) -> CacheStats:
        self._expire_pins(self._clock())
        evictable, protected, pinned, entries = self._counts()
        return CacheStats(evictable_tokens=evictable, protected_tokens=protected,
                          pinned_tokens=pinned, nodes=entries,
                          inserted_tokens_total=self._inserted_total,
                          evicted_tokens_total=self._evicted_total)

    @abstractmethod
    def _counts(self) -> tuple[int, int, int, int]:
        """Evictable, protected and pinned tokens, and the number of entries."""
