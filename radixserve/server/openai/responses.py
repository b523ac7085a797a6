"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/input_tokens and
POST /v1/responses/{id}/cancel.

A stored response is its exact token sequence (`response_store`); `previous_response_id`
continues it token for token (`responses_render`), its prefix pinned in the cache for the
store's TTL, so a continued turn recomputes only its new items. Generation runs through the same
request skeleton as chat completions (`exchange.handle`): admission, usage, the cost ledger.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from radixserve.outputs import RequestOutput
from radixserve.server.auth import CacheNamespace, cache_namespace
from radixserve.server.context import ServerContext, context_of
from radixserve.server.errors import APIError, bad_request
from radixserve.server.exchange import Delta, Exchange, handle
from radixserve.server.openai.protocol import chat_logprobs
from radixserve.server.openai.responses_protocol import (
    ResponsesRequest,
    chat_messages,
    input_items,
)
from radixserve.server.openai.responses_render import (
    Rendered,
    continuation,
    first_turn,
    history_items,
    truncated,
)
from radixserve.server.openai.responses_stream import OutputEvents, replay
from radixserve.server.reasoning import (
    NoReasoning,
    ReasoningFormat,
    ReasoningSplit,
    ReasoningStream,
    reasoning_tokens,
)
from radixserve.server.response_store import ResponseStore, StoredResponse
from radixserve.server.serving import Job
from radixserve.server.tool_calls.parsers import ToolCallStream
from radixserve.server.tool_calls.tools import (
    CallReading,
    call_reading,
    openai_tool_choice,
    openai_tools,
    turn_constraint,
)
from radixserve.server.transport import SSE_HEADERS, parse_body, read_body, request_body_doc
from radixserve.server.validation import checked_sampling_params

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


def tenant_of(api_key: str | None) -> str:
    """Whose responses a request sees: its API key's (hashed: no secret is stored)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (unknown, deleted, "
                         "expired, or made with another API key).", param="response_id")


def _found(request: Request, response_id: str) -> StoredResponse:
    stored = _store(request).get(response_id, tenant_of(request.state.api_key))
    if stored is None:
        raise not_found(response_id)
    return stored


def _namespace(value: Any) -> CacheNamespace:
    return tuple(value) if isinstance(value, list) else value  # JSON keeps tuples as lists


# ----- the prompt -----


def _chain(store: ResponseStore, stored: StoredResponse, tenant: str) -> list[StoredResponse]:
    chain = [stored]
    while chain[0].previous_response_id is not None:
        earlier = store.get(chain[0].previous_response_id, tenant)
        if earlier is None:
            break  # expired: the conversation starts at what is still stored
        chain.insert(0, earlier)
    return chain


def render_prompt(ctx: ServerContext, store: ResponseStore, body: ResponsesRequest,
                  items: list[dict[str, Any]], tools: list[dict[str, Any]], tenant: str,
                  previous: StoredResponse | None) -> Rendered:
    """The prompt's tokens: the items after the stored ones (or alone); with truncation
    "auto", the whole conversation re-rendered less its oldest items when it does not fit."""
    tokenizer = ctx.tokenizer
    if previous is None:
        rendered = Rendered(first_turn(tokenizer, body.instructions, items, tools), 0)
    else:
        messages = chat_messages(items)
        if body.instructions and body.instructions != previous.instructions:
            # The stored system turn stays as the model saw it; new instructions follow it.
            messages.insert(0, chat_messages([{"type": "message", "role": "system",
                                               "content": body.instructions}])[0])
        rendered = Rendered(continuation(tokenizer, previous, messages),
                            len(previous.token_ids))
    fits = ctx.max_model_len - (body.max_output_tokens or 1)
    if body.truncation != "auto" or len(rendered.token_ids) <= fits:
        return rendered
    history = history_items(_chain(store, previous, tenant)) if previous else []
    instructions = body.instructions or (previous.instructions if previous else None)
    return truncated(tokenizer, instructions, [*history, *items], tools, fits)


def _continued(store: ResponseStore, body: ResponsesRequest, tenant: str,
               tools: list[dict[str, Any]]) -> StoredResponse | None:
    if body.previous_response_id is None:
        return None
    previous = store.get(body.previous_response_id, tenant)
    if previous is None:
        raise not_found(body.previous_response_id)
    if tools and tools != previous.tools:
        raise bad_request("tools differ from those of the response this continues: its tokens "
                          "were rendered with them, and a continuation never re-renders its "
                          "history. Send the same tools (or none), or start a new "
                          "conversation without previous_response_id.", "tools")
    return previous


# ----- POST /v1/responses -----


async def create_response(request: Request) -> Response:
    store = _store(request)

    async def prepare(ctx: ServerContext, request: Request, raw: bytes) -> ResponsesExchange:
        return await prepare_response(ctx, store, request, raw)

    return await handle(request, prepare)


async def prepare_response(ctx: ServerContext, store: ResponseStore, request: Request,
                           raw: bytes) -> ResponsesExchange:
    body = parse_body(raw, ResponsesRequest)
    model = ctx.check_model(body.model)
    body.check_supported()
    tenant = tenant_of(request.state.api_key)
    chat_tools = body.function_tools()
    tools = openai_tools(chat_tools)
    choice = openai_tool_choice(body.chat_tool_choice(), tools, body.parallel_tool_calls)
    family = ctx.tool_call_parser
    constraint = body.output_constraint()
    structured = turn_constraint([(constraint, "text.format")] if constraint else [], tools,
                                 choice, family, '"none"')
    items = input_items(body)
    if not items:
        raise bad_request("input is empty; send a string or at least one item.", "input")
    previous = _continued(store, body, tenant, chat_tools)
    rendered = await asyncio.to_thread(render_prompt, ctx, store, body, items, chat_tools,
                                       tenant, previous)
    params = checked_sampling_params(ctx, body, rendered.token_ids, body.max_output_tokens,
                                     "input", structured)
    if previous is not None and not rendered.dropped_items:
        namespace = _namespace(previous.namespace)
    else:
        namespace = cache_namespace(ctx.settings, request.state.api_key, body.prompt_cache_key)
    keep = body.store is not False
    # The whole sequence, output included, pinned for the store's TTL from its creation on:
    # the next turn's prefix stays cached (and on the disk tier) whatever runs meanwhile. The
    # offset is past any output; the engine pins as far as the finished request has KV.
    whole = len(rendered.token_ids) + params.max_tokens
    pins = ((whole, ctx.settings.responses_ttl),) if keep else ()
    # Behind replicas, the continuation goes where those tokens are cached.
    owner = previous.replica if previous is not None and not rendered.dropped_items else None
    job = Job(rendered.token_ids, params, namespace, pins, affinity=owner)
    reading = call_reading(tools, choice, family, ctx.engine.grammars) if tools else None
    stored = StoredResponse(
        id=f"resp_{uuid.uuid4().hex}", tenant=tenant, token_ids=[],
        prompt_len=len(rendered.token_ids), history_len=rendered.history_len,
        namespace=namespace, tools=chat_tools if previous is None else previous.tools,
        instructions=body.instructions or (previous.instructions if previous else None),
        input_items=items, previous_response_id=body.previous_response_id)
    reasoning = ctx.reasoning_format(rendered.token_ids, structured is not None)
    return ResponsesExchange(ctx, store if keep else None, body, model, job, reading, stored,
                             rendered.dropped_items, reasoning)


class ResponsesExchange(Exchange):
    """One POST /v1/responses: its job, its output items (streamed as events or returned
    whole), and its storing once finished. Where the reply opens with reasoning (the
    `--reasoning-parser` format), that is a `reasoning` item before the answer's items; the
    tool-call reader sees only the answer."""

    def __init__(self, ctx: ServerContext, store: ResponseStore | None, body: ResponsesRequest,
                 model: str, job: Job, reading: CallReading | None, record: StoredResponse,
                 dropped_items: int, reasoning: ReasoningFormat | None = None) -> None:
        super().__init__(record.id, bool(body.stream))
        self.ctx = ctx
        self.store = store
        self.body = body
        self.model = model
        self.job = job
        self.reading = reading
        self.record = record
        self.dropped_items = dropped_items
        self.created = int(time.time())
        self.events = OutputEvents()
        self._calls: ToolCallStream | None = None
        self.reasoning = reasoning or NoReasoning()
        self._thinking: ReasoningStream | None = None
        self._answer_token: int | None = None  # streamed: where the answer's tokens start
        self._answer_sent = 0  # streamed: characters of the answer sent, without tools

    def start(self) -> list[Job]:
        return [self.job]

    def _headers(self) -> dict[str, str]:
        # truncation "auto" says what it left out.
        return {"x-truncated-input-items": str(self.dropped_items)} if self.dropped_items else {}

    def response_headers(self) -> dict[str, str]:
        return self._headers()

    def stream_headers(self) -> dict[str, str]:
        return self._headers()

    def _logprobs(self, sample: Any, span: slice) -> list[dict[str, Any]] | None:
        if self.job.params.logprobs is None:
            return None
        return chat_logprobs((sample.logprobs or [])[span], sample.token_ids[span],
                             self.ctx.token_text)["content"]

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        body = self.body
        text_format = (body.text.format if body.text else None) or {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": self.store is not None,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_logprobs": body.top_logprobs or 0, "truncation": body.truncation or "disabled",
            "usage": usage, "metadata": body.metadata or {}, "user": body.user,
        }

    def _reasoning_tokens(self, token_ids: list[int], split: ReasoningSplit) -> int:
        return reasoning_tokens(token_ids, split, self.ctx.tokenizer.decode)

    def _finish(self, final: RequestOutput) -> tuple[dict[str, Any], bytes]:
        """The finished response (stored, when `store`) and the events that close its stream."""
        sample = final.outputs[0]
        status = "incomplete" if sample.finish_reason == "length" else "completed"
        closing = self.events.finish(status)
        prompt, output = len(final.prompt_token_ids), len(sample.token_ids)
        thought = self._reasoning_tokens(sample.token_ids,
                                         self.reasoning.split(sample.text, final=True))
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                 "output_tokens": output, "output_tokens_details": {"reasoning_tokens": thought},
                 "total_tokens": prompt + output}
        body = self.response(status, self.events.output, usage)
        if self.store is not None:
            self.record = dataclasses.replace(
                self.record, body=body, token_ids=[*self.job.prompt_ids, *sample.token_ids],
                replica=final.extra.get("replica"))
            self.store.put(self.record)
        return body, closing

    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        sample = finals[0].outputs[0]
        split = self.reasoning.split(sample.text, final=True)
        if split.reasoning:
            self.events.reasoning(split.reasoning)
        if split.reasoning_end == len(sample.text):
            return self._finish(finals[0])[0]  # cut off while reasoning: no answer
        everything = slice(self._reasoning_tokens(sample.token_ids, split), None)
        if self.reading is None:
            self.events.text(split.content, self._logprobs(sample, everything))
        else:
            parsed = self.reading.parse(split.content)
            if parsed.content or not parsed.calls:
                logprobs = None if parsed.calls else self._logprobs(sample, everything)
                self.events.text(parsed.content, logprobs)
            for i, call in enumerate(parsed.calls):
                self.events.call(i, call.name, call.arguments)
        return self._finish(finals[0])[0]

    def opening_events(self) -> list[bytes]:
        shell = self.response("in_progress", [], None)
        return [self.events.event("response.created", response=shell),
                self.events.event("response.in_progress", response=shell)]

    def delta_event(self, delta: Delta) -> bytes | None:
        sample = delta.sample
        if self.reading is None and isinstance(self.reasoning, NoReasoning):
            logprobs = self._logprobs(sample, slice(delta.token_start, delta.token_end))
            return self.events.text(delta.text, logprobs) if delta.text or logprobs else None
        final = sample.finish_reason is not None
        visible = sample.text if final else sample.text[: delta.text_offset + len(delta.text)]
        events, answer = self._reasoning_delta(delta, visible, final)
        if answer is None:
            return events or None
        if self.reading is None:
            text, self._answer_sent = answer[self._answer_sent:], len(answer)
            start = max(delta.token_start, self._answer_token or 0)
            logprobs = self._logprobs(sample, slice(start, delta.token_end))
            if text or logprobs:
                events += self.events.text(text, logprobs)
            return events or None
        if self._calls is None:
            self._calls = self.reading.stream()
        update = self._calls.feed(answer, final)
        events += self.events.text(update.content) if update.content else b""
        for call in update.calls:
            if self.reading.keeps(call.index):
                events += self.events.call(call.index, call.name, call.arguments)
        return events or None

    def _reasoning_delta(self, delta: Delta, visible: str, final: bool
                         ) -> tuple[bytes, str | None]:
        """The reasoning events of a streamed delta, and the answer so far (None while the
        reply is still reasoning, or was cut off in it)."""
        if isinstance(self.reasoning, NoReasoning):
            return b"", visible
        if self._thinking is None:
            self._thinking = ReasoningStream(self.reasoning)
        update = self._thinking.feed(visible, final)
        events = self.events.reasoning(update.reasoning) if update.reasoning else b""
        if not update.reasoning_done:
            return events, None
        split = self.reasoning.split(visible, final)
        if split.reasoning_end == len(visible) and final:
            return events, None
        if self._answer_token is None:
            self._answer_token = self._reasoning_tokens(
                delta.sample.token_ids[:delta.token_end], split)
        return events, update.content_so_far

    def closing_events(self, finals: list[RequestOutput]) -> list[bytes]:
        body, closing = self._finish(finals[0])
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [closing, self.events.event(kind, response=body)]

    def error_events(self, error: APIError) -> list[bytes]:
        failure = {"code": error.code or error.type, "message": error.message}
        return [self.events.event("response.failed",
                                  response=self.response("failed", self.events.output, None,
                                                         failure))]


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
    previous = _continued(store, body, tenant, chat_tools)
    rendered = await asyncio.to_thread(render_prompt, ctx, store, body, items, chat_tools,
                                       tenant, previous)
    return {"object": "response.input_tokens", "input_tokens": len(rendered.token_ids)}
