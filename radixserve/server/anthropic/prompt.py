"""A Messages (or count_tokens) body to the engine's prompt: checked, its per-request
preamble stripped (`provider_caching.preambles`), its context edits applied
(`context_editing`), rendered in the vendor's cache order (tools, system, messages) through
the model's chat template, with each `cache_control` breakpoint as a token offset, pinned in
the prefix cache for its TTL.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any, TypeVar

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
from radixserve.provider_caching.preambles import StrippedPreamble, strip_preambles
from radixserve.provider_caching.template import ChatPrompt, breakpoint_token_offsets, render_prompt
from radixserve.provider_caching.vendor_rules import TTL_SECONDS
from radixserve.server.accounting import is_known_anthropic_model
from radixserve.server.anthropic.context_editing import (
    Edit,
    EditedBody,
    apply_edits,
    parse_context_management,
)
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
    # Per-request preambles taken out before rendering, with their length in tokens.
    stripped: tuple[tuple[StrippedPreamble, int], ...] = ()
    edited: EditedBody | None = None  # context_management's result; None: none asked


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
            allowed = ("text",) if message.role == "system" else TEXT_BLOCK_TYPES
            blocks += [(f"messages.{i}.content.{j}", b, allowed)
                       for j, b in enumerate(message.content)]
    for i, message in enumerate(body.messages):
        if message.clear_at is not None and message.role != "system":
            raise bad_request(f"messages.{i}.clear_at: only permitted on role \"system\" "
                              "messages", f"messages.{i}.clear_at")
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


def _shown_messages(data: dict[str, Any]) -> dict[str, Any]:
    """Without the role "system" messages whose `clear_at` is next_user_message and that a
    later user message follows: the vendor keeps them in the array but no longer shows them."""
    messages = data["messages"]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    shown = [m for i, m in enumerate(messages) if not (
        m.get("role") == "system" and m.get("clear_at") == "next_user_message" and i < last_user)]
    return data if len(shown) == len(messages) else {**data, "messages": shown}


def thinking_arguments(ctx: ServerContext, thinking: dict[str, Any] | None
                       ) -> tuple[tuple[str, Any], ...]:
    """`thinking` as the chat template's `enable_thinking` where the template reads it:
    disabled is False, enabled or adaptive True; unset leaves the template's default."""
    kind = (thinking or {}).get("type")
    if kind is None or not ctx.template_takes_thinking:
        return ()
    return (("enable_thinking", kind != "disabled"),)


def _prompt_length(tokenizer: ChatTokenizer, data: dict[str, Any],
                   template_args: tuple[tuple[str, Any], ...]) -> int:
    try:
        request = render_request(data, "anthropic")
    except BodyError as exc:
        raise bad_request(str(exc)) from None
    prompt = replace(chat_prompt(request), template_args=template_args)
    return len(_render(tokenizer, prompt, ())[0].token_ids)


def _prepare(tokenizer: ChatTokenizer, name: str, data: dict[str, Any],
             stripped: list[StrippedPreamble], edits: tuple[Edit, ...] | None,
             template_args: tuple[tuple[str, Any], ...] = ()) -> PreparedPrompt:
    """`edits` None: the request has no context_management (and its response says nothing)."""
    edited = None
    if edits is not None:
        edited = apply_edits(data, edits, lambda d: _prompt_length(tokenizer, d, template_args))
        data = edited.body
    try:
        request = render_request(data, "anthropic")
        breakpoints = validate_breakpoints(request)
    except CacheControlError as exc:
        raise bad_request(exc.message) from None
    except BodyError as exc:
        raise bad_request(str(exc)) from None
    prompt = replace(chat_prompt(request), template_args=template_args)
    rendered, offsets = _render(tokenizer, prompt, breakpoints)
    layout = build_layout(request, breakpoints, offsets, len(rendered.token_ids),
                          namespace=name, token_ids=rendered.token_ids)
    pins = tuple((bp.tokens, TTL_SECONDS[bp.ttl]) for bp in layout.breakpoints if bp.tokens > 0)
    lengths = tuple((s, len(tokenizer.encode(s.text, add_special_tokens=False)))
                    for s in stripped)
    return PreparedPrompt(name, rendered.token_ids, layout, pins, lengths, edited)


async def prepare_prompt(ctx: ServerContext, raw: bytes,
                         model: type[RequestT]) -> tuple[RequestT, PreparedPrompt]:
    """The body parsed into `model` and its prompt; 400 (404 for the model) when either is bad."""
    body = parse_body(raw, model)
    name = _check_model(ctx, body.model)
    if not body.messages:
        raise bad_request("messages: at least one message is required")
    _check_block_types(body)
    data, stripped = strip_preambles(json.loads(raw), "anthropic", ctx.settings.preambles)
    data = _shown_messages(data)
    edits: tuple[Edit, ...] | None = None
    if data.get("context_management") is not None:
        thinking_on = (body.thinking or {}).get("type") in ("enabled", "adaptive")
        edits = parse_context_management(data["context_management"], thinking_on)
    prepared = await asyncio.to_thread(_prepare, ctx.tokenizer, name, data, stripped, edits,
                                       thinking_arguments(ctx, body.thinking))
    return body, prepared
