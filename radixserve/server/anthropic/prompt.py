"""A Messages (or count_tokens) body to the engine's prompt: checked, rendered in the vendor's
cache order (tools, system, messages) through the model's chat template, with each
`cache_control` breakpoint as a token offset, pinned in the prefix cache for its TTL.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TypeVar

import jinja2

from radixserve.model.tokenizer import ChatTokenizer
from radixserve.provider_caching import (
    BodyError,
    Breakpoint,
    CacheControlError,
    PromptLayout,
    RenderedPrompt,
    build_layout,
    chat_prompt,
    render_request,
    validate_breakpoints,
)
from radixserve.provider_caching.template import ChatPrompt, breakpoint_token_offsets, render_prompt
from radixserve.provider_caching.vendor_rules import TTL_SECONDS
from radixserve.server.accounting import is_known_anthropic_model
from radixserve.server.anthropic.protocol import TEXT_BLOCK_TYPES, CountTokensRequest
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError, bad_request
from radixserve.server.transport import parse_body

RequestT = TypeVar("RequestT", bound=CountTokensRequest)


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


async def prepare_prompt(ctx: ServerContext, raw: bytes,
                         model: type[RequestT]) -> tuple[RequestT, PreparedPrompt]:
    """The body parsed into `model` and its prompt; 400 (404 for the model) when either is bad."""
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
