"""Prefix-cache test helpers shared by the radix and block-hash suites."""

from __future__ import annotations

from collections.abc import Hashable

from radixserve.cache import InsertResult, PrefixCache
from radixserve.engine.kv_pool import PageAllocator


def put(
    cache: PrefixCache, pool: PageAllocator, tokens: list[int], namespace: Hashable = None
) -> InsertResult:
    """Caches `tokens` as a finished request would, freeing its duplicates; returns the result."""
    slots = pool.allocate(len(tokens) // cache.page_size)
    result = cache.insert(namespace, tokens, slots)
    pool.release([s for s, c in zip(slots, result.slots, strict=True) if s != c])
    return result
