"""Turns what the radix prefix cache does into KV cache events (a CacheObserver).

The cache reports token paths; the recorder cuts them into blocks of `block_size` tokens and
hashes them (blocks.py). Tokens fully determine a block's hash, so the radix tree's shape
(where its edges split) never shows in the events: a path cached up to `new_len` with
`old_len` already there stores blocks old_len // B .. new_len // B - 1 (the block straddling
old_len is new: no other branch has its tokens), and evicting a leaf whose edge spans
[start, end) removes blocks start // B .. end // B - 1. The engine drains the events once per
step and hands them to the publisher.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from radixserve.kv_events.blocks import block_hashes
from radixserve.kv_events.events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from radixserve.sequences import namespace_bytes


class KVEventRecorder:
    """Accumulates events between `drain` calls. `namespace_of` maps the cache's namespace to
    the one hashed and published (the engine keys its cache by (model, tenant) and publishes
    the tenant, which is what a router knows of a request)."""

    def __init__(self, block_size: int, medium: str = "CPU",
                 namespace_of: Callable[[Hashable], Hashable] | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if medium not in MEDIA:
            raise ValueError(f"medium must be one of {MEDIA}, got {medium!r}")
        self.block_size = block_size
        self.medium = medium
        self._namespace_of = namespace_of
        self._events: list[KVCacheEvent] = []

    def drain(self) -> list[KVCacheEvent]:
        """The events since the last drain, oldest first; clears them."""
        events, self._events = self._events, []
        return events

    # ----- CacheObserver -----

    def on_insert(self, namespace: Hashable, tokens: Sequence[int], old_len: int,
                  new_len: int) -> None:
        size = self.block_size
        first, end = old_len // size, new_len // size
        if end <= first:
            return
        namespace = self._public(namespace)
        chain = block_hashes(tokens[: end * size], namespace, size)
        parent = chain[first - 1] if first else None
        stored, token_ids = chain[first:], list(tokens[first * size : end * size])
        extra = self._extra_keys(namespace, len(stored))
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            # The same chain grown again (a later prefill chunk in the same step): one event.
            last.block_hashes.extend(stored)
            last.token_ids.extend(token_ids)
            if last.extra_keys is not None and extra is not None:
                last.extra_keys.extend(extra)
            return
        self._events.append(BlockStored(stored, parent, token_ids, size, medium=self.medium,
                                        extra_keys=extra))

    def on_evict(self, namespace: Hashable, path_tokens: Sequence[int], start: int,
                 end: int) -> None:
        size = self.block_size
        first, stop = start // size, end // size
        if stop <= first:
            return
        removed = block_hashes(path_tokens[: stop * size], self._public(namespace), size)[first:]
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # one eviction pass frees many leaves: one event
            last.block_hashes.extend(removed)
        else:
            self._events.append(BlockRemoved(removed, medium=self.medium))

    def on_reset(self) -> None:
        # The cache is empty now: whatever came before in this step no longer matters.
        self._events = [AllBlocksCleared()]

    def _public(self, namespace: Hashable) -> Hashable:
        return namespace if self._namespace_of is None else self._namespace_of(namespace)

    @staticmethod
    def _extra_keys(namespace: Hashable, blocks: int) -> list[tuple[str, ...] | None] | None:
        if namespace is None:
            return None
        keys = (namespace_bytes(namespace).decode(),)
        return [keys] * blocks
