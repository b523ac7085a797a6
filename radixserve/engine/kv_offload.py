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
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.engine.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.kv_tier.blocks import chain_keys
from radixserve.kv_tier.entry import EntryError, EntryHeader
from radixserve.kv_tier.store import TierStore
from radixserve.sequences import namespace_bytes

logger = logging.getLogger(__name__)

NOT_PINNED = -math.inf


@dataclass(frozen=True)
class LoadResult:
    end: int  # the request's KV is valid up to this position (at least where the load began)
    loaded_tokens: int
    # The longest loaded prefix whose blocks are all under a live pin (0: none), and when the
    # first of those pins ends, on the engine's clock.
    pinned_end: int
    pinned_until: float


class TierLoad:
    """One request's load in flight; `cancel` stops it at the next block."""

    def __init__(self, future: concurrent.futures.Future[LoadResult]) -> None:
        self.future = future
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class KVOffload:
    """The scheduler's view of the tier (see `KVTier` in tier_loads.py)."""

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
        self.device = layer.k.device
        self.block_shape = (self.num_layers, 2, self.num_kv_heads, block_tokens, self.head_dim)
        self.block_bytes = math.prod(self.block_shape) * layer.k.element_size()
        self._fingerprint = store.fingerprint.digest
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "kv-tier-loader")
        # Hints have a thread of their own, so a burst of them never delays a load.
        self._prefetcher = concurrent.futures.ThreadPoolExecutor(1, "kv-tier-prefetch")
        self._closed = False
        # Block buffers the writer has finished with (list append/pop are atomic).
        self._spare: list[torch.Tensor] = []
        self._pool_bytes: list | None = None  # the loader thread's views of the pool

    # ----- keys -----

    def keys(self, request: Request, tokens: int) -> list[bytes]:
        """Keys of the request's full blocks within its first `tokens` tokens."""
        have = request.tier_keys
        blocks = tokens // self.block_tokens
        if len(have) < blocks:
            # The engine's namespace is (model, tenant): the model is in the fingerprint.
            request.tier_keys = have = chain_keys(
                self._fingerprint, namespace_bytes(request.namespace[1]),
                request.token_ids[: blocks * self.block_tokens], self.block_tokens, have)
        return have[:blocks]

    # ----- writes -----

    def write_through(self, request: Request, end: int) -> None:
        """Queues the blocks that the request's cached KV (`end` tokens) now completes."""
        keys = self.keys(request, end)
        first, request.tier_blocks_done = request.tier_blocks_done, max(request.tier_blocks_done,
                                                                        len(keys))
        missing = []
        for j in range(first, len(keys)):
            if self.store.contains(keys[j]):
                # Used again (from the pool): keep it late in the tier's LRU too, or the
                # hottest prefixes, never read back from disk, would be the first to go.
                self.store.touch(keys[j])
            else:
                missing.append(j)
        self._write(request, missing, forced=False)

    def pin(self, request: Request, end: int, expires_at: float) -> None:
        """Pins the blocks of the request's first `end` tokens (cached in the pool) until the
        engine-clock time `expires_at`, writing any the tier lacks: a pinned prefix must
        survive a crash."""
        keys = self.keys(request, end)
        missing = [j for j, key in enumerate(keys) if not self.store.contains(key)]
        self._write(request, missing, forced=True)
        self.store.pin(keys, self.store.wall_clock() + (expires_at - self.clock()))

    def _write(self, request: Request, blocks: list[int], forced: bool) -> None:
        """Copies the blocks out of the pool now (the slots may be reused as soon as the
        step ends) into buffers the writer hands back after writing, so after the first few
        writes a copy costs a memcpy, with no allocation and no page faults."""
        if not blocks or not self.store.writable:
            return
        if not forced and not self.store.has_room(len(blocks) * self.block_bytes):
            self.store.count_dropped(len(blocks))
            return
        size, keys, now = self.block_tokens, request.tier_keys, self.store.wall_clock()
        for j in blocks:
            header = EntryHeader(
                key=keys[j].hex(),
                parent=(keys[j - 1] if j else self._fingerprint).hex(),
                fingerprint=self.store.fingerprint_hex,
                namespace=namespace_bytes(request.namespace[1]).decode(),
                start=j * size,
                tokens=tuple(request.token_ids[j * size : (j + 1) * size]),
                dtype=str(self.dtype).removeprefix("torch."),
                shape=self.block_shape,
                created=now,
            )
            buffer = self._copy_out(request.slots[j * size : (j + 1) * size])
            self.store.put(keys[j], header, functools.partial(_as_bytes, buffer),
                           self.block_bytes, forced=forced,
                           on_done=functools.partial(self._spare.append, buffer))

    def _copy_out(self, slots: list[int]) -> torch.Tensor:
        """One block's K/V ([layers, 2, heads, tokens, dim]) in a buffer of its own."""
        try:
            out = self._spare.pop()
        except IndexError:
            out = torch.empty(self.block_shape, dtype=self.dtype)
        first = _run_start(slots)
        index = None if first is not None else torch.tensor(slots, dtype=torch.long,
                                                            device=self.device)
        for i, layer in enumerate(self.pool.layers):
            for kv, source in enumerate((layer.k, layer.v)):
                if index is None:
                    out[i, kv].copy_(source[:, first : first + len(slots)])
                else:
                    out[i, kv].copy_(source.index_select(1, index))
        return out

    # ----- reads -----

    def prefetch(self, request: Request, matched: int) -> None:
        """Starts reading the blocks the tier holds beyond the pool's match into the page
        cache, so the load at admission reads memory, not disk."""
        keys = self.keys(request, request.num_tokens - 1)
        first = matched // self.block_tokens
        run = self.store.run_length(keys, first)
        for key in keys[first : first + run]:
            self._prefetcher.submit(self.store.advise, key)

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
        dtype_name = str(self.dtype).removeprefix("torch.")
        end = matched
        pinned_end, pinned_until = 0, math.inf
        for j in blocks:
            if load.cancelled:
                break
            skip = max(0, matched - j * size)  # positions the pool already had
            block_slots = slots[j * size + skip : (j + 1) * size]
            try:
                header, payload = self.store.read(
                    keys[j], functools.partial(self._pool_targets, block_slots, skip))
                if header.shape != self.block_shape or header.dtype != dtype_name:
                    raise EntryError("foreign", f"block {header.key[:12]} has shape "
                                     f"{header.shape} {header.dtype}")
            except EntryError:
                break  # computed instead, from here on
            if payload is not None:  # not read in place: copy it over
                self._copy_in(payload, skip, block_slots)
            end = (j + 1) * size
            pin = self.store.pinned_until(keys[j])
            if pin != NOT_PINNED and pinned_end == j * size:  # pins cover prefixes: no gaps
                pinned_end, pinned_until = end, min(pinned_until, pin)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # in the pool before use
        loaded = max(end - matched, 0)
        if loaded:
            self.store.record_load(time.perf_counter() - started)
        if pinned_end:  # the wall-clock expiry, on the engine's clock
            pinned_until = self.clock() + (pinned_until - self.store.wall_clock())
        else:
            pinned_until = NOT_PINNED
        return LoadResult(end=max(end, matched), loaded_tokens=loaded, pinned_end=pinned_end,
                          pinned_until=pinned_until)

    def _pool_targets(self, slots: list[int], skip: int,
                      header: EntryHeader) -> list[memoryview] | None:
        """Where in the pool a whole block's file can be read in place: one run of B x dim
        per layer, K/V and head, in the file's order. None unless the block is whole, its
        slots one run in a CPU pool, and its header the shape expected."""
        first = _run_start(slots)
        if (skip or first is None or self.device.type != "cpu"
                or header.shape != self.block_shape
                or header.dtype != str(self.dtype).removeprefix("torch.")):
            return None
        end = first + len(slots)
        return [memoryview(pool[h, first:end]).cast("B") for pool in self._pool_arrays()
                for h in range(self.num_kv_heads)]

    def _pool_arrays(self) -> list[np.ndarray]:
        """numpy views of a CPU pool as bytes ([heads, slots, dim x item size] for each
        layer's K, then V): slicing them costs ~nothing."""
        if self._pool_bytes is None:
            self._pool_bytes = [source.view(torch.uint8).numpy()
                                for layer in self.pool.layers for source in (layer.k, layer.v)]
        return self._pool_bytes

    def _copy_in(self, payload: bytes | bytearray | memoryview, skip: int,
                 slots: list[int]) -> None:
        """Writes a block's K/V ([layers, 2, heads, tokens, dim], from position `skip`) into
        the pool's slots: a plain copy where the slots run contiguously (the allocator's
        usual gift)."""
        first = _run_start(slots)
        if self.device.type == "cpu":
            # numpy, whose copies stay on this thread: a torch copy this large would start an
            # OpenMP team here, and a second team in the process slows every engine step
            # (`async_engine` says why).
            data = np.frombuffer(payload, np.uint8).reshape(
                *self.block_shape[:-1], self.head_dim * self.pool.layers[0].k.element_size())
            data = data[:, :, :, skip:]
            where = slice(first, first + len(slots)) if first is not None else np.asarray(slots)
            for i, pool in enumerate(self._pool_arrays()):
                pool[:, where] = data[i // 2, i % 2]
            return
        data = torch.frombuffer(payload, dtype=self.dtype).view(self.block_shape)
        data = data[:, :, :, skip:].to(self.device)
        if first is not None:
            for i, layer in enumerate(self.pool.layers):
                layer.k[:, first : first + len(slots)].copy_(data[i, 0])
                layer.v[:, first : first + len(slots)].copy_(data[i, 1])
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        for i, layer in enumerate(self.pool.layers):
            layer.k.index_copy_(1, index, data[i, 0])
            layer.v.index_copy_(1, index, data[i, 1])

    def close(self, timeout: float = 30.0) -> None:
        """Stops loading and finishes the queued writes (up to `timeout`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.store.close(timeout)


def _as_bytes(block: torch.Tensor) -> memoryview:
    return memoryview(block.view(torch.uint8).numpy()).cast("B")


def _run_start(slots: list[int]) -> int | None:
    """The first slot when the slots are one contiguous run (then a plain slice of the pool
    covers them), else None."""
    first = slots[0]
    return first if slots == list(range(first, first + len(slots))) else None
