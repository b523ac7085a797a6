"""Which replica holds which blocks, built from the replicas' KV cache events: what a router
asks to send a request where its prefix is already cached.

Each source (a replica id) has the set of block hashes it holds. A hash stands for a whole
prefix (blocks.py), so "source S holds the first k blocks of a request" is k lookups. The
medium of an event is not tracked: a block held anywhere on the replica counts.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable

from radixserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


class BlockIndex:
    """Block sets per source. Subscriber threads `apply` batches while the router's event loop
    reads; one lock covers both, held for one batch or one lookup."""

    def __init__(self) -> None:
        self._blocks: dict[Hashable, set[int]] = {}
        self._lock = threading.Lock()

    def apply(self, source: Hashable, batch: EventBatch) -> None:
        """Applies one batch's events, in order, to `source`'s blocks (creating the source)."""
        with self._lock:
            blocks = self._blocks.setdefault(source, set())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    blocks.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()

    def drop(self, source: Hashable) -> None:
        """Forgets a source (a replica that went away); unknown sources are ignored."""
        with self._lock:
            self._blocks.pop(source, None)

    def sources(self) -> list[Hashable]:
        with self._lock:
            return list(self._blocks)

    def holds(self, source: Hashable, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._blocks.get(source, ())

    def block_count(self, source: Hashable) -> int:
        with self._lock:
            return len(self._blocks.get(source, ()))

    def prefix_lengths(self, hashes: Iterable[int]) -> dict[Hashable, int]:
        """For every source, how many leading blocks of `hashes` it holds (0 for none). Stops at
        the first block no source holds: O(matched blocks x sources)."""
        with self._lock:
            lengths = dict.fromkeys(self._blocks, 0)
            holding = list(self._blocks.items())
            for depth, block_hash in enumerate(hashes, start=1):
                holding = [(source, blocks) for source, blocks in holding if block_hash in blocks]
                if not holding:
                    break
                for source, _ in holding:
                    lengths[source] = depth
            return lengths
