"""Anthropic-compatible routes: POST /v1/messages (`messages`) and
POST /v1/messages/count_tokens, with errors in Anthropic's shape and its x-api-key auth; and,
for tests only, the clock control route that makes cache TTLs expire without waiting.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixserve.server.accounting import CacheLedger, OffsetClock
from radixserve.server.anthropic.messages import create_message
from radixserve.server.anthropic.prompt import prepare_prompt
from radixserve.server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    new_request_id,
    render_error,
)
from radixserve.server.auth import authenticate, presented_key
from radixserve.server.context import context_of
from radixserve.server.errors import APIError, bad_request, register_error_renderer
from radixserve.server.transport import read_body, request_body_doc


def install_anthropic_api(app: FastAPI, ledger: CacheLedger, clock: Callable[[], float],
                          enable_clock_control: bool) -> None:
    """Mounts the Messages routes (errors in Anthropic's shape) and, for tests only, the
    clock control route."""
    app.state.cache_ledger = ledger
    register_error_renderer(app, "/v1/messages", render_error)
    router = APIRouter(dependencies=[Depends(_authenticate)], tags=["anthropic"])
    router.add_api_route("/v1/messages", create_message, methods=["POST"],
                         openapi_extra=request_body_doc(MessagesRequest))
    router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"],
                         openapi_extra=request_body_doc(CountTokensRequest))
    app.include_router(router)
    if enable_clock_control:
        if not isinstance(clock, OffsetClock):
            raise ValueError("clock control needs an engine running on an OffsetClock")
        app.include_router(_clock_router(clock))


def _clock_router(clock: OffsetClock) -> APIRouter:
    router = APIRouter(tags=["testing"])

    async def advance_clock(request: Request) -> dict[str, float]:
        """Moves the engine's clock forward by {"seconds": N} (TTL pins and vendor entries
        expire as if that time had passed)."""
        data = json.loads(await request.body() or b"{}")
        seconds = data.get("seconds") if isinstance(data, dict) else None
        if not isinstance(seconds, int | float) or seconds < 0:
            raise bad_request("send {\"seconds\": N} with N >= 0", "seconds")
        clock.advance(float(seconds))
        return {"offset_s": clock.offset_s}

    router.add_api_route("/debug/clock/advance", advance_clock, methods=["POST"])
    return router


async def _authenticate(request: Request) -> None:
    try:
        request.state.api_key = authenticate(request, context_of(request).settings)
    except APIError as error:
        if error.status != 401:
            raise
        missing = presented_key(request) is None
        raise APIError(401, "x-api-key header is required" if missing
                       else "invalid x-api-key") from None


async def count_tokens(request: Request) -> Response:
    """The rendered prompt's length: what input, cache reads and writes of a real request
    add up to (no cache split, as the vendor's endpoint), after the same preamble strip and
    context edits; with context_management, the length before the edits too."""
    ctx = context_of(request)
    raw = await read_body(request, ctx.settings.max_request_bytes)
    _, prepared = await prepare_prompt(ctx, raw, CountTokensRequest)
    body: dict[str, object] = {"input_tokens": len(prepared.token_ids)}
    if prepared.edited is not None:
        body["context_management"] = {
            "original_input_tokens": prepared.edited.original_input_tokens}
    return JSONResponse(body, headers={"request-id": new_request_id()})
