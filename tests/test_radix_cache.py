"""RadixCache against a brute-force model, plus the behaviours the scheduler relies on.

`PrefixCacheMachine` drives any PrefixCache through simulated requests over a real PageAllocator
and checks it against a dict of cached pages; test_block_hash_cache.py reuses it for "hash" mode.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache import InsertResult, NoCache, PrefixCache, RadixCache, make_prefix_cache
from radixserve.cache.pins import NOT_PINNED
from radixserve.engine.kv_pool import PageAllocator
from tests.support.caches import put
from tests.support.complexity import count_steps

POOL_SLOTS = 48
NAMESPACES = [None, "tenant-a", "tenant-b"]

# A page in the model: (namespace, the tokens from the start up to this page's end).
PageKey = tuple[Hashable, tuple[int, ...]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Request:
    namespace: Hashable
    tokens: tuple[int, ...]
    handle: object
    matched: int  # leading tokens whose slots are the cache's (locked through `handle`)
    slots: list[int]  # the cache's for [0, matched), private after, including a partial page


@dataclass
class CachedPage:
    """One page as the cache holds it, read from its internals."""

    key: PageKey
    slots: list[int]
    lock_count: int
    pinned_until: float


class PrefixCacheMachine(RuleBasedStateMachine):
    """Simulated requests (match, lock, allocate, insert, free duplicates, unlock), evictions,
    pins and a clock, checked after every step against `model`: every cached page, keyed by its
    namespace and full token prefix, with its slots. Evictions are mirrored through `release`."""

    def make_cache(self, page_size: int, max_pinned: int | None) -> PrefixCache:
        return RadixCache(page_size, self._release, clock=self.clock, max_pinned_tokens=max_pinned)

    def cached_pages(self) -> list[CachedPage]:
        """Every page the radix tree holds, by walking it."""
        pages: list[CachedPage] = []
        stack = [(child_key[0], (), node) for child_key, node in self.cache._root.children.items()]
        while stack:
            namespace, prefix, node = stack.pop()
            assert node.alive and node.num_tokens > 0 and node.num_tokens % self.page_size == 0
            for at in range(0, node.num_tokens, self.page_size):
                end = at + self.page_size
                pages.append(
                    CachedPage(
                        (namespace, prefix + node.key[:end]),
                        node.slots[at:end],
                        node.lock_ref,
                        node.pinned_until,
                    )
                )
            stack.extend((namespace, prefix + node.key, c) for c in node.children.values())
        return pages

    @initialize(page_size=st.sampled_from([1, 4]), max_pinned=st.sampled_from([None, None, 8]))
    def setup(self, page_size: int, max_pinned: int | None) -> None:
        self.page_size = page_size
        self.max_pinned = max_pinned
        self.pool = PageAllocator(POOL_SLOTS // page_size, page_size)
        self.clock = FakeClock()
        self.cache = self.make_cache(page_size, max_pinned)
        self.model: dict[PageKey, list[int]] = {}
        self.page_owner: dict[int, PageKey] = {}  # first slot of a cached page -> its key
        self.requests: list[Request] = []
        self.pins: list[tuple[Hashable, tuple[int, ...], float]] = []  # tracked when unbounded
        self.inserted: list[tuple[Hashable, tuple[int, ...]]] = []
        self.released_tokens = 0

    def _release(self, slots: list[int]) -> None:
        size = self.page_size
        for at in range(0, len(slots), size):
            key = self.page_owner.pop(slots[at])
            assert self.model.pop(key) == slots[at : at + size]
        self.released_tokens += len(slots)
        self.pool.release(slots)

    def _draw_key(self, data: st.DataObject) -> tuple[Hashable, tuple[int, ...]]:
        """A namespace and tokens, often sharing a prefix with something inserted before."""
        # Drawn so that Hypothesis's simplest choices mean "reuse the whole key".
        if self.inserted and data.draw(st.integers(0, 3)) < 3:
            namespace, base = data.draw(st.sampled_from(self.inserted))
            if data.draw(st.integers(0, 4)) == 4:
                namespace = data.draw(st.sampled_from(NAMESPACES))
            cut = len(base) - data.draw(st.integers(0, len(base)))
            tokens = base[:cut] + tuple(data.draw(st.lists(st.integers(0, 2), max_size=6)))
        else:
            namespace = data.draw(st.sampled_from(NAMESPACES))
            tokens = tuple(data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=16)))
        return namespace, tokens

    def _expected(self, namespace: Hashable, tokens: tuple[int, ...]) -> tuple[int, list[int]]:
        """The longest cached prefix by brute force over the model."""
        length, slots = 0, []
        while length + self.page_size <= len(tokens):
            page = self.model.get((namespace, tokens[: length + self.page_size]))
            if page is None:
                break
            length += self.page_size
            slots += page
        return length, slots

    def _checked_match(self, namespace: Hashable, tokens: tuple[int, ...]) -> object:
        match = self.cache.match_prefix(namespace, tokens)
        assert (match.length, match.slots) == self._expected(namespace, tokens)
        return match.handle

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        self._checked_match(*self._draw_key(data))

    @rule(data=st.data())
    def serve_request(self, data: st.DataObject) -> None:
        """A request that starts and finishes before the next step: how the cache fills up."""
        if self._start(data):
            self._finish(self.requests.pop(), keep=True)

    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        self._start(data)

    @rule(data=st.data(), keep=st.booleans())
    def finish_request(self, data: st.DataObject, keep: bool) -> None:
        if self.requests:
            self._finish(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))), keep)

    def _start(self, data: st.DataObject) -> bool:
        """Admits a request: match, lock, allocate private pages (evicting for them)."""
        namespace, tokens = self._draw_key(data)
        match = self.cache.match_prefix(namespace, tokens)
        assert (match.length, match.slots) == self._expected(namespace, tokens)
        self.cache.lock(match.handle)
        pages = -(-len(tokens) // self.page_size) - match.length // self.page_size
        shortfall = pages * self.page_size - self.pool.free_slots
        if shortfall > 0:
            self.cache.evict(shortfall)
        if pages * self.page_size > self.pool.free_slots:
            self.cache.unlock(match.handle)  # not admitted
            return False
        private = self.pool.allocate(pages)
        self.requests.append(
            Request(namespace, tokens, match.handle, match.length, match.slots + private)
        )
        return True

    @rule(data=st.data())
    def publish_request(self, data: st.DataObject) -> None:
        """What the scheduler does after a prefill chunk: insert what is computed so far,
        re-point the request at the cache's slots, and move its lock to the new end."""
        if not self.requests:
            return
        req = self.requests[data.draw(st.integers(0, len(self.requests) - 1))]
        result = self._insert(req)
        req.slots[: len(result.slots)] = result.slots
        self.cache.lock(result.handle)
        self.cache.unlock(req.handle)
        req.handle, req.matched = result.handle, len(result.slots)

    def _finish(self, req: Request, keep: bool) -> None:
        """Finishes (keep: insert, free duplicates) or aborts a request, then unlocks."""
        if keep:
            end = len(self._insert(req).slots)
            self.pool.release(req.slots[end:])  # the partial last page stays the caller's
        else:  # aborted: nothing is inserted and every private slot goes back
            self.pool.release(req.slots[req.matched :])
        self.cache.unlock(req.handle)

    def _insert(self, req: Request) -> InsertResult:
        """Inserts a request's tokens, checks the result and frees the request's duplicates."""
        end = len(req.tokens) - len(req.tokens) % self.page_size
        already, _ = self._expected(req.namespace, req.tokens[:end])
        result = self.cache.insert(req.namespace, req.tokens, req.slots)
        assert result.cached_length == already >= req.matched
        assert len(result.slots) == end
        assert result.slots[: req.matched] == req.slots[: req.matched]
        assert result.slots[already:] == req.slots[already:end]  # new pages: the caller's
        for at in range(0, end, self.page_size):
            key = (req.namespace, req.tokens[: at + self.page_size])
            page = result.slots[at : at + self.page_size]
            if at < already:
                assert self.model[key] == page
            else:
                self.model[key] = page
                self.page_owner[page[0]] = key
        self.pool.release([s for s, c in zip(req.slots[:end], result.slots, strict=True) if s != c])
        self.inserted.append((req.namespace, req.tokens))
        return result

    @rule(num_tokens=st.integers(0, 24))
    def evict(self, num_tokens: int) -> None:
        before = self.cache.stats()
        released_before = self.released_tokens
        freed = self.cache.evict(num_tokens)
        after = self.cache.stats()
        assert min(num_tokens, before.evictable_tokens) <= freed <= before.evictable_tokens
        assert freed == self.released_tokens - released_before
        assert after.evictable_tokens == before.evictable_tokens - freed
        assert after.evicted_tokens_total == before.evicted_tokens_total + freed

    @rule(data=st.data(), ttl=st.sampled_from([0.0, 1.0, 2.5, 10.0]))
    def pin(self, data: st.DataObject, ttl: float) -> None:
        namespace, tokens = self._draw_key(data)
        handle = self._checked_match(namespace, tokens)
        length, _ = self._expected(namespace, tokens)
        self.cache.pin(handle, self.clock.now + ttl)
        if self.max_pinned is None:
            self.pins.append((namespace, tokens[:length], self.clock.now + ttl))

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def advance_clock(self, dt: float) -> None:
        self.clock.now += dt

    @precondition(lambda self: len(self.model) >= 12)  # else it would empty the cache too often
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        stats = self.cache.stats()
        assert stats.evictable_tokens == 0
        assert stats.cached_tokens == stats.protected_tokens + stats.pinned_tokens

    @invariant()
    def slots_are_accounted_for(self) -> None:
        stats = self.cache.stats()
        private = [s for r in self.requests for s in r.slots[r.matched :]]
        assert (
            self.pool.free_slots
            + stats.evictable_tokens
            + stats.protected_tokens
            + stats.pinned_tokens
            + len(private)
            == POOL_SLOTS
        )
        cached = [s for page in self.model.values() for s in page]
        assert len(cached) == stats.cached_tokens
        assert stats.inserted_tokens_total - stats.evicted_tokens_total == stats.cached_tokens
        held = cached + private
        assert len(set(held)) == len(held)  # no slot in two places
        assert not any(self.pool._is_free[s // self.page_size] for s in held)  # nor free

    @invariant()
    def cache_holds_exactly_the_model(self) -> None:
        now, stats = self.clock.now, self.cache.stats()  # stats first: it lets pins expire
        pages = self.cached_pages()
        assert {p.key: p.slots for p in pages} == self.model
        for namespace, tokens in self.model:  # prefix-closed: no page without its parent
            assert (
                len(tokens) == self.page_size
                or (namespace, tokens[: -self.page_size]) in self.model
            )
        by_state = {"protected": 0, "pinned": 0, "evictable": 0}
        for page in pages:
            # Exactly the running requests whose matched prefix covers a page hold it.
            namespace, tokens = page.key
            holders = sum(
                r.namespace == namespace
                and len(tokens) <= r.matched
                and r.tokens[: len(tokens)] == tokens
                for r in self.requests
            )
            assert page.lock_count == holders
            assert page.pinned_until == NOT_PINNED or page.pinned_until >= now  # expiry honoured
            state = "protected" if holders else "evictable"
            if not holders and page.pinned_until != NOT_PINNED:
                state = "pinned"
            by_state[state] += self.page_size
        assert by_state == {
            "protected": stats.protected_tokens,
            "pinned": stats.pinned_tokens,
            "evictable": stats.evictable_tokens,
        }
        if self.max_pinned is not None:
            assert stats.pinned_tokens <= self.max_pinned

    @invariant()
    def pinned_paths_survive_until_expiry(self) -> None:
        self.pins = [p for p in self.pins if p[2] >= self.clock.now]
        for namespace, tokens, _ in self.pins:
            assert self._expected(namespace, tokens)[0] == len(tokens)


MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestRadixCacheMachine = PrefixCacheMachine.TestCase
TestRadixCacheMachine.settings = MACHINE_SETTINGS


# Unit tests: the behaviours above, one at a time.


def make_radix(
    page_size: int = 1, num_pages: int = 64, **kwargs: object
) -> tuple[RadixCache, PageAllocator]:
    pool = PageAllocator(num_pages, page_size)
    return RadixCache(page_size, pool.release, **kwargs), pool


def test_split_copies_lock_count() -> None:
    cache, pool = make_radix()
    result = put(cache, pool, [1, 2, 3, 4])
    cache.lock(result.handle)
    match = cache.match_prefix(None, [1, 2, 9])  # ends inside the edge: splits it
    assert match.length == 2 and match.handle is not result.handle
    assert match.handle.lock_ref == 1  # the upper half is held through the lower half
    assert cache.stats().protected_tokens == 4 and cache.stats().nodes == 2
    assert cache.evict(100) == 0
    cache.unlock(result.handle)
    assert cache.stats().evictable_tokens == 4
    assert cache.evict(100) == 4 and pool.free_slots == 64


def test_insert_reports_cached_length_and_the_cache_slots() -> None:
    cache, pool = make_radix()
    first = put(cache, pool, [1, 2, 3])
    mine = pool.allocate(5)
    second = cache.insert(None, [1, 2, 3, 4, 5], mine)
    assert second.cached_length == 3
    assert second.slots == first.slots + mine[3:]  # existing nodes keep their slots
    assert cache.match_prefix(None, [1, 2, 3, 4, 5, 6]).slots == second.slots


def test_only_full_pages_are_cached() -> None:
    cache, pool = make_radix(page_size=4)
    slots = pool.allocate(3)
    result = cache.insert(None, list(range(10)), slots)
    assert (result.cached_length, result.slots) == (0, slots[:8])
    assert cache.match_prefix(None, list(range(7))).length == 4
    assert cache.match_prefix(None, [0, 1, 2, 3, 4, 5, 9, 9]).length == 4  # splits on a page edge
    assert cache.stats().cached_tokens == 8


def test_namespaces_never_share() -> None:
    cache, pool = make_radix()
    put(cache, pool, [1, 2, 3], namespace="a")
    assert cache.match_prefix("b", [1, 2, 3]).length == 0
    assert cache.match_prefix(None, [1, 2, 3]).length == 0
    b = put(cache, pool, [1, 2, 3], namespace="b")
    assert b.cached_length == 0
    assert set(b.slots).isdisjoint(cache.match_prefix("a", [1, 2, 3]).slots)


def test_eviction_is_least_recently_used_first() -> None:
    cache, pool = make_radix()
    a = put(cache, pool, [1, 1])
    put(cache, pool, [2, 2])
    put(cache, pool, [3, 3])
    cache.match_prefix(None, [1, 1])  # a is now the most recent
    assert cache.evict(1) == 2
    assert cache.match_prefix(None, [2, 2]).length == 0  # b went first
    assert cache.evict(1) == 2
    assert cache.match_prefix(None, [3, 3]).length == 0
    assert cache.match_prefix(None, [1, 1]).slots == a.slots


def test_parent_becomes_a_candidate_after_its_children() -> None:
    cache, pool = make_radix()
    put(cache, pool, [1, 2, 3])
    put(cache, pool, [1, 2, 4])  # [1, 2] is now an inner node with two leaves
    assert cache.evict(1) == 1 and cache.evict(1) == 1
    assert cache.match_prefix(None, [1, 2, 3]).length == 2
    assert cache.evict(1) == 2  # the parent, now a leaf
    assert cache.stats().nodes == 0 and pool.free_slots == 64


def test_unlock_below_zero_is_an_error() -> None:
    cache, pool = make_radix()
    result = put(cache, pool, [1, 2])
    cache.lock(result.handle)
    cache.unlock(result.handle)
    with pytest.raises(AssertionError):
        cache.unlock(result.handle)


def test_pin_survives_eviction_until_the_clock_passes_expiry() -> None:
    clock = FakeClock()
    cache, pool = make_radix(clock=clock)
    result = put(cache, pool, [1, 2, 3])
    cache.pin(result.handle, expires_at=10.0)
    assert cache.stats().pinned_tokens == 3 and cache.stats().evictable_tokens == 0
    clock.now = 10.0  # protected until the clock is *past* expiry
    assert cache.evict(100) == 0
    cache.pin(cache.match_prefix(None, [1, 2]).handle, expires_at=20.0)  # re-pin refreshes
    clock.now = 15.0
    assert cache.evict(100) == 1  # the unrefreshed tail expired; [1, 2] is still pinned
    assert cache.stats().pinned_tokens == 2
    clock.now = 20.5
    assert cache.stats().pinned_tokens == 0 and cache.stats().evictable_tokens == 2
    assert cache.evict(100) == 2


def test_pins_yield_the_soonest_to_end_first_and_leaves_first() -> None:
    clock = FakeClock()
    cache, pool = make_radix(clock=clock)
    cache.pin(put(cache, pool, [1, 2, 3]).handle, expires_at=30.0)
    cache.pin(put(cache, pool, [7, 8]).handle, expires_at=10.0)
    cache.pin(cache.match_prefix(None, [1, 2]).handle, expires_at=40.0)  # [1, 2] outlives [3]
    assert cache.stats().pinned_tokens == 5
    assert cache.yield_pins(1) == 2  # [7, 8] ends soonest, and goes whole
    assert cache.stats().pinned_tokens == 3 and cache.evict(100) == 2
    assert cache.yield_pins(1) == 1  # then the leaf [3], before its longer-pinned parent
    assert cache.stats().pinned_tokens == 2 and cache.match_prefix(None, [1, 2, 3]).length == 3
    assert cache.yield_pins(100) == 2 and cache.stats().pinned_tokens == 0
    assert cache.evict(100) == 3 and cache.yield_pins(1) == 0


def test_repin_extends_and_never_shortens() -> None:
    clock = FakeClock()
    cache, pool = make_radix(clock=clock)
    result = put(cache, pool, [1, 2])
    cache.pin(result.handle, expires_at=10.0)
    cache.pin(result.handle, expires_at=5.0)
    clock.now = 7.0
    assert cache.evict(100) == 0 and cache.stats().pinned_tokens == 2


def test_split_copies_the_pin() -> None:
    clock = FakeClock()
    cache, pool = make_radix(clock=clock, max_pinned_tokens=6)
    put(cache, pool, [1, 1, 1, 1])
    cache.pin(cache.match_prefix(None, [1, 1, 1, 1]).handle, expires_at=100.0)
    cache.match_prefix(None, [1, 1, 9])  # splits the pinned edge in two
    assert cache.stats().pinned_tokens == 4
    cache.pin(put(cache, pool, [2, 2, 2]).handle, expires_at=100.0)  # 7 > 6: the old pin yields
    # ...leaf-first: the lower half goes, the upper half (same pin) keeps its place.
    assert cache.stats().pinned_tokens == 5
    assert cache.evict(100) == 2
    assert cache.match_prefix(None, [1, 1, 1, 1]).length == 2
    clock.now = 101.0  # both halves' copies of the pin expire
    assert cache.stats().pinned_tokens == 0
    assert cache.evict(100) == 5


def test_locked_and_pinned_count_once() -> None:
    clock = FakeClock()
    cache, pool = make_radix(clock=clock)
    result = put(cache, pool, [1, 2, 3])
    cache.lock(result.handle)
    cache.pin(result.handle, expires_at=5.0)
    assert (cache.stats().protected_tokens, cache.stats().pinned_tokens) == (3, 0)
    cache.unlock(result.handle)
    assert (cache.stats().protected_tokens, cache.stats().pinned_tokens) == (0, 3)


def test_max_pinned_tokens_makes_the_oldest_pin_yield() -> None:
    clock = FakeClock()
    cache, pool = make_radix(clock=clock, max_pinned_tokens=6)
    first, second, third = (put(cache, pool, [k] * 3) for k in (1, 2, 3))
    cache.pin(first.handle, 100.0)
    cache.pin(second.handle, 100.0)
    assert cache.stats().pinned_tokens == 6
    cache.pin(third.handle, 100.0)  # over the bound: the first pin yields
    assert cache.stats().pinned_tokens == 6
    assert cache.evict(100) == 3
    assert cache.match_prefix(None, [1, 1, 1]).length == 0
    assert cache.match_prefix(None, [3, 3, 3]).length == 3


def test_reset_keeps_only_locked_and_pinned_entries() -> None:
    clock = FakeClock()
    cache, pool = make_radix(clock=clock)
    locked, pinned = put(cache, pool, [1, 1]), put(cache, pool, [2, 2])
    put(cache, pool, [3, 3])
    cache.lock(locked.handle)
    cache.pin(pinned.handle, 1.0)
    cache.reset()
    stats = cache.stats()
    assert (stats.protected_tokens, stats.pinned_tokens, stats.evictable_tokens) == (2, 2, 0)
    assert pool.free_slots == 64 - 4


def _evict_leaves_one_at_a_time(groups: int) -> tuple[int, float]:
    """Tokens freed and Python steps per call when evicting all `groups` * 10 leaves of a tree
    of shared 50-token prefixes with 10 leaves of 5 tokens each, one leaf per call."""
    rng = random.Random(0)
    cache, pool = make_radix(num_pages=groups * 100 + 100)  # room for one insert's duplicates
    for group in range(groups):
        prefix = [group] + [rng.randrange(50_000) for _ in range(49)]
        for leaf in range(10):
            put(cache, pool, prefix + [leaf] * 5)
    assert cache.stats().cached_tokens == groups * 100
    calls = groups * 10
    freed, steps = count_steps(lambda: sum(cache.evict(1) for _ in range(calls)))
    return freed, steps / calls


def test_evicting_10k_leaves_from_a_100k_token_tree_is_fast() -> None:
    # 1,000 shared 50-token prefixes with 10 leaves of 5 tokens each: 100k tokens, 10k leaves,
    # against a tree a quarter that size. Each call must be O(log n), not a tree walk: the work
    # per call (Python lines and calls run, heap records skipped included) may not grow with
    # the tree. A walk or a scan over the leaves would make it grow ~4x from n to 4n.
    freed, per_call = _evict_leaves_one_at_a_time(1_000)
    assert freed >= 50_000
    _, per_call_quarter = _evict_leaves_one_at_a_time(250)
    assert per_call < 1.5 * per_call_quarter, (per_call_quarter, per_call)


def test_make_prefix_cache_modes() -> None:
    pool = PageAllocator(8, 2)
    assert isinstance(make_prefix_cache("radix", 2, pool.release), RadixCache)
    assert make_prefix_cache("hash", 2, pool.release).stores_slots
    assert not make_prefix_cache("off", 2, pool.release).stores_slots
    with pytest.raises(ValueError, match="radix, hash, off"):
        make_prefix_cache("lru", 2, pool.release)


def test_no_cache_keeps_nothing() -> None:
    pool = PageAllocator(8, 2)
    cache = NoCache(page_size=2)
    slots = pool.allocate(3)
    result = cache.insert(None, [1, 2, 3, 4, 5], slots)
    assert (result.cached_length, result.slots) == (0, slots[:4])  # still the caller's
    assert cache.match_prefix(None, [1, 2, 3, 4]).length == 0
    cache.lock(result.handle)
    cache.unlock(result.handle)
    assert cache.evict(10) == 0 and cache.stats().cached_tokens == 0
    pool.release(slots)  # the caller frees its own slots, every one of them
    assert pool.free_slots == 16
