"""A POST /v1/responses made into a job: its prompt (a first turn rendered whole, or a stored
response's exact tokens plus the new items), sampling params, TTL pins over the whole stored
sequence, the namespace and, behind replicas, the replica that holds the stored tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

from fastapi import Request

from radixserve.server.auth import CacheNamespace, cache_namespace
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError, bad_request
from radixserve.server.openai.responses_exchange import ResponsesExchange
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
from radixserve.server.response_store import ResponseStore, StoredResponse
from radixserve.server.serving import Job
from radixserve.server.tool_calls.tools import (
    call_reading,
    openai_tool_choice,
    openai_tools,
    turn_constraint,
)
from radixserve.server.transport import parse_body
from radixserve.server.validation import checked_sampling_params


def tenant_of(api_key: str | None) -> str:
    """Whose responses a request sees: its API key's (hashed: no secret is stored)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (unknown, deleted, "
                         "expired, or made with another API key).", param="response_id")

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


def continued(store: ResponseStore, body: ResponsesRequest, tenant: str,
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
    previous = continued(store, body, tenant, chat_tools)
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
