"""The FastAPI app: the OpenAI and Anthropic routes, /health (liveness), /health/ready
(readiness, `health`), /metrics, error handlers and drain state.

`create_app(aengine, settings)` builds everything per app (metrics registry, submission
service, drain state), so tests can make several; other routers mount onto the app it returns.
The engine behind it is a local one (`AsyncEngine`) or replicas (`replicas.front`, with
`replicas` giving their per-replica snapshots to /metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from radixserve.engine.async_engine import AsyncEngine, EngineDeadError
from radixserve.server.accounting import CacheLedger
from radixserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from radixserve.server.anthropic.routes import install_anthropic_api
from radixserve.server.context import ReplicaView, ServerContext, context_of
from radixserve.server.errors import install_error_handlers
from radixserve.server.front import EngineFront
from radixserve.server.health import Readiness, liveness, readiness
from radixserve.server.next_turn import NextTurnLedger
from radixserve.server.observability.dashboard import install_dashboard
from radixserve.server.observability.metrics import EngineSnapshot, ServerMetrics, take_snapshot
from radixserve.server.observability.stats_routes import install_cache_stats
from radixserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.openai.responses import open_store
from radixserve.server.openai.responses_protocol import ResponsesRequest
from radixserve.server.openai.routes import build_openai_router
from radixserve.server.serving import EngineService, Lifecycle
from radixserve.server.settings import ServerSettings


def create_app(aengine: EngineFront, settings: ServerSettings | None = None,
               replicas: ReplicaView | None = None) -> FastAPI:
    """An app serving `aengine`. The caller owns the engine and shuts it down after the app."""
    settings = settings or ServerSettings()
    metrics = ServerMetrics(settings.model_name, settings.metrics_compat)
    lifecycle = Lifecycle()
    service = EngineService(aengine, settings, metrics, lifecycle)
    background = aengine.prefill_in_background if aengine.background_prefill else None
    ctx = ServerContext(aengine, settings, metrics, lifecycle, service, created=int(time.time()),
                        replicas=replicas, next_turn=NextTurnLedger(background))
    # TTL pins and vendor cache entries must age on one clock: the engine's.
    clock = aengine.clock
    ledger = CacheLedger(settings, metrics, clock)
    service.default_usage = ledger.openai

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lifecycle.attach()
        warm_up = asyncio.ensure_future(app.state.readiness.warm_up(ctx))
        if replicas is None:
            async with stats.sampling(aengine):  # the pool series of /v1/cache/stats
                yield
        else:  # the stats endpoint is per engine (see stats_routes): nothing to sample
            yield
        # uvicorn has drained the connections by now; wait for the engine to apply their
        # aborts before the loop closes under it.
        lifecycle.draining = True
        warm_up.cancel()
        await service.settle()

    app = FastAPI(
        title="radixserve",
        summary="OpenAI- and Anthropic-compatible LLM server built around prompt caching.",
        lifespan=lifespan,
    )
    app.state.radixserve = ctx
    app.state.readiness = Readiness()
    install_error_handlers(app)
    app.include_router(build_openai_router())
    install_anthropic_api(app, ledger, clock, settings.enable_clock_control)
    app.state.responses = open_store(ctx)  # the Responses API's stored responses
    install_dashboard(app)
    stats = install_cache_stats(app, ctx)
    for path, endpoint in (("/health", liveness), ("/health/ready", readiness),
                           ("/metrics", metrics_text)):
        app.add_api_route(path, endpoint, methods=["GET"], tags=["ops"])
        # Probes (aiperf, load balancers) send HEAD; the server drops the body.
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
    # Claude Code probes its base URL with HEAD / before its first request.
    app.add_api_route("/", root, methods=["HEAD", "GET"], include_in_schema=False)
    _document_bodies(app, [ChatCompletionRequest, CompletionRequest, MessagesRequest,
                           CountTokensRequest, ResponsesRequest])
    return app


async def root(request: Request) -> Response:
    """200 with the server's name and where its API lives; no auth (a connectivity probe)."""
    return JSONResponse({"name": "radixserve", "model": context_of(request).settings.model_name,
                         "docs": "/docs"})


async def _snapshot(ctx: ServerContext) -> EngineSnapshot | None:
    if not ctx.aengine.alive:
        return None
    # Shielded: a cancelled engine call would break the engine thread (see serving._pump).
    # Bounded by the watchdog's stall limit: a scrape during a stalled step renders the last
    # engine figures (and admission's, which need no engine).
    background = ctx.aengine.background if isinstance(ctx.aengine, AsyncEngine) else None
    call = asyncio.ensure_future(ctx.aengine.run(lambda e: take_snapshot(e, background)))
    call.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved
    try:
        return await asyncio.wait_for(asyncio.shield(call), ctx.settings.watchdog_stall_s)
    except (EngineDeadError, asyncio.TimeoutError):
        return None


async def metrics_text(request: Request) -> Response:
    """Prometheus text exposition; engine figures are a consistent snapshot (behind replicas:
    one per replica, labelled `replica`). No auth."""
    ctx = context_of(request)
    if ctx.replicas is not None:
        body = ctx.metrics.render_replicas(await ctx.replicas.snapshots())
    else:
        body = ctx.metrics.render(await _snapshot(ctx))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Adds the request models (parsed by the routes themselves) to the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(doc.pop("$defs", {}))
                components[model.__name__] = doc
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
