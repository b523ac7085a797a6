"""The interface every prefix cache mode (radix, hash, off) offers the scheduler.

A prefix cache maps runs of prompt tokens, within a namespace, to the KV-pool slots that already
hold their keys and values. It never touches KV tensors: it only hands slot indices around and
gives slots back to the pool (through `release`) when it evicts them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

# A namespace keeps tenants (cache_salt), models and adapters apart: nodes of two namespaces
# are never shared. `None` is the default namespace.
Namespace = Hashable

# Gives slots back to the KV pool's free list. Called with page-aligned runs of slots.
ReleaseFn = Callable[[list[int]], None]


class CacheHandle:
    """Names a cached path (from the root to one node) for lock, unlock and pin. Each cache
    mode subclasses it with its own node type; the "off" mode's handle is None."""

    __slots__ = ()


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a key: `length` tokens held in `slots`.

    `handle` is opaque; pass it to `lock` to protect the matched path while a request uses it.
    """

    length: int
    slots: list[int]
    handle: CacheHandle | None


@dataclass(frozen=True)
class InsertResult:
    """What `insert` did.

    `cached_length`: leading tokens that were already cached before this call.
    `slots`: the cache's slots for the whole inserted key (page-aligned length). Where they
    differ from the caller's own slots, the caller's are duplicates: the caller frees them and
    re-points its slot table at these.
    `handle`: the node that now ends the inserted key, for `lock`.
    """

    cached_length: int
    slots: list[int]
    handle: CacheHandle | None


@dataclass(frozen=True)
class CacheStats:
    """Token counts of the cache's slots, and cumulative counters."""

    evictable_tokens: int  # in the cache, unlocked and unpinned
    protected_tokens: int  # in the cache, locked by a running request
    pinned_tokens: int  # in the cache, unlocked but pinned by a live TTL
    nodes: int
    inserted_tokens_total: int
    evicted_tokens_total: int

    @property
    def cached_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens + self.pinned_tokens


@dataclass(frozen=True)
class PrefixNode:
    """One tree node as `PrefixCache.top_prefixes` reports it."""

    node_id: int  # stable while the node lives (splitting an edge gives the upper part a new id)
    parent_id: int | None  # None for a child of the root
    namespace: Namespace
    tokens: int  # on the edge into this node
    depth: int  # tokens before the edge: 0 for a child of the root
    hits: int  # admitted requests whose cache match ran through this edge
    served_tokens: int  # tokens the edge served from cache: hits x tokens
    last_used_s_ago: float  # since the last such request, or since it was cached
    locks: int  # running requests holding it
    pinned_for_s: float | None  # time left on its TTL pin; None when not pinned
    first_token_ids: tuple[int, ...]  # the start of the edge, for a human to recognise it


@dataclass(frozen=True)
class TreeSummary:
    """The most useful prefixes of a cache, best-first by served tokens from the root."""

    nodes: int  # in the whole cache, all namespaces
    prefixes: tuple[PrefixNode, ...]  # a parent always comes before its children
    truncated: bool  # a visible node was left out by the caps


class CacheObserver(Protocol):
    """Told what a cache stores and evicts, as token paths from the root (the radix cache
    reports to one; radixserve/kv_events turns the reports into KV cache events). Called on the
    engine thread inside the cache's own calls: keep it cheap, and do not call back into the
    cache."""

    def on_insert(self, namespace: Namespace, tokens_path: Sequence[int], old_len: int,
                  new_len: int) -> None:
        """`tokens_path[:new_len]` is cached now; its first `old_len` tokens already were."""
        ...

    def on_evict(self, namespace: Namespace, path_tokens: Sequence[int], start: int,
                 end: int) -> None:
        """Tokens [start, end) of the path `path_tokens` (length `end`) left the cache; the
        path's first `start` tokens are still cached."""
        ...

    def on_reset(self) -> None:
        """The cache is empty (a reset that left locked or pinned paths reports its evictions
        through on_evict instead)."""
        ...


class PrefixCache(Protocol):
    """What the scheduler needs from a prefix cache.

    Every slot handed to `insert` belongs to the cache afterwards (unless returned as a
    duplicate); the cache gives slots back only through `release`, when it evicts them.
    """

    page_size: int
    # False for the "off" mode: slots handed to insert stay the caller's, to free itself.
    stores_slots: bool

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `tokens`, page-aligned. Refreshes its LRU time."""
        ...

    def insert(
        self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int]
    ) -> InsertResult:
        """Caches the page-aligned prefix of `tokens` with its `slots`; see InsertResult."""
        ...

    def lock(self, handle: CacheHandle | None) -> None:
        """Protects the path from the root to `handle` from eviction (counted, re-entrant)."""
        ...

    def unlock(self, handle: CacheHandle | None) -> None:
        """Undoes one `lock` of the same handle."""
        ...

    def pin(self, handle: CacheHandle | None, expires_at: float) -> None:
        """Protects the path to `handle` from eviction until the clock passes `expires_at`."""
        ...

    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` slots if it can (LRU unlocked leaves); returns how many."""
        ...

    def yield_pins(self, num_tokens: int) -> int:
        """Ends pins early, the soonest to end first, until `num_tokens` pinned tokens are
        evictable again or no pin is left; returns how many were. For a request that nothing
        else can make room for: a pin keeps a prefix cheap to reuse, never a request waiting."""
        ...

    def stats(self) -> CacheStats: ...

    def record_use(self, handle: CacheHandle | None) -> None:
        """Counts one admitted request's use of the path to `handle` (its hits and last use).
        The scheduler calls it once per request, with its final match; lookups made to order
        the queue, prefetch or pin never count."""
        ...

    def top_prefixes(
        self, limit: int, visit_limit: int,
        visible: Callable[[Namespace], bool] | None = None, first_tokens: int = 16,
    ) -> TreeSummary:
        """Up to `limit` nodes, best-first from the root by served tokens, looking at no more
        than `visit_limit` nodes (the engine thread runs it between steps); `visible` keeps
        only the namespaces a caller may see. Empty for caches that are not trees."""
        ...

    def reset(self) -> None:
        """Drops every unlocked entry (releasing its slots)."""
        ...
