"""Block-hash prefix cache ("hash" mode, vLLM style): full blocks of `page_size` tokens keyed by
a chained hash, per-block reference counts, and an O(1) LRU queue of unreferenced blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.base import (
    CacheHandle,
    InsertResult,
    MatchResult,
    Namespace,
    ReleaseFn,
    TreeSummary,
)
from radixserve.cache.pins import NOT_PINNED, PinnableEntry
from radixserve.cache.slot_cache import SlotCache

# (parent block's hash, this block's tokens, namespace) -> this block's hash.
BlockHashFn = Callable[[int, tuple[int, ...], Namespace], int]

_CHAIN_START = 0  # the "parent hash" of a chain's first block


def chained_block_hash(parent_hash: int, tokens: tuple[int, ...], namespace: Namespace) -> int:
    """Python's tuple hash: fast, and collisions are harmless because every hit is verified."""
    return hash((parent_hash, tokens, namespace))


@dataclass(eq=False, slots=True)
class _Block(PinnableEntry):
    hash: int
    tokens: tuple[int, ...]
    slots: list[int] = field(repr=False)
    parent: _Block | None = field(repr=False)
    namespace: Namespace
    depth: int  # position in its chain, from 1
    ref_count: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class BlockHashCache(SlotCache[_Block]):
    """Hash-chained full blocks; see PrefixCache in base.py for the contract.

    A handle is the last block of a chain (None for an empty one); lock/unlock/pin walk the chain
    through parent links. A hit compares the stored tokens, namespace and parent block, so a hash
    collision can only cost a miss, never wrong KV. Every cached block is in exactly one state:
    referenced (ref_count > 0), pinned, or queued in `_free` for eviction in LRU order.

    Blocks enter `_free` (and are refreshed there) deepest first, so a parent always queues behind
    its children and is evicted after them: no cached block is ever left without its parent.
    """

    def __init__(self, page_size: int, release: ReleaseFn,
                 clock: Callable[[], float] = time.monotonic, max_pinned_tokens: int | None = None,
                 hash_fn: BlockHashFn = chained_block_hash) -> None:
        super().__init__(page_size, release, clock, max_pinned_tokens)
        self._hash_fn = hash_fn
        # A list per hash, because distinct blocks may collide; almost always one long.
        self._table: dict[int, list[_Block]] = {}
        self._free: OrderedDict[_Block, None] = OrderedDict()  # unreferenced, unpinned; LRU first
        self._num_blocks = self._num_referenced = 0

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchResult:
        chain = self._lookup(namespace, tokens)
        self._touch(chain)
        slots = [s for block in chain for s in block.slots]
        return MatchResult(length=len(slots), slots=slots, handle=chain[-1] if chain else None)

    def insert(
        self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int]
    ) -> InsertResult:
        size = self.page_size
        end = len(tokens) - len(tokens) % size
        if len(slots) < end:
            raise ValueError(f"{len(slots)} slots for {end} page-aligned tokens")
        chain = self._lookup(namespace, tokens[:end])
        cached = len(chain) * size
        parent = chain[-1] if chain else None
        new: list[_Block] = []
        for start in range(cached, end, size):
            block_slots = list(slots[start : start + size])
            if block_slots[0] % size:
                raise ValueError("slots must come in whole pages, as the allocator hands them out")
            block_tokens = tuple(tokens[start : start + size])
            parent_hash = parent.hash if parent else _CHAIN_START
            block = _Block(
                hash=self._hash_fn(parent_hash, block_tokens, namespace),
                tokens=block_tokens,
                slots=block_slots,
                parent=parent,
                namespace=namespace,
                depth=start // size + 1,
            )
            self._table.setdefault(block.hash, []).append(block)
            new.append(block)
            parent = block
        for block in reversed(new):  # deepest first: see the class docstring
            self._free[block] = None
        self._touch(chain)
        self._num_blocks += len(new)
        self._inserted_total += len(new) * size
        slots_out = [s for block in chain for s in block.slots] + list(slots[cached:end])
        return InsertResult(cached_length=cached, slots=slots_out, handle=parent)

    def lock(self, handle: CacheHandle | None) -> None:
        for block in self._chain(handle):
            if block.ref_count == 0:
                self._num_referenced += 1
                self._free.pop(block, None)
            block.ref_count += 1

    def unlock(self, handle: CacheHandle | None) -> None:
        chain = self._chain(handle)
        # Parents hold at least the last block's count, so checking it checks the chain.
        if chain and chain[0].ref_count <= 0:
            raise AssertionError("unlock without a matching lock")
        for block in chain:  # deepest first
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_referenced -= 1
                if block.pinned_until == NOT_PINNED:
                    self._free[block] = None

    def record_use(self, handle: CacheHandle | None) -> None:
        pass  # no per-block hit counts: flat hashed blocks make no tree to show

    def top_prefixes(
        self, limit: int, visit_limit: int,
        visible: Callable[[Namespace], bool] | None = None, first_tokens: int = 16,
    ) -> TreeSummary:
        return TreeSummary(nodes=self._num_blocks, prefixes=(), truncated=False)

    def _pin_path(self, handle: CacheHandle | None) -> list[_Block]:
        if handle is None or not self._block(handle).alive:
            return []
        return self._chain(handle)

    def _pin_entry(self, entry: _Block, expires_at: float, seq: int) -> None:
        self._free.pop(entry, None)
        self._pins.pin(entry, expires_at, seq)

    def evict(self, num_tokens: int) -> int:
        self._expire_pins(self._clock())
        freed = 0
        while freed < num_tokens and self._free:
            block, _ = self._free.popitem(last=False)
            bucket = self._table[block.hash]
            bucket.remove(block)
            if not bucket:
                del self._table[block.hash]
            self._release(block.slots)
            block.alive = False
            freed += block.num_tokens
            self._num_blocks -= 1
        self._evicted_total += freed
        return freed

    def _counts(self) -> tuple[int, int, int, int]:
        size = self.page_size
        free, referenced = len(self._free), self._num_referenced
        return (free * size, referenced * size, (self._num_blocks - free - referenced) * size,
                self._num_blocks)

    def _lookup(self, namespace: Namespace, tokens: Sequence[int]) -> list[_Block]:
        """The longest chain of cached full blocks that spells the start of `tokens`."""
        size, chain = self.page_size, []
        parent: _Block | None = None
        for start in range(0, len(tokens) - size + 1, size):
            block_tokens = tuple(tokens[start : start + size])
            block_hash = self._hash_fn(
                parent.hash if parent else _CHAIN_START, block_tokens, namespace
            )
            for block in self._table.get(block_hash, ()):
                if (
                    block.parent is parent
                    and block.tokens == block_tokens
                    and block.namespace == namespace
                ):
                    break
            else:
                break  # a miss ends the chain: nothing after it can hit
            chain.append(block)
            parent = block
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):  # deepest first: see the class docstring
            if block in self._free:
                self._free.move_to_end(block)

    def _unpin(self, block: _Block) -> None:
        self._pins.unpin(block)
        if block.ref_count == 0:
            self._free[block] = None

    def _block(self, handle: CacheHandle | None) -> _Block:
        if not isinstance(handle, _Block):
            raise TypeError(f"not a BlockHashCache handle: {handle!r}")
        return handle

    def _chain(self, handle: CacheHandle | None) -> list[_Block]:
        """The chain ending at `handle`, deepest block first."""
        chain: list[_Block] = []
        block = None if handle is None else self._block(handle)
        if block is not None and not block.alive:
            raise ValueError("handle refers to an evicted block; lock it before relying on it")
        while block is not None:
            chain.append(block)
            block = block.parent
        return chain
