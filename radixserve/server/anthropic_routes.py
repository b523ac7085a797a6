"""Anthropic-compatible routes: POST /v1/messages (streamed or not) and
POST /v1/messages/count_tokens, with `cache_control` breakpoints pinned in the prefix cache.

A request renders in the vendor's cache order (tools, system, messages) through the model's
chat template; each breakpoint becomes a token offset, pinned for its TTL, and the usage
fields come from the app's `CacheLedger` (engine truth or vendor rules).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.caching import (
    BodyError,
    Breakpoint,
    CacheControlError,
    Cost,
    PromptLayout,
    RenderedPrompt,
    build_layout,
    chat_prompt,
    render_request,
    validate_breakpoints,
)
from radixserve.caching.template import ChatPrompt, breakpoint_token_offsets, render_prompt
from radixserve.caching.vendor_rules import TTL_SECONDS
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.anthropic_accounting import (
    CacheLedger,
    OffsetClock,
    UsageTracker,
    is_known_anthropic_model,
)
from radixserve.server.anthropic_protocol import (
    TEXT_BLOCK_TYPES,
    CountTokensRequest,
    MessagesRequest,
    error_body,
    message_body,
    new_message_id,
    new_request_id,
    render_error,
    stop_fields,
    usage_body,
)
from radixserve.server.auth import authenticate, cache_namespace, presented_key
from radixserve.server.context import ServerContext, context_of
from radixserve.server.errors import APIError, bad_request, register_error_renderer
from radixserve.server.openai_common import (
    StreamCursor,
    check_sample,
    collect,
    resolve_max_tokens,
)
from radixserve.server.openai_routes import request_body_doc
from radixserve.server.serving import Job
from radixserve.server.transport import SSE_HEADERS, parse_body, read_body, until_disconnected

RequestT = TypeVar("RequestT", bound=CountTokensRequest)
COST_HEADER = "x-radixserve-cost-usd"
UNCACHED_COST_HEADER = "x-radixserve-uncached-cost-usd"


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


def _ledger(request: Request) -> CacheLedger:
    return request.app.state.cache_ledger


# ----- preparing a prompt -----


@dataclass(frozen=True)
class PreparedPrompt:
    """A request rendered for the engine: its token ids, cache layout and TTL pins."""

    model: str
    token_ids: list[int]
    layout: PromptLayout
    pins: tuple[tuple[int, float], ...]


def _check_model(ctx: ServerContext, name: str) -> str:
    # Anthropic model ids the profiles know are aliases of the served model, so the SDK's
    # model strings work and vendor accounting picks that model's rules.
    if name in ctx.settings.served_model_names or is_known_anthropic_model(name):
        return name
    raise APIError(404, f"model: {name}")


def _check_block_types(body: CountTokensRequest) -> None:
    """This text model reads text, tool_use and tool_result blocks; images and documents are
    refused rather than silently dropped."""
    blocks = [(f"system.{j}", b, ("text",)) for j, b in enumerate(
        body.system if isinstance(body.system, list) else [])]
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            blocks += [(f"messages.{i}.content.{j}", b, TEXT_BLOCK_TYPES)
                       for j, b in enumerate(message.content)]
    for path, block, allowed in blocks:
        if block.get("type") not in allowed:
            raise bad_request(f"{path}.type: this model reads only {', '.join(allowed)} blocks; "
                              f"got {block.get('type')!r}")


def _render(tokenizer: ChatTokenizer, prompt: ChatPrompt,
            breakpoints: tuple[Breakpoint, ...]) -> tuple[RenderedPrompt, list[int]]:
    try:
        rendered = render_prompt(tokenizer, prompt)
        offsets = breakpoint_token_offsets(tokenizer, prompt,
                                           [bp.block_index for bp in breakpoints], rendered)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        raise bad_request(f"messages: the chat template cannot render this conversation: "
                          f"{exc}") from exc
    return rendered, offsets


async def _prepare(ctx: ServerContext, raw: bytes,
                   model: type[RequestT]) -> tuple[RequestT, PreparedPrompt]:
    body = parse_body(raw, model)
    name = _check_model(ctx, body.model)
    if not body.messages:
        raise bad_request("messages: at least one message is required")
    _check_block_types(body)
    try:
        request = render_request(json.loads(raw), "anthropic")
        breakpoints = validate_breakpoints(request)
    except CacheControlError as exc:
        raise bad_request(exc.message) from None
    except BodyError as exc:
        raise bad_request(str(exc)) from None
    rendered, offsets = await asyncio.to_thread(_render, ctx.tokenizer, chat_prompt(request),
                                                breakpoints)
    layout = build_layout(request, breakpoints, offsets, len(rendered.token_ids),
                          namespace=name, token_ids=rendered.token_ids)
    pins = tuple((bp.tokens, TTL_SECONDS[bp.ttl]) for bp in layout.breakpoints if bp.tokens > 0)
    return body, PreparedPrompt(name, rendered.token_ids, layout, pins)


def _sampling_params(body: MessagesRequest, max_tokens: int) -> SamplingParams:
    stops = list(body.stop_sequences or [])
    if any(not s for s in stops):
        raise bad_request("stop_sequences: each stop sequence must be a non-empty string")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            stop=stops,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _check_prewarm(body: MessagesRequest) -> None:
    """max_tokens 0 pre-warms the cache; the vendor refuses it where output is required."""
    if body.stream:
        raise bad_request("max_tokens: 0 (cache pre-warming) cannot be combined with stream")
    if (body.tool_choice or {}).get("type") in ("any", "tool"):
        raise bad_request("max_tokens: 0 (cache pre-warming) cannot be combined with a "
                          "tool_choice that forces a tool call")
    if (body.thinking or {}).get("type") == "enabled":
        raise bad_request("max_tokens: 0 (cache pre-warming) cannot be combined with "
                          "extended thinking")


def _headers(request_id: str, cost: Cost | None) -> dict[str, str]:
    headers = {"request-id": request_id}
    if cost is not None:
        headers[COST_HEADER] = f"{cost.with_cache:.8f}"
        headers[UNCACHED_COST_HEADER] = f"{cost.without_cache:.8f}"
    return headers


# ----- routes -----


async def count_tokens(request: Request) -> Response:
    """The rendered prompt's length: what input, cache reads and writes of a real request
    add up to (no cache split, as the vendor's endpoint)."""
    ctx = context_of(request)
    raw = await read_body(request, ctx.settings.max_request_bytes)
    _, prepared = await _prepare(ctx, raw, CountTokensRequest)
    return JSONResponse({"input_tokens": len(prepared.token_ids)},
                        headers={"request-id": new_request_id()})


async def create_message(request: Request) -> Response:
    received = time.monotonic()
    ctx = context_of(request)
    ctx.service.check_open()
    raw = await read_body(request, ctx.settings.max_request_bytes)
    body, prepared = await _prepare(ctx, raw, MessagesRequest)
    prewarm = body.max_tokens == 0
    if prewarm:
        _check_prewarm(body)
    # A pre-warm still samples one token (the engine always computes logits); it is not sent.
    max_tokens = resolve_max_tokens(ctx, max(1, body.max_tokens), len(prepared.token_ids),
                                    "max_tokens")
    params = _sampling_params(body, max_tokens)
    namespace = cache_namespace(ctx.settings, request.state.api_key, None)
    ctx.service.admit(1)
    tracker = _ledger(request).anthropic(prepared.model, prepared.layout, namespace,
                                         bill_output=not prewarm)
    job = Job(prepared.token_ids, params, namespace, prepared.pins, tracker)
    request_id, message_id = new_request_id(), new_message_id()
    if body.stream:
        return await _stream(request, ctx, job, tracker, request_id, message_id,
                             prepared.model, received)
    connected, finals = await until_disconnected(
        request, collect(ctx, [job], message_id, received))
    if not connected or finals is None:
        return Response(status_code=499)  # nobody is listening; the status is for the log
    sample = finals[0].outputs[0]
    check_sample(sample)
    assert tracker.usage is not None
    if prewarm:
        text, (stop_reason, stop_sequence), output_tokens = "", ("max_tokens", None), 0
    else:
        text, (stop_reason, stop_sequence) = sample.text, stop_fields(sample)
        output_tokens = len(sample.token_ids)
    return JSONResponse(
        message_body(message_id, prepared.model, text, stop_reason, stop_sequence,
                     tracker.usage, output_tokens),
        headers=_headers(request_id, tracker.cost))


# ----- streaming -----


def _event(name: str, data: dict[str, Any]) -> bytes:
    # The SDK dispatches on the `event:` line; the JSON repeats it as `type`.
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


async def _stream(
    request: Request, ctx: ServerContext, job: Job, tracker: UsageTracker, request_id: str,
    message_id: str, model: str, received: float,
) -> Response:
    """Waits for the first output (so the usage, and any error before it, are known), then
    streams the events."""
    outputs = ctx.service.generate([job], message_id, received)
    connected, first = await until_disconnected(request, anext(outputs))
    if not connected or first is None:
        await outputs.aclose()
        return Response(status_code=499)
    # The output is not known yet: a stream's cost headers price its prompt only.
    headers = {**SSE_HEADERS, **_headers(request_id, tracker.prompt_cost())}
    events = _message_events(outputs, first[1], tracker, message_id, model, job)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _message_events(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None], first: RequestOutput,
    tracker: UsageTracker, message_id: str, model: str, job: Job,
) -> AsyncIterator[bytes]:
    assert tracker.usage is not None
    usage = usage_body(tracker.usage, 1)
    yield _event("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {"type": "ping"})
    cursor = StreamCursor(list(job.params.stop or []))  # type: ignore[arg-type]
    final = first
    try:
        async with aclosing(outputs):
            while True:
                sample = final.outputs[0]
                check_sample(sample)
                text, _, _ = cursor.advance(sample)
                if text:
                    yield _event("content_block_delta", {
                        "type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}})
                if final.finished:
                    break
                _, final = await anext(outputs)
    except APIError as error:
        yield _event("error", error_body(error))
        return
    stop_reason, stop_sequence = stop_fields(final.outputs[0])
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    # Cumulative, and the same input and cache figures as message_start: the SDK overwrites
    # its accumulated usage with any non-null value here.
    final_usage = {key: usage[key] for key in
                   ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")}
    final_usage["output_tokens"] = len(final.outputs[0].token_ids)
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": stop_reason,
                                             "stop_sequence": stop_sequence},
                                   "usage": final_usage})
    yield _event("message_stop", {"type": "message_stop"})
