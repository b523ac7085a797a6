"""Liveness and readiness, Kubernetes-style.

GET /health is liveness: 200 while the engine thread runs and no step has passed the
watchdog's stall limit; 503 otherwise (a supervisor may restart the process). It stays 200
while draining, so that a drain is not cut short by a restart.

GET /health/ready is readiness: 503 until the warm-up generation has run, while draining, and
while a step is stalled; otherwise 200 if the engine has produced a token within the probe
timeout, else it runs a real 1-token generation (one at a time, shared by concurrent probes)
and answers 200 if that ends within the timeout. The warm-up's prefill also calibrates the
admission's drain rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixserve.engine.async_engine import EngineDeadError
from radixserve.sampling_params import SamplingParams
from radixserve.server.context import ServerContext, context_of
from radixserve.server.heap import freeze_warm_heap

logger = logging.getLogger(__name__)

# The probes' cache namespace, made unique per generation: their prompts never meet a
# tenant's, and never hit each other or an earlier process's disk tier (the warm-up's timed
# prefill must compute, and the cache's counters stay the clients').
PROBE_NAMESPACE = "radixserve-health-probe"
WARMUP_WORDS = 100  # the timed warm-up prompt (~300 tokens): long enough to time a prefill


class Readiness:
    """One app's readiness state and its probe."""

    def __init__(self) -> None:
        self.warmed = False
        self._probe: asyncio.Task[bool] | None = None

    async def warm_up(self, ctx: ServerContext) -> None:
        """Runs a first generation (which pays one-time costs: kernels, allocator), then times
        the prefill of a prompt of a few hundred tokens for admission's drain rate; ready once
        both have run."""
        words = " ".join(f"w{i % 97}" for i in range(WARMUP_WORDS))
        ids = ctx.tokenizer.encode(words)[: max(1, ctx.max_model_len - 2)]
        try:
            await self._generate(ctx, ids[:8])
            started = time.monotonic()
            await self._generate(ctx, ids)
        except Exception:  # noqa: BLE001 - the readiness probe then says what is wrong
            logger.exception("warm-up generation failed")
            return
        seconds = time.monotonic() - started
        ctx.service.admission.rate.calibrate(len(ids), seconds)
        frozen = freeze_warm_heap()
        logger.info("warm-up: %d-token prefill in %.2f s (%.0f tokens/s); %d objects frozen; "
                    "ready", len(ids), seconds, len(ids) / max(seconds, 1e-6), frozen)
        self.warmed = True

    async def probe(self, ctx: ServerContext, timeout_s: float) -> bool:
        """Whether a 1-token generation ends within `timeout_s` (one probe at a time)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._timed(ctx, timeout_s))
        return await asyncio.shield(self._probe)

    async def _timed(self, ctx: ServerContext, timeout_s: float) -> bool:
        ids = ctx.tokenizer.encode("ready")[:1] or [0]
        try:
            await asyncio.wait_for(self._generate(ctx, ids), timeout_s)
        except (asyncio.TimeoutError, EngineDeadError, ValueError):
            return False
        return True

    @staticmethod
    async def _generate(ctx: ServerContext, ids: list[int]) -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        nonce = uuid.uuid4().hex[:12]
        outputs = ctx.aengine.generate(ids, params, f"probe-{nonce}",
                                       namespace=f"{PROBE_NAMESPACE}/{nonce}", counted=False)
        with contextlib.suppress(StopAsyncIteration):
            async for _ in outputs:
                pass


def _status(status: str, code: int = 200) -> Response:
    return JSONResponse({"status": status}, status_code=code)


async def liveness(request: Request) -> Response:
    """200 while the engine runs and no step is stalled; 503 otherwise. No auth."""
    ctx = context_of(request)
    if not ctx.aengine.alive:
        return _status("engine stopped", 503)
    if ctx.lifecycle.stalled:
        return _status("engine step stalled", 503)
    return _status("draining" if ctx.lifecycle.draining else "ok")


async def readiness(request: Request) -> Response:
    """200 when this server can take traffic now (see the module's docstring). No auth."""
    ctx = context_of(request)
    readiness_state: Readiness = request.app.state.readiness
    if not ctx.aengine.alive:
        return _status("engine stopped", 503)
    if ctx.lifecycle.draining:
        return _status("draining", 503)
    if ctx.lifecycle.stalled:
        return _status("engine step stalled", 503)
    if not readiness_state.warmed:
        return _status("warming up", 503)
    timeout_s = ctx.settings.ready_timeout_s
    if time.monotonic() - ctx.service.last_output_at < timeout_s:
        return _status("ok")  # the engine generated for a client just now
    if await readiness_state.probe(ctx, timeout_s):
        return _status("ok")
    return _status(f"a 1-token generation did not finish within {timeout_s:g} s", 503)
