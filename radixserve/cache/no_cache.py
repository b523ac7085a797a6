"""The "off" prefix cache: matches nothing and keeps nothing, so every request computes its whole
prompt. It exists so the scheduler runs one code path whatever the mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixserve.cache.base import (
    CacheHandle,
    CacheStats,
    InsertResult,
    MatchResult,
    Namespace,
    TreeSummary,
)


class NoCache:
    """A PrefixCache that never takes ownership of a slot.

    `stores_slots` is False: `insert` hands the caller's own slots back (cached_length 0, handle
    None) and keeps nothing, so a request's slots stay private to it from allocation to finish,
    and the scheduler frees all of them itself, exactly once, when the request ends. `match_prefix`
    always returns length 0; lock, unlock and pin accept the None handle and do nothing; evict
    frees nothing; stats are all zero and the tree summary is empty.
    """

    stores_slots = False

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchResult:
        return MatchResult(length=0, slots=[], handle=None)

    def insert(
        self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int]
    ) -> InsertResult:
        end = len(tokens) - len(tokens) % self.page_size
        return InsertResult(cached_length=0, slots=list(slots[:end]), handle=None)

    def lock(self, handle: CacheHandle | None) -> None:
        pass

    def unlock(self, handle: CacheHandle | None) -> None:
        pass

    def pin(self, handle: CacheHandle | None, expires_at: float) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def yield_pins(self, num_tokens: int) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(0, 0, 0, 0, 0, 0)

    def record_use(self, handle: CacheHandle | None) -> None:
        pass

    def top_prefixes(
        self, limit: int, visit_limit: int,
        visible: Callable[[Namespace], bool] | None = None, first_tokens: int = 16,
    ) -> TreeSummary:
        return TreeSummary(nodes=0, prefixes=(), truncated=False)

    def reset(self) -> None:
        pass
