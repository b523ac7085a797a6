"""Ray Serve request routers for the replicas; they run inside the ingress's process.

`PrefixRouter` (the default, `--router prefix`) scores replicas by the longest prefix of the
request's blocks each replica really holds, as its KV events tell (stored, removed, cleared;
namespaces are part of the hashes), then by load:

1. Load is the requests this router has sent a replica and not seen finish. A replica whose
   load exceeds the least loaded one's by more than `imbalance_threshold` (8) is passed over.
2. Among the rest, the longest held prefix wins if it is at least `min_match_tokens` long
   (ties: the less loaded). Otherwise the request goes where load is lowest (ties: random).
3. While a request runs, the router also counts its blocks as held by its replica
   ("provisional"; dropped when it finishes, when its replica's events have shown what it
   really stored, or after `provisional_ttl_s`): concurrent first requests of a new prefix go
   to one replica, so the prefix is computed once in the cluster, not once per replica.

`PowerOfTwoRouter` and `RoundRobinRouter` ignore the cache (baselines, `--router pow2|
round-robin`). Every router sends a job bound to a replica (`ReplicaJob.affinity`: a Responses
API continuation, whose stored tokens its owner holds pinned) to that replica while it lives. Every router registers itself under the ingress's key (`registry`), so the
ingress can read the replicas' routing stats (`front.ReplicaDirectory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.kv_events import BlockIndex, KVEventSubscriber
from radixserve.replicas.job import ReplicaJob
from radixserve.replicas.policy import PrefixRoutingConfig
from radixserve.replicas.registry import register

logger = logging.getLogger(__name__)


def _job(pending: PendingRequest | None) -> ReplicaJob | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, ReplicaJob):
            return arg
    return None


def _owner(candidates: list[RunningReplica],
           pending: PendingRequest | None) -> RunningReplica | None:
    """The live candidate a job is bound to (`ReplicaJob.affinity`: the replica holding the
    stored response it continues), if any: every router sends the job there. Gone (Ray
    restarts a dead replica under a new id), the job is routed as any other."""
    job = _job(pending)
    if job is None or job.affinity is None:
        return None
    return next((r for r in candidates if r.replica_id.unique_id == job.affinity), None)


def _owner_first(candidates: list[RunningReplica],
                 owner: RunningReplica) -> list[list[RunningReplica]]:
    """The owner, then the rest should its queue be full."""
    rest = [r for r in candidates if r is not owner]
    return [[owner], rest] if rest else [[owner]]


class _Loads:
    """Requests in flight per replica, as this router sent them: exact and immediate, where
    Serve's probed queue lengths arrive late. Reserved when chosen (so a burst of requests
    chosen before any is sent spreads out), moved if Serve sends the request elsewhere."""

    def __init__(self) -> None:
        self.count: dict[ReplicaID, int] = {}
        self._held: dict[str, ReplicaID] = {}  # internal request id -> replica counted

    def of(self, replica: ReplicaID) -> int:
        return self.count.get(replica, 0)

    def holds(self, request: str) -> bool:
        return request in self._held

    def hold(self, request: str, replica: ReplicaID) -> None:
        self.release(request)
        self._held[request] = replica
        self.count[replica] = self.of(replica) + 1

    def release(self, request: str) -> None:
        replica = self._held.pop(request, None)
        if replica is not None and replica in self.count:
            self.count[replica] = max(0, self.count[replica] - 1)

    def drop(self, replica: ReplicaID) -> None:
        self.count.pop(replica, None)
        for request in [r for r, rep in self._held.items() if rep == replica]:
            del self._held[request]


class _Provisional:
    """Blocks of requests routed to a replica, until the request finishes (by then the
    replica's events have shown what it really stored) or `ttl_s` passes."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # replica -> request -> (its block hashes as a set, expiry)
        self._routed: dict[ReplicaID, dict[str, tuple[frozenset[int], float]]] = {}
        self._replica_of: dict[str, ReplicaID] = {}

    def add(self, request: str, replica: ReplicaID, hashes: tuple[int, ...], now: float) -> None:
        self.finish(request)
        self._routed.setdefault(replica, {})[request] = (frozenset(hashes), now + self.ttl_s)
        self._replica_of[request] = replica

    def finish(self, request: str) -> None:
        replica = self._replica_of.pop(request, None)
        if replica is not None:
            self._routed.get(replica, {}).pop(request, None)

    def prefix_length(self, replica: ReplicaID, hashes: tuple[int, ...], now: float) -> int:
        """The longest run of leading `hashes` one request routed to `replica` carries."""
        routed = self._routed.get(replica)
        if not routed:
            return 0
        best = 0
        for request, (blocks, expiry) in list(routed.items()):
            if expiry < now:
                self.finish(request)
                continue
            n = 0
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
            best = max(best, n)
        return best

    def drop(self, replica: ReplicaID) -> None:
        for request in self._routed.pop(replica, {}):
            self._replica_of.pop(request, None)


class _Registered(RequestRouter):
    """Registers under the ingress's key; keeps the loads every router reports."""

    def initialize_state(self, ingress_key: str = "", **kwargs: Any) -> None:
        self.ingress_key = ingress_key
        self.loads = _Loads()
        self.route_seconds = 0.0  # cumulative time in choose_replicas
        self.routed = 0
        if ingress_key:
            register(ingress_key, self)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Counts one routing decision and its time (the router's own cost per request)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.route_seconds += time.perf_counter() - started
            self.routed += 1

    def reserve(self, pending: PendingRequest, replica_id: ReplicaID) -> None:
        """Counts `pending` against the replica chosen for it, before Serve assigns it one,
        as `on_request_routed` counts a sent request (its load; the prefix router's, also its
        provisional blocks).

        Serve reports a request it sent only when it finishes (and, with strict queue limits,
        when it is accepted). So the request's future says the rest: assigned to a replica
        other than the one chosen (that one was full), the count moves there; cancelled while
        it waited (its caller left while every replica was full), it was never sent and no
        completion will come, so the count is released here. Serve asks again after each
        backoff: only the first reservation of a future watches it."""
        watched = self.loads.holds(pending.metadata.internal_request_id)
        self.on_request_routed(pending, replica_id, None)
        if not watched:
            pending.future.add_done_callback(functools.partial(self._assigned, pending))

    def _assigned(self, pending: PendingRequest, future: asyncio.Future[Any]) -> None:
        request = pending.metadata.internal_request_id
        if not self.loads.holds(request):
            return  # already finished
        if future.cancelled() or future.exception() is not None:
            self.forget_request(request)
        else:
            self.on_request_routed(pending, future.result().replica_id, None)

    def forget_request(self, internal_request_id: str) -> None:
        """What this router counts for a request that is finished or never sent."""
        self.loads.release(internal_request_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self.loads.hold(pending_request.metadata.internal_request_id, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.forget_request(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.loads.drop(replica_id)


class PrefixRouter(_Registered):
    def initialize_state(self, ingress_key: str = "",
                         imbalance_threshold: int = PrefixRoutingConfig.imbalance_threshold,
                         min_match_tokens: int = PrefixRoutingConfig.min_match_tokens,
                         provisional_ttl_s: float = PrefixRoutingConfig.provisional_ttl_s,
                         **kwargs: Any) -> None:
        super().initialize_state(ingress_key)
        self.config = PrefixRoutingConfig(imbalance_threshold, min_match_tokens,
                                          provisional_ttl_s)
        self.index = BlockIndex()
        self.provisional = _Provisional(provisional_ttl_s)
        self._subscribers: dict[ReplicaID, KVEventSubscriber] = {}
        self._names: dict[str, ReplicaID] = {}  # index source (unique id) -> replica

    # ----- the replica set and its events -----

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id: r for r in replicas}
        for replica_id in [r for r in self._subscribers if r not in live]:
            self._forget(replica_id)
        for replica_id, replica in live.items():
            if replica_id not in self._subscribers:
                self._subscribe(replica_id, replica.replica_metadata)

    def _subscribe(self, replica_id: ReplicaID, metadata: dict[str, Any]) -> None:
        endpoint, replay = metadata.get("kv_events"), metadata.get("kv_replay")
        if not endpoint:
            logger.warning("replica %s publishes no KV events; routing it by load only",
                           replica_id.unique_id)
            return
        source = replica_id.unique_id
        self._names[source] = replica_id
        index = self.index

        def on_batch(seq: int, batch: Any) -> None:
            index.apply(source, batch)

        self._subscribers[replica_id] = KVEventSubscriber(endpoint, replay, on_batch)
        logger.info("router: following replica %s's KV events at %s", source, endpoint)

    def _forget(self, replica_id: ReplicaID) -> None:
        subscriber = self._subscribers.pop(replica_id, None)
        if subscriber is not None:
            subscriber.close()
        self.index.drop(replica_id.unique_id)
        self.provisional.drop(replica_id)
        self._names.pop(replica_id.unique_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Its prefixes leave the index at once: Ray restarts it empty."""
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    # ----- routing -----

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        with self.timed():
            return self._rank(candidate_replicas, pending_request)

    def _rank(self, candidates: list[RunningReplica],
              pending: PendingRequest | None) -> list[list[RunningReplica]]:
        if not candidates:
            return []
        loads = {r.replica_id: self.loads.of(r.replica_id) for r in candidates}
        least = min(loads.values())
        eligible = [r for r in candidates
                    if loads[r.replica_id] - least <= self.config.imbalance_threshold]
        job = _job(pending)
        # A continued response goes to its owner unless that one is passed over for load
        # (a miss there costs the prefix's prefill, as any prefix's would).
        chosen = _owner(eligible, pending)
        if chosen is None and job is not None and job.block_hashes:
            chosen = self._best_match(eligible, job, loads)
        if chosen is None:
            fewest = min(loads[r.replica_id] for r in eligible)
            chosen = random.choice([r for r in eligible if loads[r.replica_id] == fewest])
        if pending is not None:
            self.reserve(pending, chosen.replica_id)  # its load and provisional blocks
        rest = sorted((r for r in candidates if r is not chosen),
                      key=lambda r: loads[r.replica_id])
        return [[chosen], rest] if rest else [[chosen]]

    def _best_match(self, eligible: list[RunningReplica], job: ReplicaJob,
                    loads: dict[ReplicaID, int]) -> RunningReplica | None:
        hashes = job.block_hashes
        held = self.index.prefix_lengths(list(hashes))
        now = time.monotonic()
        best, best_len = None, 0
        for r in eligible:
            n = max(held.get(r.replica_id.unique_id, 0),
                    self.provisional.prefix_length(r.replica_id, hashes, now))
            if n > best_len or (n == best_len and best is not None
                                and loads[r.replica_id] < loads[best.replica_id]):
                best, best_len = r, n
        if best is None or best_len * job.block_size < self.config.min_match_tokens:
            return None
        return best

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        # Serve may send it to another replica than the first choice (a full queue).
        super().on_request_routed(pending_request, replica_id, result)
        job = _job(pending_request)
        if job is not None and job.block_hashes:
            self.provisional.add(pending_request.metadata.internal_request_id, replica_id,
                                 job.block_hashes, time.monotonic())

    def forget_request(self, internal_request_id: str) -> None:
        super().forget_request(internal_request_id)
        self.provisional.finish(internal_request_id)

    def held_tokens(self, hashes: list[int], block_size: int) -> dict[str, int]:
        """Tokens of `hashes`' leading blocks each replica holds, by its KV events only."""
        held = self.index.prefix_lengths(hashes)
        return {rid.unique_id: held.get(rid.unique_id, 0) * block_size
                for rid in self.curr_replicas}

    def __del__(self) -> None:
        for subscriber in getattr(self, "_subscribers", {}).values():
            subscriber.close()


class _Timed(_Registered):
    """Times the choice of the router class after it in the MRO (one of Serve's or Ray's)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        with self.timed():
            owner = _owner(candidate_replicas, pending_request)
            if owner is not None:
                return _owner_first(candidate_replicas, owner)
            return await super().choose_replicas(  # type: ignore[safe-super]
                candidate_replicas, pending_request)


class PowerOfTwoRouter(_Timed, PowerOfTwoChoicesRequestRouter):
    """Serve's own power of two choices, registered for the ingress."""


class RoundRobinRouter(_Registered):
    """Each request to the next replica in turn (a plain load balancer)."""

    def initialize_state(self, ingress_key: str = "", **kwargs: Any) -> None:
        super().initialize_state(ingress_key)
        self._turn = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        with self.timed():
            if not candidate_replicas:
                return []
            owner = _owner(candidate_replicas, pending_request)
            if owner is not None:
                return _owner_first(candidate_replicas, owner)
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            first = next(self._turn) % len(ordered)
            return [[r] for r in ordered[first:] + ordered[:first]]


try:  # Ray's own prefix router lives in an internal module of ray.llm; compared, not relied on
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
except ImportError:  # pragma: no cover - another Ray layout: --router ray-prefix is refused
    PrefixCacheAffinityRouter = None


if PrefixCacheAffinityRouter is not None:

    class RayPrefixRouter(_Timed, PrefixCacheAffinityRouter):
        """Ray's PrefixCacheAffinityRouter (a character tree of what it routed), registered
        for the ingress: the field's answer, measured beside ours in
        benchmarks/bench_replicas.py. Its jobs carry their text (`job.TextJob`)."""

        def initialize_state(self, ingress_key: str = "", **kwargs: Any) -> None:
            _Registered.initialize_state(self, ingress_key)
            PrefixCacheAffinityRouter.initialize_state(self, **kwargs)


def router_class(name: str) -> type[RequestRouter]:
    if name == "ray-prefix":
        if PrefixCacheAffinityRouter is None:
            raise ValueError("this Ray has no PrefixCacheAffinityRouter; --router ray-prefix "
                             "needs ray 2.60")
        return RayPrefixRouter
    return {"prefix": PrefixRouter, "pow2": PowerOfTwoRouter,
            "round-robin": RoundRobinRouter}[name]
