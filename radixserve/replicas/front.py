"""The ingress's side of the replicas: the server's engine front (`server.front.EngineFront`)
over a Ray Serve deployment handle, and the per-replica view /metrics reads.

Each prompt is tokenized and validated here, once; its block hashes go with it so the router
scores replicas without touching the text. A replica that dies mid-request: a request that
has yielded nothing yet, or whose caller keeps only the final output (non-streaming), runs
again on another replica, once; a stream that has sent output ends with an error instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

from radixserve.cache.base import CacheStats
from radixserve.engine.background_prefill import BackgroundPrefillStats
from radixserve.engine.engine import PoolStats
from radixserve.engine.limits import EngineLimits
from radixserve.engine.speculative.stats import SpeculationCounters
from radixserve.engine.structured_output import GrammarCompiler
from radixserve.kv_events import block_hashes
from radixserve.kv_tier.store import TierCounters, TierStats
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.outputs import RequestOutput
from radixserve.replicas.job import ReplicaFacts, ReplicaJob, TextJob
from radixserve.replicas.registry import router_for
from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import APIError
from radixserve.server.observability.metrics import EngineSnapshot

logger = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
# One retry: a second death in a row is more likely the request than the replicas.
MAX_ATTEMPTS = 2


def replica_lost() -> APIError:
    return APIError(503, "The replica serving this request stopped; retry the request.",
                    code="replica_lost", headers={"retry-after": "1"})


class ReplicaDirectory:
    """The replicas as the ingress's router knows them (`server.context.ReplicaView`)."""

    def __init__(self, ingress_key: str) -> None:
        self.ingress_key = ingress_key

    def router(self) -> Any | None:
        return router_for(self.ingress_key)

    def _replicas(self) -> dict[str, Any]:
        router = router_for(self.ingress_key)
        if router is None:
            return {}
        return {rid.unique_id: r for rid, r in router.curr_replicas.items()}

    def count(self) -> int | None:
        """Live replicas; None before the router exists (before the first call)."""
        router = router_for(self.ingress_key)
        return None if router is None else len(router.curr_replicas)

    async def snapshots(self) -> dict[str, EngineSnapshot]:
        """Each live replica's engine snapshot, asked of its actor now (the same call Serve
        polls every request_routing_stats_period_s); a replica that does not answer within
        `SNAPSHOT_TIMEOUT_S` gets its last polled one."""
        replicas = self._replicas()

        async def ask(replica: Any) -> dict[str, Any]:
            try:
                # Serve's replica actor serves our record_routing_stats to anyone holding its
                # handle; the wrapper keeps that handle private, hence the attribute.
                call = replica._actor_handle.record_routing_stats.remote()
                return await asyncio.wait_for(call, SNAPSHOT_TIMEOUT_S)
            except Exception:  # a dying or busy replica: its last polled stats will do
                return replica.routing_stats or {}

        stats = await asyncio.gather(*(ask(r) for r in replicas.values()))
        return {name: snapshot_from_dict(s["snapshot"])
                for name, s in zip(replicas, stats, strict=True) if "snapshot" in s}

    def describe(self) -> list[dict[str, Any]]:
        """Each replica: id, KV-event endpoints, pid, queue as last reported, and the requests
        the router counts in flight there (the load it routes by)."""
        router = router_for(self.ingress_key)
        out = []
        for name, replica in sorted(self._replicas().items()):
            meta, stats = replica.replica_metadata, replica.routing_stats or {}
            out.append({"replica": name, "kv_events": meta.get("kv_events"),
                        "kv_replay": meta.get("kv_replay"), "block_size": meta.get("block_size"),
                        "pid": meta.get("pid"), "node_id": replica.node_id,
                        "running": stats.get("running"), "waiting": stats.get("waiting"),
                        "routed_in_flight": router.loads.of(replica.replica_id)})
        return out

    def route_cost(self) -> tuple[int, float]:
        """(requests routed, seconds spent choosing) by this ingress's router."""
        router = router_for(self.ingress_key)
        if router is None:
            return 0, 0.0
        return router.routed, router.route_seconds


def snapshot_from_dict(d: dict[str, Any]) -> EngineSnapshot:
    tier = d.get("tier")
    background = d.get("background_prefill")
    return EngineSnapshot(
        pool=PoolStats(**d["pool"]), cache=CacheStats(**d["cache"]),
        num_running=d["num_running"], num_waiting=d["num_waiting"],
        prefix_cache_queries=d["prefix_cache_queries"], prefix_cache_hits=d["prefix_cache_hits"],
        computed_prompt_tokens=d["computed_prompt_tokens"], preemptions=d["preemptions"],
        kv_tier_hits=d["kv_tier_hits"],
        tier=None if tier is None else TierStats(
            **{**tier, "counters": TierCounters(**tier["counters"])}),
        speculation=SpeculationCounters(**d["speculation"]),
        background_prefill=None if background is None else BackgroundPrefillStats(**background),
    )


class ReplicaFront:
    """`EngineFront` over the deployment. `handle` is the replicas' DeploymentHandle."""

    def __init__(self, handle: Any, facts: ReplicaFacts, tokenizer: ChatTokenizer,
                 directory: ReplicaDirectory, with_text: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 background_prefill: bool = False) -> None:
        self._handle = handle.options(stream=True)
        self._calls = handle  # unary methods
        self._background_prefill = background_prefill
        self.facts = facts
        self._tokenizer = tokenizer
        self._grammars = GrammarCompiler(tokenizer)
        self._limits = EngineLimits(facts.vocab_size, facts.max_model_len, facts.kv_capacity,
                                    facts.family)
        self.directory = directory
        self._with_text = with_text  # jobs carry their text (Ray's character-level router)
        self._clock = clock
        self._streams: dict[str, Any] = {}
        self._pending: set[asyncio.Task[None]] = set()  # the loop holds tasks only weakly
        self.retries = 0

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def grammars(self) -> GrammarCompiler:
        return self._grammars

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def alive(self) -> bool:
        count = self.directory.count()
        return count is None or count > 0

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        self._limits.check(ids, params, self._grammars)

    def job(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
            namespace: Hashable, options: dict[str, Any],
            affinity: str | None = None) -> ReplicaJob:
        size = self.facts.block_size
        hashes = tuple(block_hashes(prompt_ids, namespace, size))
        if self._with_text:
            return TextJob(request_id, prompt_ids, params, namespace, options, hashes, size,
                           affinity,
                           prompt=self._tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return ReplicaJob(request_id, prompt_ids, params, namespace, options, hashes, size,
                          affinity)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str,
        namespace: Hashable = None, *, replayable: bool = False, affinity: str | None = None,
        **options: Any,
    ) -> AsyncIterator[RequestOutput]:
        # The routes have validated it (`check_prompt`); the replica's engine checks again.
        if isinstance(prompt, str):
            prompt = self._tokenizer.encode(prompt)
        job = self.job(list(prompt), params, request_id, namespace, options, affinity)
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        sent = False
        for attempt in range(1, MAX_ATTEMPTS + 1):
            stream = self._handle.generate.remote(job)
            self._streams[request_id] = stream
            finished = False
            try:
                async for output in stream:
                    sent = True
                    finished = output.finished
                    yield output
                return
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                if attempt == MAX_ATTEMPTS or (sent and not replayable):
                    logger.warning("request %s: its replica stopped (%s); failing it",
                                   request_id, type(exc).__name__)
                    raise replica_lost() from exc
                self.retries += 1
                # Its replica may have been the one it was bound to: any live one will do now.
                job = dataclasses.replace(job, affinity=None)
                logger.warning("request %s: its replica stopped (%s); running it on another",
                               request_id, type(exc).__name__)
            finally:
                self._streams.pop(request_id, None)
                if not finished:
                    stream.cancel()

    @property
    def background_prefill(self) -> bool:
        return self._background_prefill

    def prefill_in_background(self, token_ids: list[int], namespace: Hashable = None,
                              affinity: str | None = None) -> None:
        """Sends a next turn's history to the replica that served the turn (`affinity`; any
        other would hold none of it) for an idle-time prefill there. Fire and forget: a
        replica that is gone loses a prefill, never a request."""
        job = self.job(token_ids, SamplingParams(max_tokens=0), f"next-turn-{uuid.uuid4().hex}",
                       namespace, {}, affinity)
        reply = self._calls.prefill_in_background.remote(job)
        task = asyncio.get_running_loop().create_task(self._settle_call(reply))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    @staticmethod
    async def _settle_call(reply: Any) -> None:
        try:
            await reply
        except Exception:  # noqa: BLE001 - the replica left; the next turn is served anyway
            logger.debug("a next-turn prefill was not delivered", exc_info=True)

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    async def flush(self) -> None:
        """Nothing to wait for: an abort is the stream's cancellation, which Ray delivers to
        the replica itself (whose engine applies it within a step)."""

    async def run(self, fn: Callable[..., Any]) -> Any:
        raise NotImplementedError("replicas run no function from the ingress: there is no "
                                  "one engine to run it on")

    def shutdown(self) -> None:
        for stream in list(self._streams.values()):
            stream.cancel()
        self._streams.clear()
