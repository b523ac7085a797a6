"""The radix tree's usage figures (hits, served tokens, last use) and its bounded summary,
against a brute-force model of prefix counts; and the scheduler counting a hit once per
admitted request. No model: fast."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import NoCache, PrefixNode, RadixCache, TreeSummary, make_prefix_cache
from radixserve.config import EngineConfig
from radixserve.engine.kv_pool import PageAllocator
from radixserve.engine.request import Request
from radixserve.engine.scheduler import Scheduler
from radixserve.sampling_params import SamplingParams
from tests.support.scheduling import step

NAMESPACES = [None, "a", "b"]
EVERYTHING = dict(limit=10_000, visit_limit=10_000, first_tokens=10_000)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tree:
    """A RadixCache over a real page allocator, filled as the scheduler fills it."""

    def __init__(self, page_size: int, clock: FakeClock) -> None:
        self.allocator = PageAllocator(8192 // page_size, page_size)
        self.cache = RadixCache(page_size, self.allocator.release, clock=clock)

    def insert(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        slots = self.allocator.allocate(-(-len(tokens) // self.cache.page_size))
        result = self.cache.insert(namespace, tokens, slots)
        duplicates = [s for s, c in zip(slots, result.slots, strict=False) if s != c]
        self.allocator.release(duplicates + slots[len(result.slots):])


def _full_prefixes(summary: TreeSummary) -> dict[int, tuple[int, ...]]:
    """Each reported node's whole token prefix, from its ancestors' edges (first_tokens large)."""
    prefix: dict[int, tuple[int, ...]] = {}
    for node in summary.prefixes:
        above = () if node.parent_id is None else prefix[node.parent_id]
        assert len(above) == node.depth and len(node.first_token_ids) == node.tokens
        prefix[node.node_id] = above + node.first_token_ids
    return prefix


def _best_first(nodes: list[PrefixNode], limit: int) -> list[int]:
    """The brute-force order: best (served, then most recent, then oldest id) among the
    children of what is already shown."""
    children: dict[int | None, list[PrefixNode]] = {}
    for node in nodes:
        children.setdefault(node.parent_id, []).append(node)

    def key(n: PrefixNode) -> tuple[int, float, int]:
        return (-n.served_tokens, n.last_used_s_ago, n.node_id)

    frontier = [(key(n), n) for n in children.get(None, [])]
    heapq.heapify(frontier)
    order: list[int] = []
    while frontier and len(order) < limit:
        _, node = heapq.heappop(frontier)
        order.append(node.node_id)
        for child in children.get(node.node_id, []):
            heapq.heappush(frontier, (key(child), child))
    return order


ops = st.lists(st.tuples(st.sampled_from(["insert", "use", "tick"]), st.sampled_from(NAMESPACES),
                         st.lists(st.integers(0, 3), min_size=0, max_size=12)),
               min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, page_size=st.sampled_from([1, 2]), limit=st.integers(1, 12))
def test_summary_matches_brute_force_counts(ops, page_size: int, limit: int) -> None:
    clock = FakeClock()
    tree = Tree(page_size, clock)
    cache = tree.cache
    uses: Counter[tuple[Hashable, tuple[int, ...]]] = Counter()  # (ns, page-end prefix) -> uses
    last_use: dict[tuple[Hashable, tuple[int, ...]], float] = {}
    for op, namespace, tokens in ops:
        key = tuple(tokens)
        if op == "insert":
            tree.insert(namespace, key)
            aligned = len(key) - len(key) % page_size
            for end in range(page_size, aligned + 1, page_size):
                last_use.setdefault((namespace, key[:end]), clock.now)
        elif op == "use":
            match = cache.match_prefix(namespace, key)
            cache.record_use(match.handle)
            for end in range(page_size, match.length + 1, page_size):
                uses[(namespace, key[:end])] += 1
                last_use[(namespace, key[:end])] = clock.now
        else:
            clock.now += 1.0

    full = cache.top_prefixes(**EVERYTHING)
    prefixes = _full_prefixes(full)
    assert full.nodes == len(full.prefixes) and not full.truncated
    # Every cached page appears in exactly one node, with that node's counts.
    covered = set()
    for node in full.prefixes:
        whole = prefixes[node.node_id]
        for end in range(node.depth + page_size, node.depth + node.tokens + 1, page_size):
            page = (node.namespace, whole[:end])
            assert page not in covered
            covered.add(page)
            assert uses[page] == node.hits
            assert clock.now - last_use[page] == node.last_used_s_ago
        assert node.served_tokens == node.hits * node.tokens
        assert node.locks == 0 and node.pinned_for_s is None
    assert covered == set(last_use)

    # The capped summary is the brute-force best-first prefix of the full tree.
    capped = cache.top_prefixes(limit=limit, visit_limit=10_000)
    assert [n.node_id for n in capped.prefixes] == _best_first(list(full.prefixes), limit)
    assert capped.truncated == (len(full.prefixes) > limit)
    assert all(len(n.first_token_ids) == min(16, n.tokens) for n in capped.prefixes)

    # A namespace filter shows exactly that namespace's part of the tree.
    only_a = cache.top_prefixes(visible=lambda ns: ns == "a", **EVERYTHING)
    assert {n.node_id for n in only_a.prefixes} == {
        n.node_id for n in full.prefixes if n.namespace == "a"}


def test_hits_survive_a_split_on_both_parts() -> None:
    clock = FakeClock()
    tree = Tree(1, clock)
    cache = tree.cache
    tree.insert(None, (1, 2, 3, 4))
    for _ in range(3):
        cache.record_use(cache.match_prefix(None, (1, 2, 3, 4)).handle)
    clock.now = 10.0
    cache.record_use(cache.match_prefix(None, (1, 2, 9)).handle)  # splits after (1, 2)
    nodes = {n.first_token_ids: n for n in cache.top_prefixes(**EVERYTHING).prefixes}
    assert nodes[(1, 2)].hits == 4 and nodes[(1, 2)].served_tokens == 8
    assert nodes[(3, 4)].hits == 3 and nodes[(3, 4)].served_tokens == 6
    assert nodes[(1, 2)].last_used_s_ago == 0.0 and nodes[(3, 4)].last_used_s_ago == 10.0
    assert nodes[(3, 4)].parent_id == nodes[(1, 2)].node_id and nodes[(3, 4)].depth == 2


def test_lookups_without_record_use_count_nothing_and_locks_and_pins_show() -> None:
    clock = FakeClock()
    tree = Tree(1, clock)
    cache = tree.cache
    tree.insert("a", (5, 6, 7))
    match = cache.match_prefix("a", (5, 6, 7))
    cache.lock(match.handle)
    cache.pin(match.handle, expires_at=30.0)
    (node,) = cache.top_prefixes(**EVERYTHING).prefixes
    assert (node.hits, node.locks, node.pinned_for_s, node.namespace) == (0, 1, 30.0, "a")
    clock.now = 31.0
    cache.unlock(match.handle)
    (node,) = cache.top_prefixes(**EVERYTHING).prefixes
    assert (node.locks, node.pinned_for_s) == (0, None)


def test_a_wide_node_is_cut_to_its_most_recently_used_children() -> None:
    clock = FakeClock()
    tree = Tree(1, clock)
    cache = tree.cache
    shared = tuple(range(1000, 1010))
    for i in range(500):
        tree.insert(None, shared + (i, i))
    cache.record_use(cache.match_prefix(None, shared + (7, 7)).handle)  # old, but used last
    summary = cache.top_prefixes(limit=64, visit_limit=51)
    shown = [n.first_token_ids for n in summary.prefixes]
    assert shown[:2] == [shared, (7, 7)] and summary.truncated
    # Looked at 1 + 50 nodes: the shared prefix, the used child, then the 49 newest others.
    assert len(shown) == 51 and set(shown[2:]) == {(i, i) for i in range(451, 500)}


def test_caches_without_a_tree_summarise_empty() -> None:
    assert NoCache(1).top_prefixes(64, 1000) == TreeSummary(0, (), False)
    allocator = PageAllocator(64, 4)
    cache = make_prefix_cache("hash", 4, allocator.release)
    cache.insert(None, list(range(8)), allocator.allocate(2))
    cache.record_use(cache.match_prefix(None, list(range(8))).handle)
    assert cache.top_prefixes(64, 1000) == TreeSummary(2, (), False)


def _scheduler(pool_tokens: int = 4096, **settings) -> Scheduler:
    config = EngineConfig(show_progress=False, **settings)
    allocator = PageAllocator(pool_tokens // config.page_size, config.page_size)
    clock = FakeClock()
    cache = make_prefix_cache(config.prefix_cache, config.page_size, allocator.release, clock=clock)
    return Scheduler(config, allocator, cache, clock)


def _run(scheduler: Scheduler, requests: list[Request]) -> None:
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        step(scheduler)


def test_scheduler_counts_one_hit_per_admitted_request() -> None:
    # lpm looks every waiting request up on every step to order the queue: none of those count.
    scheduler = _scheduler(schedule_policy="lpm", max_num_seqs=1)
    rng = random.Random(0)
    shared = [rng.randrange(100, 9000) for _ in range(64)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    requests = [Request(f"r{i}", shared + [rng.randrange(100, 9000) for _ in range(5)], params)
                for i in range(6)]
    _run(scheduler, requests[:1])
    _run(scheduler, requests[1:])  # wait in the queue behind each other, looked up each step
    summary = scheduler.cache.top_prefixes(**EVERYTHING)
    (top,) = [n for n in summary.prefixes if n.parent_id is None]
    assert top.tokens == 64 and top.hits == 5  # the first request computed it: no hit
    # Served tokens over the tree are the engine's hit counter, token for token.
    assert sum(n.served_tokens for n in summary.prefixes) == scheduler.counters.prefix_cache_hits
    assert scheduler.counters.prefix_cache_hits == sum(r.num_cached_tokens for r in requests)


def test_a_preempted_request_is_not_counted_again() -> None:
    # Room for two growing requests, three admitted: decode growth preempts one, which is
    # admitted a second time (and matches again).
    scheduler = _scheduler(pool_tokens=64, page_size=4, max_num_batched_tokens=64)
    calls: list[object] = []
    record_use = scheduler.cache.record_use
    scheduler.cache.record_use = lambda handle: (calls.append(handle), record_use(handle))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    requests = [Request(f"r{i}", list(range(100 * i, 100 * i + 10)), params) for i in range(3)]
    _run(scheduler, requests)
    assert scheduler.counters.preemptions > 0
    assert len(calls) == 3
