"""Moves KV between the pool and the disk tier: every block a request completes is written
through (copied out in the step, written by the tier's writer thread), and at admission the
blocks a prompt needs beyond the pool's match are loaded into its fresh slots on a loader
thread, while other requests' steps go on.

Write-through (rather than writing at eviction) is what makes the tier restart-safe: a prefix
is on disk within moments of being computed, so a restart, a deploy or a crash loses only the
writes still queued, and evicting from the pool costs nothing. Copying a block out costs about
as much as writing its K/V once more, next to a prefill that cost a full forward pass.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.engine.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.kv_tier.blocks import chain_keys, namespace_text
from radixserve.kv_tier.entry import EntryError, EntryHeader
from radixserve.kv_tier.store import TierStore

logger = logging.getLogger(__name__)

NOT_PINNED = -math.inf


@dataclass(frozen=True)
class LoadResult:
    end: int  # the request's KV is valid up to this position (at least where the load began)
    loaded_tokens: int
    pinned_until: float  # engine clock: the loaded prefix's pin, or NOT_PINNED


class TierLoad:
    """One request's load in flight; `cancel` stops it at the next block."""

    def __init__(self, future: concurrent.futures.Future[LoadResult]) -> None:
        self.future = future
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class KVOffload:
    """The scheduler's view of the tier (see `KVTier` in scheduler.py)."""

    def __init__(self, store: TierStore, pool: KVPool, block_tokens: int,
                 clock: Callable[[], float]) -> None:
        self.store = store
        self.pool = pool
        self.block_tokens = block_tokens
        self.clock = clock
        layer = pool.layers[0]
        self.num_layers = len(pool.layers)
        self.num_kv_heads, _, self.head_dim = layer.k.shape
        self.dtype = layer.k.dtype
        self.block_shape = (self.num_layers, 2, self.num_kv_heads, block_tokens, self.head_dim)
        self.block_bytes = math.prod(self.block_shape) * layer.k.element_size()
        self._fingerprint = store.fingerprint.digest
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "kv-tier-loader")
        self._closed = False

    # ----- keys -----

    def keys(self, request: Request, tokens: int) -> list[bytes]:
        """Keys of the request's full blocks within its first `tokens` tokens."""
        have = request.tier_keys
        blocks = tokens // self.block_tokens
        if len(have) < blocks:
            # The engine's namespace is (model, tenant): the model is in the fingerprint.
            request.tier_keys = have = chain_keys(
                self._fingerprint, namespace_text(request.namespace[1]),
                request.token_ids[: blocks * self.block_tokens], self.block_tokens, have)
        return have[:blocks]

    # ----- writes -----

    def write_through(self, request: Request, end: int) -> None:
        """Queues the blocks that the request's cached KV (`end` tokens) now completes."""
        keys = self.keys(request, end)
        first, request.tier_blocks_done = request.tier_blocks_done, max(request.tier_blocks_done,
                                                                        len(keys))
        self._write(request, [j for j in range(first, len(keys))
                              if not self.store.contains(keys[j])], forced=False)

    def pin(self, request: Request, end: int, expires_at: float) -> None:
        """Pins the blocks of the request's first `end` tokens (cached in the pool) until the
        engine-clock time `expires_at`, writing any the tier lacks: a pinned prefix must
        survive a crash."""
        keys = self.keys(request, end)
        missing = [j for j, key in enumerate(keys) if not self.store.contains(key)]
        self._write(request, missing, forced=True)
        self.store.pin(keys, self.store.wall_clock() + (expires_at - self.clock()))

    def _write(self, request: Request, blocks: list[int], forced: bool) -> None:
        if not blocks or not self.store.writable:
            return
        if not forced and not self.store.has_room(len(blocks) * self.block_bytes):
            self.store.count_dropped(len(blocks))  # not even copied out: the queue is full
            return
        size = self.block_tokens
        slots = [s for j in blocks for s in request.slots[j * size : (j + 1) * size]]
        gathered = self._gather(slots)
        keys = request.tier_keys
        now = self.store.wall_clock()
        for i, j in enumerate(blocks):
            block = gathered[:, :, :, i * size : (i + 1) * size]
            header = EntryHeader(
                key=keys[j].hex(),
                parent=(keys[j - 1] if j else self._fingerprint).hex(),
                fingerprint=self.store.fingerprint_hex,
                namespace=namespace_text(request.namespace[1]),
                start=j * size,
                tokens=tuple(request.token_ids[j * size : (j + 1) * size]),
                dtype=str(self.dtype).removeprefix("torch."),
                shape=self.block_shape,
                created=now,
            )
            self.store.put(keys[j], header, _payload(block), self.block_bytes, forced=forced)

    def _gather(self, slots: list[int]) -> torch.Tensor:
        """[layers, 2, kv heads, len(slots), head dim]: a copy, made now, while the slots
        still hold this KV."""
        index = torch.tensor(slots, dtype=torch.long)
        out = torch.empty((self.num_layers, 2, self.num_kv_heads, len(slots), self.head_dim),
                          dtype=self.dtype)
        for i, layer in enumerate(self.pool.layers):
            torch.index_select(layer.k, 1, index, out=out[i, 0])
            torch.index_select(layer.v, 1, index, out=out[i, 1])
        return out

    # ----- reads -----

    def prefetch(self, request: Request, matched: int) -> None:
        """Starts reading the blocks the tier holds beyond the pool's match into the page
        cache, so the load at admission reads memory, not disk."""
        keys = self.keys(request, request.num_tokens - 1)
        first = matched // self.block_tokens
        run = self.store.run_length(keys, first)
        for key in keys[first : first + run]:
            self._loader.submit(self.store.advise, key)

    def start_load(self, request: Request, matched: int) -> TierLoad | None:
        """Starts loading the blocks the tier holds right after the pool's match (of
        `matched` tokens) into the request's slots, which must be allocated; None when the
        tier holds nothing past the match. At least the newest prompt token stays to compute."""
        keys = self.keys(request, request.num_tokens - 1)
        first = matched // self.block_tokens
        run = self.store.run_length(keys, first)
        if run == 0:
            return None
        load = TierLoad(concurrent.futures.Future())
        blocks = list(range(first, first + run))
        slots = list(request.slots[: (first + run) * self.block_tokens])
        load.future = self._loader.submit(self._load, load, keys, blocks, slots, matched)
        return load

    def _load(self, load: TierLoad, keys: list[bytes], blocks: list[int], slots: list[int],
              matched: int) -> LoadResult:
        started = time.perf_counter()
        size = self.block_tokens
        end = matched
        pinned_until = math.inf
        for j in blocks:
            if load.cancelled:
                break
            try:
                header, payload = self.store.read(keys[j])
                if header.shape != self.block_shape or header.dtype != str(self.dtype).removeprefix(
                        "torch."):
                    raise EntryError("foreign", f"block {header.key[:12]} has shape "
                                     f"{header.shape} {header.dtype}")
            except EntryError:
                break  # computed instead, from here on
            data = torch.frombuffer(payload, dtype=self.dtype).view(self.block_shape)
            skip = max(0, matched - j * size)  # positions the pool already had
            index = torch.tensor(slots[j * size + skip : (j + 1) * size], dtype=torch.long)
            for i, layer in enumerate(self.pool.layers):
                layer.k.index_copy_(1, index, data[i, 0, :, skip:])
                layer.v.index_copy_(1, index, data[i, 1, :, skip:])
            end = (j + 1) * size
            pinned_until = min(pinned_until, self.store.pinned_until(keys[j]))
        loaded = end - matched
        if loaded <= 0 or pinned_until in (math.inf, NOT_PINNED):
            pin = NOT_PINNED
        else:
            pin = self.clock() + (pinned_until - self.store.wall_clock())
        if loaded > 0:
            self.store.record_load(time.perf_counter() - started)
        return LoadResult(end=max(end, matched), loaded_tokens=max(loaded, 0), pinned_until=pin)

    def close(self, timeout: float = 30.0) -> None:
        """Stops loading and finishes the queued writes (up to `timeout`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.store.close(timeout)


def _payload(block: torch.Tensor) -> Callable[[], memoryview]:
    """The block's bytes, made contiguous when the writer asks (on its thread)."""
    def make() -> memoryview:
        return memoryview(block.contiguous().view(torch.uint8).numpy()).cast("B")
    return make
