"""Admitted requests whose prefix the disk tier is loading into their slots (the scheduler's
`loading` queue), and the protocols the scheduler sees the tier through (`KVTier`,
implemented by radixserve/engine/kv_offload.py).

A request the tier holds blocks for waits here, its slots allocated and its match locked,
while a loader thread copies them in; other requests' steps go on meanwhile. The scheduler
collects the landed ones at the start of each step. A request that ends while loading leaves
its slots here until the loader lets go of them; a load that fails is simply computed.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterator
from typing import Protocol

from radixserve.engine.kv_pool import PageAllocator
from radixserve.engine.request import Request

logger = logging.getLogger(__name__)


class TierLoadResult(Protocol):
    end: int  # the request's KV is valid up to here
    loaded_tokens: int
    pinned_end: int  # the loaded tokens start a prefix this long under a live pin (0: none)
    pinned_until: float  # when that pin ends, on the scheduler's clock


class TierLoad(Protocol):
    future: concurrent.futures.Future  # resolves to a TierLoadResult

    def cancel(self) -> None: ...


class KVTier(Protocol):
    """What the scheduler asks of the disk tier (radixserve/engine/kv_offload.py)."""

    def prefetch(self, request: Request, matched: int) -> None:
        """A hint, when a request arrives, that its blocks past `matched` will be read."""
        ...

    def start_load(self, request: Request, matched: int) -> TierLoad | None:
        """Starts loading the blocks past the pool's match into the request's slots."""
        ...

    def write_through(self, request: Request, end: int) -> None:
        """The request's first `end` tokens are cached now: queue their new blocks."""
        ...

    def pin(self, request: Request, end: int, expires_at: float) -> None:
        """Pins the request's first `end` tokens in the tier (writing what it lacks)."""
        ...


class TierLoads:
    """The loads in flight, by request (iterating gives the requests), and the slots of
    requests that ended mid-load, held until the loader has let go of them."""

    def __init__(self, tier: KVTier | None, allocator: PageAllocator) -> None:
        self.tier = tier  # None: nothing is ever loaded
        self.allocator = allocator
        self._loads: dict[Request, TierLoad] = {}
        self._abandoned: list[tuple[list[int], TierLoad]] = []

    def __len__(self) -> int:
        return len(self._loads)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._loads)

    @property
    def in_flight(self) -> bool:
        """True while any load runs, including those of requests that have ended."""
        return bool(self._loads or self._abandoned)

    def start(self, request: Request) -> bool:
        """Starts loading the tier's blocks past the request's computed tokens into its slots;
        True where a load is under way (the request then waits here)."""
        if self.tier is None:
            return False
        try:
            load = self.tier.start_load(request, request.num_computed)
        except Exception:  # the tier is an optimisation: never a reason to fail a request
            logger.exception("KV tier: cannot start a load for request %s", request.request_id)
            return False
        if load is None:
            return False
        self._loads[request] = load
        return True

    def abandon(self, request: Request) -> None:
        """Cancels the load of a request that ended: its slots past the cache's leave it and
        wait here for the loader, which may still write them."""
        load = self._loads.pop(request)
        load.cancel()
        self._abandoned.append((request.slots[request.cache_len :], load))
        request.slots = request.slots[: request.cache_len]

    def landed(self) -> list[tuple[Request, TierLoadResult | None]]:
        """The requests whose loads are done, taken out of the queue, each with its result
        (None: the load failed, so everything past the match is computed)."""
        landed: list[tuple[Request, TierLoadResult | None]] = []
        for request, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[request]
            try:
                result = load.future.result()
            except Exception:
                logger.exception("KV tier load failed for request %s", request.request_id)
                result = None
            landed.append((request, result))
        return landed

    def release_abandoned(self) -> None:
        """Gives back the slots of ended requests whose loader has let go of them."""
        still = []
        for slots, load in self._abandoned:
            if load.future.done():
                if slots:
                    self.allocator.release(slots)
            else:
                still.append((slots, load))
        self._abandoned = still

    def wait(self, timeout: float) -> None:
        """Waits until some load lands, at most `timeout` seconds."""
        futures = [load.future for load in self._loads.values()]
        futures += [load.future for _, load in self._abandoned]
        concurrent.futures.wait(futures, timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def abandoned_slots(self) -> int:
        """Slots of ended requests that the loader may still write."""
        return sum(len(slots) for slots, _ in self._abandoned)
