"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/input_tokens and
POST /v1/responses/{id}/cancel.

A stored response is its exact token sequence (`response_store`); `previous_response_id`
continues it token for token (`responses_render`), its prefix pinned in the cache for the
store's TTL, so a continued turn recomputes only its new items. Generation runs through the same
request skeleton as chat completions (`exchange.handle`): admission, usage, the cost ledger.
This module holds the routes; a request becomes a job in `responses_request`, and generates,
streams and is stored in `responses_exchange`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from radixserve.server.context import ServerContext, context_of
from radixserve.server.errors import bad_request
from radixserve.server.exchange import handle
from radixserve.server.openai.responses_exchange import ResponsesExchange
from radixserve.server.openai.responses_protocol import ResponsesRequest, input_items
from radixserve.server.openai.responses_request import (
    continued,
    not_found,
    prepare_response,
    render_prompt,
    tenant_of,
)
from radixserve.server.openai.responses_stream import replay
from radixserve.server.response_store import ResponseStore, StoredResponse
from radixserve.server.transport import SSE_HEADERS, parse_body, read_body, request_body_doc

ROUTE = "/v1/responses"


def open_store(ctx: ServerContext) -> ResponseStore:
    """The app's store. Its clock is wall time (expiry outlives the process), moved by the
    engine's clock control with everything else in tests."""
    settings, clock = ctx.settings, ctx.aengine.clock
    return ResponseStore(settings.responses_dir, int(settings.responses_max_mb * 2**20),
                         settings.responses_ttl,
                         lambda: time.time() + getattr(clock, "offset_s", 0.0))


def build_responses_router() -> APIRouter:
    """The routes, for the OpenAI router (which authenticates); the store they use is the
    app's `app.state.responses` (`open_store`)."""
    router = APIRouter()
    router.add_api_route(ROUTE, create_response, methods=["POST"],
                         openapi_extra=request_body_doc(ResponsesRequest))
    router.add_api_route(ROUTE + "/input_tokens", count_input_tokens, methods=["POST"],
                         openapi_extra=request_body_doc(ResponsesRequest))
    router.add_api_route(ROUTE + "/{response_id}", retrieve_response, methods=["GET"])
    router.add_api_route(ROUTE + "/{response_id}", delete_response, methods=["DELETE"])
    router.add_api_route(ROUTE + "/{response_id}/input_items", list_input_items,
                         methods=["GET"])
    router.add_api_route(ROUTE + "/{response_id}/cancel", cancel_response, methods=["POST"])
    return router


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _found(request: Request, response_id: str) -> StoredResponse:
    stored = _store(request).get(response_id, tenant_of(request.state.api_key))
    if stored is None:
        raise not_found(response_id)
    return stored


# ----- POST /v1/responses -----


async def create_response(request: Request) -> Response:
    store = _store(request)

    async def prepare(ctx: ServerContext, request: Request, raw: bytes) -> ResponsesExchange:
        return await prepare_response(ctx, store, request, raw)

    return await handle(request, prepare)

# ----- the other routes -----


async def retrieve_response(request: Request, response_id: str) -> Any:
    """The stored response; with ?stream=true, its events replayed as a stream."""
    stored = _found(request, response_id)
    if request.query_params.get("stream", "false").lower() == "true":
        events = replay(stored.body)

        async def stream() -> Any:
            for event in events:
                yield event

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    return stored.body


async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    if not _store(request).delete(response_id, tenant_of(request.state.api_key)):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def cancel_response(request: Request, response_id: str) -> None:
    _found(request, response_id)
    raise bad_request("Only background responses can be cancelled, and this server runs none "
                      "(background is refused).", "response_id")


async def list_input_items(request: Request, response_id: str) -> dict[str, Any]:
    """This response's own input items (those it added to the conversation), newest first
    unless order=asc, `limit` (1-100, default 20) after the item id `after`."""
    items = list(_found(request, response_id).input_items)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc.", "order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise bad_request("limit must be an integer from 1 to 100.", "limit")
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in this response.", "after")
        items = items[ids.index(after) + 1:]
    page = items[: int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


async def count_input_tokens(request: Request) -> dict[str, Any]:
    """The prompt tokens a POST /v1/responses with this body would have, continuation
    included, without generating."""
    ctx, store = context_of(request), _store(request)
    body = parse_body(await read_body(request, ctx.settings.max_request_bytes), ResponsesRequest)
    ctx.check_model(body.model)
    body.check_supported()
    tenant = tenant_of(request.state.api_key)
    chat_tools = body.function_tools()
    items = input_items(body)
    previous = continued(store, body, tenant, chat_tools)
    rendered = await asyncio.to_thread(render_prompt, ctx, store, body, items, chat_tools,
                                       tenant, previous)
    return {"object": "response.input_tokens", "input_tokens": len(rendered.token_ids)}
