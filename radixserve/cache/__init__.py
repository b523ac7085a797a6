"""Prefix caches: map token runs (per namespace) to the KV slots that already hold them.

Three modes behind one interface (base.PrefixCache): "radix" (token-granular radix tree),
"hash" (vLLM-style hashed full blocks) and "off" (caches nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from radixserve.cache.base import (
    CacheHandle,
    CacheObserver,
    CacheStats,
    InsertResult,
    MatchResult,
    Namespace,
    PrefixCache,
    PrefixNode,
    ReleaseFn,
    TreeSummary,
)
from radixserve.cache.block_hash import BlockHashCache
from radixserve.cache.no_cache import NoCache
from radixserve.cache.radix import RadixCache
from radixserve.config import PREFIX_CACHE_MODES


def make_prefix_cache(
    mode: str,
    page_size: int,
    release: ReleaseFn,
    clock: Callable[[], float] = time.monotonic,
    max_pinned_tokens: int | None = None,
) -> PrefixCache:
    """Builds the cache for `--prefix-cache MODE`; `release` gives evicted slots to the pool."""
    if mode == "radix":
        return RadixCache(page_size, release, clock=clock, max_pinned_tokens=max_pinned_tokens)
    if mode == "hash":
        return BlockHashCache(page_size, release, clock=clock, max_pinned_tokens=max_pinned_tokens)
    if mode == "off":
        return NoCache(page_size)
    raise ValueError(
        f"unknown prefix cache mode {mode!r}; supported modes: {', '.join(PREFIX_CACHE_MODES)}"
    )


__all__ = [
    "PREFIX_CACHE_MODES",
    "BlockHashCache",
    "CacheHandle",
    "CacheObserver",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "Namespace",
    "NoCache",
    "PrefixCache",
    "PrefixNode",
    "RadixCache",
    "ReleaseFn",
    "TreeSummary",
    "make_prefix_cache",
]
