"""BlockHashCache ("hash" mode) against the same brute-force model as the radix tree, with an
honest hash and with one that collides on purpose, plus its own behaviours one at a time.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
from test_radix_cache import MACHINE_SETTINGS, CachedPage, FakeClock, PrefixCacheMachine

from radixserve.cache import BlockHashCache
from radixserve.engine.kv_pool import PageAllocator
from tests.support.caches import put
from tests.support.complexity import count_steps


class BlockHashMachine(PrefixCacheMachine):
    hash_fn = None  # the cache's default

    def make_cache(self, page_size: int, max_pinned: int | None) -> BlockHashCache:
        extra = {"hash_fn": self.hash_fn} if self.hash_fn else {}
        return BlockHashCache(
            page_size, self._release, clock=self.clock, max_pinned_tokens=max_pinned, **extra
        )

    def cached_pages(self) -> list[CachedPage]:
        """Every block in the hash table, with the prefix its parent chain spells."""
        pages = []
        for bucket_hash, bucket in self.cache._table.items():
            for block in bucket:
                assert block.alive and block.hash == bucket_hash
                tokens: tuple[int, ...] = ()
                link = block
                while link is not None:
                    assert link.alive  # parents outlive their children: no orphans
                    tokens = link.tokens + tokens
                    link = link.parent
                key = (block.namespace, tokens)
                pages.append(CachedPage(key, block.slots, block.ref_count, block.pinned_until))
        return pages


class CollidingHashMachine(BlockHashMachine):
    """Every block hashes to one of two values: lookups must still never return wrong KV."""

    @staticmethod
    def hash_fn(parent_hash: int, tokens: tuple[int, ...], namespace: Hashable) -> int:
        return tokens[0] % 2


TestBlockHashMachine = BlockHashMachine.TestCase
TestBlockHashMachine.settings = MACHINE_SETTINGS
TestCollidingHashMachine = CollidingHashMachine.TestCase
TestCollidingHashMachine.settings = MACHINE_SETTINGS


def make_hash(
    page_size: int = 2, num_pages: int = 64, **kwargs: object
) -> tuple[BlockHashCache, PageAllocator]:
    pool = PageAllocator(num_pages, page_size)
    return BlockHashCache(page_size, pool.release, **kwargs), pool


def test_only_full_blocks_are_cached_and_chained() -> None:
    cache, pool = make_hash(page_size=2)
    first = put(cache, pool, [1, 2, 3, 4, 5])
    assert len(first.slots) == 4 and cache.stats().nodes == 2
    assert cache.match_prefix(None, [1, 2, 3, 9]).length == 2
    assert cache.match_prefix(None, [9, 9, 3, 4]).length == 0  # same block, other parent
    second = cache.insert(None, [1, 2, 3, 4, 7, 8], first.slots + pool.allocate(1))
    assert second.cached_length == 4 and second.slots[:4] == first.slots


def test_a_hash_collision_is_a_miss_not_wrong_kv() -> None:
    cache, pool = make_hash(page_size=2, hash_fn=lambda parent, tokens, namespace: 0)
    a = put(cache, pool, [1, 2, 3, 4])
    b = put(cache, pool, [5, 6, 3, 4])
    assert b.cached_length == 0
    assert cache.match_prefix(None, [5, 6, 3, 4]).slots == b.slots
    assert cache.match_prefix(None, [1, 2, 3, 4]).slots == a.slots
    assert cache.match_prefix("other", [1, 2, 3, 4]).length == 0


def test_free_queue_is_lru_and_children_go_before_parents() -> None:
    cache, pool = make_hash(page_size=1)
    put(cache, pool, [1, 2])
    put(cache, pool, [3, 4])
    cache.match_prefix(None, [1])  # refreshes [1] only; its child [1, 2] stays old
    assert cache.evict(1) == 1
    assert cache.match_prefix(None, [1, 2]).length == 1  # the old child went, not the parent
    assert cache.evict(2) == 2  # then [3, 4], child first
    assert cache.match_prefix(None, [1]).length == 1
    assert cache.evict(5) == 1 and cache.stats().nodes == 0


def test_a_hit_keeps_parents_behind_their_children() -> None:
    cache, pool = make_hash(page_size=1)
    put(cache, pool, [1, 2, 3])
    cache.match_prefix(None, [1, 2, 3])  # refreshes the chain, deepest block first
    for cached in (2, 1, 0):
        assert cache.evict(1) == 1
        assert cache.match_prefix(None, [1, 2, 3]).length == cached
    put(cache, pool, [1, 2])
    put(cache, pool, [1, 2, 3])  # extends a chain nobody holds: [1, 2] is refreshed after [3]
    assert cache.evict(1) == 1
    assert cache.match_prefix(None, [1, 2, 3]).length == 2


def test_reference_counts_protect_the_whole_chain() -> None:
    cache, pool = make_hash(page_size=2)
    result = put(cache, pool, [1, 2, 3, 4])
    cache.lock(result.handle)
    cache.lock(cache.match_prefix(None, [1, 2]).handle)
    assert cache.stats().protected_tokens == 4 and cache.evict(100) == 0
    cache.unlock(result.handle)
    assert cache.stats().protected_tokens == 2 and cache.evict(100) == 2
    cache.unlock(cache.match_prefix(None, [1, 2]).handle)
    with pytest.raises(AssertionError):
        cache.unlock(cache.match_prefix(None, [1, 2]).handle)


def test_pins_expire_and_yield_to_the_bound() -> None:
    clock = FakeClock()
    cache, pool = make_hash(page_size=2, clock=clock, max_pinned_tokens=4)
    old = put(cache, pool, [1, 1, 1, 1])
    put(cache, pool, [2, 2])
    cache.pin(old.handle, expires_at=10.0)
    assert cache.stats().pinned_tokens == 4 and cache.evict(100) == 2  # only the unpinned one
    new = put(cache, pool, [2, 2])
    cache.pin(new.handle, expires_at=20.0)  # over the bound: the old chain's last block yields
    assert cache.stats().pinned_tokens == 4
    assert cache.evict(100) == 2 and cache.match_prefix(None, [1, 1, 1, 1]).length == 2
    clock.now = 10.5
    assert cache.evict(100) == 2  # [1, 1] expired
    clock.now = 20.5
    assert cache.stats().pinned_tokens == 0 and cache.evict(100) == 2


def _evict_blocks_one_at_a_time(groups: int) -> tuple[PageAllocator, int, float]:
    """The pool of `groups` unshared 100-token prompts (10 blocks each) once every
    block is evicted one per call, the tokens freed, and the Python steps per call."""
    rng = random.Random(0)
    cache, pool = make_hash(page_size=10, num_pages=groups * 10 + 10)
    for group in range(groups):
        put(cache, pool, [group] + [rng.randrange(50_000) for _ in range(99)])
    assert cache.stats().cached_tokens == groups * 100
    calls = groups * 10
    freed, steps = count_steps(lambda: sum(cache.evict(1) for _ in range(calls)))
    return pool, freed, steps / calls


def test_evicting_10k_blocks_from_100k_tokens_is_fast() -> None:
    # 10k blocks against a quarter as many: each call takes the LRU queue's head, O(1), so the
    # work per call (Python lines and calls run) may not grow with the cache. A scan for the
    # oldest block would make it grow ~4x from n to 4n.
    pool, freed, per_call = _evict_blocks_one_at_a_time(1_000)
    assert freed == 100_000 and pool.free_slots == pool.num_slots
    *_, per_call_quarter = _evict_blocks_one_at_a_time(250)
    assert per_call < 1.5 * per_call_quarter, (per_call_quarter, per_call)
