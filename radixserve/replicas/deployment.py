"""One replica: an engine (its own KV pool, radix tree and engine thread) in a Ray Serve
deployment. It publishes its cache's KV events (the router's index) and reports its engine
snapshot as routing stats (the ingress's /metrics)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from radixserve.config import EngineConfig
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import LLMEngine
from radixserve.outputs import RequestOutput
from radixserve.replicas.job import ReplicaFacts, ReplicaJob
from radixserve.server.heap import freeze_warm_heap
from radixserve.server.observability.metrics import take_snapshot
from radixserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

STUCK_STEP_S = ServerSettings().watchdog_exit_s


class EngineReplica:
    """The deployment's class (`launch` wraps it with `serve.deployment`)."""

    def __init__(self, config: EngineConfig, background_prefill: bool = False) -> None:
        from ray import serve
        from ray.util import get_node_ip_address

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Bound on this node's address (free ports), so the endpoints it reports are the ones
        # a router on another node connects to.
        host = get_node_ip_address()
        if config.prefix_cache == "radix":  # the other modes publish nothing
            config = dataclasses.replace(config, kv_events_endpoint=f"tcp://{host}:0",
                                         kv_events_replay_endpoint=f"tcp://{host}:0")
        self.aengine = AsyncEngine(lambda: LLMEngine(config),
                                   background_prefill=background_prefill)
        publisher = self.engine.kv_events
        self.events_endpoint = publisher.endpoint if publisher else None
        self.replay_endpoint = publisher.replay_endpoint if publisher else None
        logger.info("replica %s: KV events on %s (replay %s); %d objects frozen",
                    self.replica_id, self.events_endpoint, self.replay_endpoint,
                    freeze_warm_heap())  # the engine is loaded: see `server.heap`

    @property
    def engine(self) -> LLMEngine:
        return self.aengine.engine

    # ----- Ray Serve hooks -----

    def record_replica_metadata(self) -> dict[str, Any]:
        """Static, read by the router when the replica becomes ready: where to subscribe."""
        return {"replica": self.replica_id, "pid": os.getpid(), "kv_events": self.events_endpoint,
                "kv_replay": self.replay_endpoint,
                "block_size": self.engine.config.kv_events_block_size}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve (`request_routing_stats_period_s`): the engine's snapshot, for the
        ingress's /metrics, and its queue."""
        background = self.aengine.background
        snapshot = await self.aengine.run(lambda engine: take_snapshot(engine, background))
        return {"snapshot": dataclasses.asdict(snapshot), "running": snapshot.num_running,
                "waiting": snapshot.num_waiting}

    def check_health(self) -> None:
        """Serve restarts a replica whose check fails: a dead engine thread cannot serve, and
        nor can one stuck in a step (the single server's watchdog limit)."""
        if not self.aengine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine thread has stopped")
        running = self.aengine.heartbeat.step_running_s()
        if running > STUCK_STEP_S:
            raise RuntimeError(f"replica {self.replica_id}: an engine step has run for "
                               f"{running:.0f} s")

    # ----- called by the ingress -----

    def describe(self) -> ReplicaFacts:
        engine = self.engine
        return ReplicaFacts(model_path=str(engine.model_path),
                            vocab_size=engine.limits.vocab_size,
                            max_model_len=engine.limits.max_model_len,
                            kv_capacity=engine.limits.kv_capacity,
                            block_size=engine.config.kv_events_block_size,
                            family=engine.limits.family,
                            chat_template=engine.tokenizer.chat_template)

    async def generate(self, job: ReplicaJob) -> AsyncIterator[RequestOutput]:
        """Streams the job's cumulative outputs. The ingress cancelling the stream (its client
        left) closes this generator, and `AsyncEngine.generate` aborts the request. Each
        output names this replica (`extra["replica"]`): a stored response's continuations are
        sent back here, where its tokens are cached."""
        async for output in self.aengine.generate(job.prompt_ids, job.params, job.request_id,
                                                  job.namespace, **job.options):
            output.extra["replica"] = self.replica_id
            yield output

    def prefill_in_background(self, job: ReplicaJob) -> None:
        """Queues the job's tokens (a conversation's next turn, as its template will render
        it) for an idle-time prefill here; routed like a request, to the replica the turn
        ran on (`job.affinity`). A no-op when the replicas run without background prefill."""
        self.aengine.prefill_in_background(job.prompt_ids, job.namespace)

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()
            self.engine.close()
