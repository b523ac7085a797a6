"""Radix-tree prefix cache ("radix" mode): token runs, per namespace, to the KV slots holding them.

Token-granular at page_size 1, page-aligned above. Eviction takes unlocked, unpinned leaves in
LRU order from a persistent lazy heap, so each evicted leaf costs O(log n), never a tree walk.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.base import (
    CacheHandle,
    CacheObserver,
    InsertResult,
    MatchResult,
    Namespace,
    ReleaseFn,
)
from radixserve.cache.pins import NOT_PINNED, PinnableEntry
from radixserve.cache.slot_cache import SlotCache
from radixserve.cache.tree_usage import TreeSummary, count_use, summarize


@dataclass(eq=False, slots=True)
class _Node(PinnableEntry):
    key: tuple[int, ...]  # the tokens on the edge into this node
    slots: list[int] = field(repr=False)  # their KV slots
    parent: _Node | None = field(repr=False)
    depth: int  # tokens from the root to this node's end; a split leaves it unchanged
    child_key: Hashable = None  # this node's key in parent.children
    children: dict[Hashable, _Node] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0  # a logical tick, exact where wall clocks tie
    leaf_version: int = 0  # matches the one live record of this node in the leaf heap
    serial: int = 0  # the node's id in summaries
    hits: int = 0  # admitted requests whose match ran through this edge (record_use)
    last_used: float = 0.0  # the clock at the last such request, or when it was cached

    @property
    def num_tokens(self) -> int:
        return len(self.key)


class RadixCache(SlotCache[_Node]):
    """Radix tree over token runs; see PrefixCache in base.py for the contract.

    Only full pages are cached: match and insert lengths are multiples of `page_size`, and a
    partial last page stays the caller's. Children of the root are keyed by (namespace, first
    token or page), so namespaces never share a node. Costs: match/insert O(key length) plus one
    dict lookup per node; lock/unlock/pin/record_use O(depth); evict O(log n) per leaf freed;
    stats O(1) plus the pins that expired since the last call; top_prefixes O(visit_limit).

    `observer`, when set, hears every insert that adds tokens, every evicted leaf (its path
    rebuilt by walking up: O(depth)) and every reset that empties the tree.
    """

    def __init__(self, page_size: int, release: ReleaseFn,
                 clock: Callable[[], float] = time.monotonic,
                 max_pinned_tokens: int | None = None,
                 observer: CacheObserver | None = None) -> None:
        super().__init__(page_size, release, clock, max_pinned_tokens)
        self.observer = observer
        self._root = _Node(key=(), slots=[], parent=None, depth=0)
        self._tick = 0
        self._order = itertools.count()
        self._serials = itertools.count(1)
        # Candidate leaves, least recently used first. Only a node's newest record is live, and
        # only while the node is still an unlocked, unpinned leaf; others are skipped when popped.
        self._leaves: list[tuple[int, int, _Node, int]] = []
        self._evictable = self._protected = self._pinned = 0
        self._nodes = 0

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchResult:
        node, length, slots = self._descend(namespace, self._aligned(tokens))
        return MatchResult(length=length, slots=slots, handle=node)

    def insert(
        self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int]
    ) -> InsertResult:
        key = self._aligned(tokens)
        if len(slots) < len(key):
            raise ValueError(f"{len(slots)} slots for {len(key)} page-aligned tokens")
        node, cached, cache_slots = self._descend(namespace, key)
        new_slots = list(slots[cached : len(key)])
        if self.page_size > 1 and any(s % self.page_size for s in new_slots[:: self.page_size]):
            raise ValueError("slots must come in whole pages, as the allocator hands them out")
        if new_slots:
            leaf = _Node(
                key=key[cached:],
                slots=new_slots,
                parent=node,
                depth=node.depth + len(new_slots),
                child_key=self._child_key(node, namespace, key, cached),
                last_access=self._tick,
                serial=next(self._serials),
                last_used=self._clock(),
            )
            node.children[leaf.child_key] = leaf
            self._nodes += 1
            self._evictable += len(new_slots)
            self._inserted_total += len(new_slots)
            self._push_if_candidate(leaf)
            node = leaf
            if self.observer is not None:
                self.observer.on_insert(namespace, key, cached, len(key))
        return InsertResult(cached_length=cached, slots=cache_slots + new_slots, handle=node)

    def lock(self, handle: CacheHandle | None) -> None:
        node = self._live_node(handle)
        while node is not self._root:
            self._count(node, -1)
            node.lock_ref += 1
            self._count(node, +1)
            node = node.parent

    def unlock(self, handle: CacheHandle | None) -> None:
        node = self._live_node(handle)
        # Ancestors hold at least the handle's count, so checking the handle checks the path.
        if node is not self._root and node.lock_ref <= 0:
            raise AssertionError("unlock without a matching lock")
        while node is not self._root:
            self._count(node, -1)
            node.lock_ref -= 1
            self._count(node, +1)
            self._push_if_candidate(node)
            node = node.parent

    def demote(self, namespace: Namespace, tokens: Sequence[int], keep: int) -> int:
        """Makes the cached run of `tokens` after its first `keep` tokens the first to be
        evicted (older than anything used), for KV computed ahead of need (a background
        prefill); a later match refreshes it like any other. Returns the tokens demoted."""
        node, _, _ = self._descend(namespace, self._aligned(tokens))
        demoted = 0
        while node is not self._root and node.depth - node.num_tokens >= keep:
            node.last_access = -1
            self._push_if_candidate(node)
            demoted += node.num_tokens
            node = node.parent
        return demoted

    def record_use(self, handle: CacheHandle | None) -> None:
        count_use(self._root, self._live_node(handle), self._clock())

    def top_prefixes(
        self, limit: int, visit_limit: int,
        visible: Callable[[Namespace], bool] | None = None, first_tokens: int = 16,
    ) -> TreeSummary:
        now = self._clock()
        self._expire_pins(now)
        return summarize(self._root, self._nodes, now, limit, visit_limit, visible, first_tokens)

    def _pin_path(self, handle: CacheHandle | None) -> list[_Node]:
        node, path = self._node(handle), []
        while node.alive and node is not self._root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        return path

    def _pin_entry(self, entry: _Node, expires_at: float, seq: int) -> None:
        self._count(entry, -1)
        self._pins.pin(entry, expires_at, seq)
        self._count(entry, +1)

    def evict(self, num_tokens: int) -> int:
        self._expire_pins(self._clock())
        freed = 0
        while freed < num_tokens and self._leaves:
            _, _, node, version = heapq.heappop(self._leaves)
            if version != node.leaf_version or not self._is_candidate(node):
                continue
            self._release(node.slots)
            parent = node.parent
            assert parent is not None
            if self.observer is not None:
                namespace, path = self._path(node)
                self.observer.on_evict(namespace, path, node.depth - node.num_tokens, node.depth)
            del parent.children[node.child_key]
            node.alive = False
            freed += node.num_tokens
            self._evictable -= node.num_tokens
            self._nodes -= 1
            self._push_if_candidate(parent)  # a parent left childless is a leaf now
        self._evicted_total += freed
        return freed

    def reset(self) -> None:
        super().reset()
        if self.observer is not None and not self._root.children:
            self.observer.on_reset()

    def _path(self, node: _Node) -> tuple[Namespace, tuple[int, ...]]:
        """The namespace and the tokens from the root to `node`'s end."""
        edges = [node.key]
        while node.parent is not self._root:
            node = node.parent  # type: ignore[assignment]
            edges.append(node.key)
        namespace = node.child_key[0]  # a child of the root is keyed (namespace, first)
        return namespace, tuple(itertools.chain.from_iterable(reversed(edges)))

    def _counts(self) -> tuple[int, int, int, int]:
        return self._evictable, self._protected, self._pinned, self._nodes

    def _aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) - len(tokens) % self.page_size])

    def _child_key(
        self, parent: _Node, namespace: Namespace, key: tuple[int, ...], at: int
    ) -> Hashable:
        first = key[at] if self.page_size == 1 else key[at : at + self.page_size]
        return (namespace, first) if parent is self._root else first

    def _descend(self, namespace: Namespace, key: tuple[int, ...]) -> tuple[_Node, int, list[int]]:
        """Walks `key` down the tree, splitting the edge where the match ends, and stamps the
        path as used. Returns the node ending the match, its length and its slots."""
        self._tick += 1
        node, length, slots = self._root, 0, []
        while length < len(key):
            child = node.children.get(self._child_key(node, namespace, key, length))
            if child is None:
                break
            common = self._common_length(child.key, key, length)
            if common < child.num_tokens:
                child = self._split(child, common)
            child.last_access = self._tick
            slots.extend(child.slots)
            node, length = child, length + common
        self._push_if_candidate(node)  # its access time changed
        return node, length, slots

    def _common_length(self, edge: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
        n = min(len(edge), len(key) - start)
        if edge[:n] == key[start : start + n]:  # the common case, compared in C
            return n
        i = 0
        while edge[i] == key[start + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: _Node, at: int) -> _Node:
        """Cuts `child`'s edge after `at` tokens. The new upper node copies the child's lock count
        and pin: whoever holds the child holds the whole path through it."""
        parent = child.parent
        assert parent is not None
        upper = _Node(
            key=child.key[:at],
            slots=child.slots[:at],
            parent=parent,
            depth=child.depth - child.num_tokens + at,
            child_key=child.child_key,
            lock_ref=child.lock_ref,
            pinned_until=child.pinned_until,
            pin_seq=child.pin_seq,
            serial=next(self._serials),
            hits=child.hits,  # every request through the child ran through the upper part
            last_used=child.last_used,
        )
        parent.children[upper.child_key] = upper
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], upper
        child.child_key = child.key[0] if self.page_size == 1 else child.key[: self.page_size]
        upper.children[child.child_key] = child
        self._nodes += 1
        if upper.pinned_until != NOT_PINNED:
            self._pins.track(upper, adopted=True)
        return upper  # token counts are unchanged: both halves sit in the child's category

    def _count(self, node: _Node, sign: int) -> None:
        """Adds (+1) or removes (-1) a node's tokens from the counter of its current state."""
        if node.lock_ref:
            self._protected += sign * node.num_tokens
        elif node.pinned_until != NOT_PINNED:
            self._pinned += sign * node.num_tokens
        else:
            self._evictable += sign * node.num_tokens

    def _unpin(self, node: _Node) -> None:
        self._count(node, -1)
        self._pins.unpin(node)
        self._count(node, +1)
        self._push_if_candidate(node)

    def _is_candidate(self, node: _Node) -> bool:
        return (
            node.alive
            and node is not self._root
            and not node.children
            and node.lock_ref == 0
            and node.pinned_until == NOT_PINNED
        )

    def _push_if_candidate(self, node: _Node) -> None:
        if not self._is_candidate(node):
            return
        node.leaf_version += 1
        heapq.heappush(self._leaves, (node.last_access, next(self._order), node, node.leaf_version))
        if len(self._leaves) > 2 * self._nodes + 64:  # drop stale records; amortised O(1)
            self._leaves = [
                r for r in self._leaves if r[3] == r[2].leaf_version and self._is_candidate(r[2])
            ]
            heapq.heapify(self._leaves)

    def _node(self, handle: CacheHandle | None) -> _Node:
        if not isinstance(handle, _Node):
            raise TypeError(f"not a RadixCache handle: {handle!r}")
        return handle

    def _live_node(self, handle: CacheHandle | None) -> _Node:
        node = self._node(handle)
        if not node.alive:
            raise ValueError("handle refers to an evicted node; lock it before relying on it")
        return node
