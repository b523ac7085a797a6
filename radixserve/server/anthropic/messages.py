"""POST /v1/messages, streamed or not: one job per request, its usage fields from the app's
`CacheLedger` (engine truth or vendor rules), its dollar cost in response headers.

A stream waits for the engine's first output before it answers: message_start carries the
usage, and the cost headers price the prompt (the output is not known yet).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.outputs import RequestOutput
from radixserve.provider_caching import Cost
from radixserve.sampling_params import SamplingParams, StructuredOutputsParams
from radixserve.server.accounting import CacheLedger, JobAccount
from radixserve.server.anthropic.field_audit import not_applied, thinking_asked
from radixserve.server.anthropic.prompt import PreparedPrompt, prepare_prompt
from radixserve.server.anthropic.protocol import (
    MessagesRequest,
    error_body,
    message_body,
    new_message_id,
    new_request_id,
    stop_fields,
    usage_body,
)
from radixserve.server.auth import CacheNamespace, cache_namespace
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError, bad_request
from radixserve.server.exchange import Delta, Exchange, handle
from radixserve.server.reasoning import NoReasoning, ReasoningFormat, ReasoningStream
from radixserve.server.serving import Job
from radixserve.server.tool_calls.tools import (
    CallReading,
    anthropic_tool_choice,
    anthropic_tools,
    call_reading,
    turn_constraint,
)
from radixserve.server.transport import NOT_APPLIED_HEADER, sse
from radixserve.server.validation import checked_sampling_params, clamp_headers

COST_HEADER = "x-radixserve-cost-usd"
# Context editing changed the prompt from this body path on (the cache serves what precedes).
CONTEXT_EDIT_HEADER = "x-radixserve-context-edited-from"
# A per-request preamble was taken out before rendering: "NAME (PATH, N tokens)".
PREAMBLE_HEADER = "x-radixserve-preamble-stripped"
# What became of `thinking` and output_config.effort: applied (as the template's
# enable_thinking), or ignored on a model without a reasoning mode, which is served a plain
# answer (refusing would lock out clients that send thinking by default).
THINKING_HEADER = "x-radixserve-thinking"
THINKING_IGNORED = "ignored: this model has no reasoning mode"
TOOL_CALL_FORMAT = "hermes"
UNCACHED_COST_HEADER = "x-radixserve-uncached-cost-usd"


async def create_message(request: Request) -> Response:
    return await handle(request, prepare_message, overloaded_status=529)


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


async def prepare_message(ctx: ServerContext, request: Request, raw: bytes) -> MessagesExchange:
    body, prompt = await prepare_prompt(ctx, raw, MessagesRequest)
    if body.max_tokens == 0:
        _check_prewarm(body)
    tools = anthropic_tools(body.tools)
    choice = anthropic_tool_choice(body.tool_choice, tools)
    output_format = _output_format(body.output_config)
    # The tools section of the prompt (provider_caching.template) asks for hermes-style calls. (A
    # pre-warm with a forced call never gets here: _check_prewarm refuses it.)
    structured = turn_constraint(
        [(output_format, "output_config.format")] if output_format else [], tools, choice,
        TOOL_CALL_FORMAT, '{"type": "none"}')
    # A pre-warm still samples one token (the engine always computes logits); it is not sent.
    params = checked_sampling_params(ctx, body, prompt.token_ids, max(1, body.max_tokens),
                                     "messages", structured)
    namespace = cache_namespace(ctx.settings, request.state.api_key, None)
    ledger: CacheLedger = request.app.state.cache_ledger
    headers = request_headers(prompt, not_applied(body, request.headers.get("anthropic-beta")))
    headers.update(clamp_headers(body.max_tokens, [params.max_tokens]))
    if (note := thinking_note(ctx, body)) is not None:
        headers[THINKING_HEADER] = note
    for stripped, tokens in prompt.stripped:
        ctx.metrics.preamble_stripped(stripped.name, tokens)
    return MessagesExchange(ledger, prompt, params, namespace, bool(body.stream),
                            prewarm=body.max_tokens == 0,
                            calls=call_reading(tools, choice, TOOL_CALL_FORMAT,
                                               ctx.engine.grammars),
                            headers=headers, reasoning=ctx.reasoning_format(prompt.token_ids,
                                                                     structured is not None))


def thinking_note(ctx: ServerContext, body: MessagesRequest) -> str | None:
    """THINKING_HEADER's value: what the server did with `thinking` and effort; None when
    the request set neither."""
    if ctx.reasoning_parser == "none":
        return THINKING_IGNORED if thinking_asked(body) else None
    notes = []
    thinking = body.thinking or {}
    if "type" in thinking:
        if ctx.template_takes_thinking:
            notes.append(f"applied: enable_thinking={str(thinking['type'] != 'disabled').lower()}")
        else:
            notes.append(f"{thinking['type']} not applied: the chat template has no thinking "
                         "switch (the model reasons as it was trained to)")
        if "budget_tokens" in thinking:
            notes.append("budget_tokens not enforced (max_tokens bounds reasoning and answer)")
    if "effort" in (body.output_config or {}):
        notes.append("output_config.effort ignored: this model has no effort setting")
    return "; ".join(notes) or None


def prompt_notes(prompt: PreparedPrompt) -> tuple[str, ...]:
    """The dashboard's lines on what the server changed in this prompt."""
    notes = [f"{s.name} stripped from {s.path} ({n} tokens that change per request; the "
             "cache match continues past it)" for s, n in prompt.stripped]
    if prompt.edited is not None and prompt.edited.first_edited is not None:
        notes.append(f"context editing rewrote the prompt from {prompt.edited.first_edited}")
    return tuple(notes)


def request_headers(prompt: PreparedPrompt, not_applied_items: list[str]) -> dict[str, str]:
    """What the server did to the request (or did not apply), as response headers."""
    headers = {}
    if prompt.stripped:
        headers[PREAMBLE_HEADER] = ", ".join(f"{s.name} ({s.path}, {n} tokens)"
                                             for s, n in prompt.stripped)
    if prompt.edited is not None and prompt.edited.first_edited is not None:
        headers[CONTEXT_EDIT_HEADER] = prompt.edited.first_edited
    if not_applied_items:
        headers[NOT_APPLIED_HEADER] = ", ".join(not_applied_items)
    return headers


def _output_format(config: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """`output_config.format`: {"type": "json_schema", "schema": {...}}."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), dict):
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": '
                          "{...}}.", "output_config.format")
    return StructuredOutputsParams(json=fmt["schema"])


def _cost_headers(request_id: str, cost: Cost | None, extra: dict[str, str]) -> dict[str, str]:
    headers = {"request-id": request_id, **extra}
    if cost is not None:
        headers[COST_HEADER] = f"{cost.with_cache:.8f}"
        headers[UNCACHED_COST_HEADER] = f"{cost.without_cache:.8f}"
    return headers


class MessagesExchange(Exchange):
    waits_for_first_output = True

    def __init__(self, ledger: CacheLedger, prompt: PreparedPrompt, params: SamplingParams,
                 namespace: CacheNamespace, stream: bool, prewarm: bool,
                 calls: CallReading | None = None, headers: dict[str, str] | None = None,
                 reasoning: ReasoningFormat | None = None) -> None:
        super().__init__(new_message_id(), stream)
        self.calls = calls  # how tool calls are read; None: the text is all content
        # The reply's reasoning becomes a thinking block before the answer's blocks; the
        # stream opens its first block once it knows which it is.
        self.reasoning = reasoning or NoReasoning()
        self._thinking = None if isinstance(self.reasoning, NoReasoning) else \
            ReasoningStream(self.reasoning)
        self._thinking_open = False
        self._answer_open = False
        self._text_sent = 0
        self.headers = headers or {}  # what the server did to the request (request_headers)
        self._blocks = StreamBlocks(calls)
        self.request_id = new_request_id()  # the `request-id` header, as the vendor sends
        self.ledger = ledger
        self.prompt = prompt
        self.params = params
        self.namespace = namespace
        self.prewarm = prewarm
        self._account: JobAccount | None = None
        self._start_usage: dict[str, Any] = {}  # message_start's usage, for message_delta

    @property
    def account(self) -> JobAccount:
        assert self._account is not None, "the exchange has not started"
        return self._account

    def start(self) -> list[Job]:
        # Opened on admission only: in vendor mode opening it reads and writes the emulation.
        self._account = self.ledger.anthropic(self.prompt.model, self.prompt.layout,
                                              self.namespace, bill_output=not self.prewarm)
        return [Job(self.prompt.token_ids, self.params, self.namespace, self.prompt.pins,
                    self._account, prompt_notes(self.prompt))]

    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        sample = finals[0].outputs[0]
        usage = self.account.usage
        assert usage is not None  # known from the first output
        if self.prewarm:
            return self._with_edits(message_body(self.response_id, self.prompt.model, [],
                                                 "max_tokens", None, usage, 0))
        stop_reason, stop_sequence = stop_fields(sample)
        split = self.reasoning.split(sample.text, final=True)
        thinking = [_thinking_block(split.reasoning)] if split.reasoning_end else []
        content: list[dict[str, Any]] = [{"type": "text", "text": split.content}]
        if self.calls is not None:
            parsed = self.calls.parse(split.content)
            if parsed.calls:
                content = [{"type": "text", "text": parsed.content}] + [
                    {"type": "tool_use", "id": _tool_use_id(), "name": call.name,
                     "input": json.loads(call.arguments)} for call in parsed.calls]
                stop_reason = "tool_use" if stop_reason == "end_turn" else stop_reason
        content = thinking + [block for block in content
                              if block["type"] != "text" or block["text"]]
        return self._with_edits(message_body(self.response_id, self.prompt.model, content,
                                             stop_reason, stop_sequence, usage,
                                             len(sample.token_ids)))

    def _with_edits(self, body: dict[str, Any]) -> dict[str, Any]:
        """`context_management.applied_edits` where the request asked for context editing."""
        if self.prompt.edited is not None:
            body["context_management"] = {"applied_edits": self.prompt.edited.applied_edits}
        return body

    def response_headers(self) -> dict[str, str]:
        return _cost_headers(self.request_id, self.account.cost, self.headers)

    def stream_headers(self) -> dict[str, str]:
        return _cost_headers(self.request_id, self.account.prompt_cost(), self.headers)

    def opening_events(self) -> list[bytes]:
        assert self.account.usage is not None  # the first output has been seen
        self._start_usage = usage_body(self.account.usage, 1)
        message = {"id": self.response_id, "type": "message", "role": "assistant",
                   "model": self.prompt.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": self._start_usage}
        first = [] if self._thinking is not None else [
            _event({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}})]
        return [_event({"type": "message_start", "message": message}), *first,
                _event({"type": "ping"})]

    def delta_event(self, delta: Delta) -> bytes | None:
        if self._thinking is not None:
            return b"".join(self._reasoning_events(delta)) or None
        if self.calls is None:
            if not delta.text:
                return None
            return _event({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": delta.text}})
        sample = delta.sample
        final = sample.finish_reason is not None
        visible = sample.text if final else sample.text[: delta.text_offset + len(delta.text)]
        return b"".join(self._blocks.events(visible, final)) or None

    def _reasoning_events(self, delta: Delta) -> list[bytes]:
        """A thinking block (index 0) while the reply reasons, then the answer's blocks."""
        assert self._thinking is not None
        sample = delta.sample
        final = sample.finish_reason is not None
        visible = sample.text if final else sample.text[: delta.text_offset + len(delta.text)]
        split = self._thinking.feed(visible, final)
        out = []
        if split.reasoning:
            if not self._thinking_open:
                self._thinking_open = True
                out.append(_event({"type": "content_block_start", "index": 0,
                                   "content_block": _thinking_block("")}))
            out.append(_event({"type": "content_block_delta", "index": 0, "delta": {
                "type": "thinking_delta", "thinking": split.reasoning}}))
        starts = split.content_so_far or (final and not self._thinking_open)
        if split.reasoning_done and starts and not self._answer_open:
            self._answer_open = True
            index = 1 if self._thinking_open else 0
            if self._thinking_open:
                out.append(_event({"type": "content_block_stop", "index": 0}))
            out.append(_event({"type": "content_block_start", "index": index,
                               "content_block": {"type": "text", "text": ""}}))
            self._blocks = StreamBlocks(self.calls, index)
        if not self._answer_open:
            return out
        if self.calls is not None:
            return out + self._blocks.events(split.content_so_far, final)
        text = split.content_so_far[self._text_sent:]
        self._text_sent = len(split.content_so_far)
        if text:
            out.append(_event({"type": "content_block_delta", "index": self._blocks.index,
                               "delta": {"type": "text_delta", "text": text}}))
        return out

    def closing_events(self, finals: list[RequestOutput]) -> list[bytes]:
        sample = finals[0].outputs[0]
        stop_reason, stop_sequence = stop_fields(sample)
        if self._blocks.called and stop_reason == "end_turn":
            stop_reason = "tool_use"
        # Cumulative, and the same input and cache figures as message_start: the SDK
        # overwrites its accumulated usage with any non-null value here.
        usage = {key: self._start_usage[key] for key in
                 ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")}
        usage["output_tokens"] = len(sample.token_ids)
        delta = self._with_edits({"type": "message_delta", "delta": {
            "stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage})
        return [_event({"type": "content_block_stop", "index": self._blocks.index}),
                _event(delta), _event({"type": "message_stop"})]

    def error_events(self, error: APIError) -> list[bytes]:
        return [_event(error_body(error))]  # {"type": "error", "error": {...}}


def _thinking_block(thinking: str) -> dict[str, Any]:
    # The vendor signs its thinking so it can check blocks sent back; nothing here verifies
    # them (thinking blocks sent back are rendered as text), so the signature is empty.
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class StreamBlocks:
    """A streamed message's content blocks when tools are on: text block 0 is open from the
    start; each tool call is a tool_use block of its own, opened by the call's first delta (its
    name) and fed its input as input_json_delta events (one with the whole input, unless the
    stream is incremental); text after a call opens a new text block. Opening a block stops
    the open one; `index` is the open block, which the closing events stop."""

    def __init__(self, calls: CallReading | None, index: int = 0) -> None:
        self._calls = calls
        self._parser = calls.stream() if calls is not None else None
        self.index = index
        self._text_open = True
        self.called = False

    def events(self, visible: str, final: bool) -> list[bytes]:
        assert self._parser is not None and self._calls is not None
        update = self._parser.feed(visible, final)
        calls = [c for c in update.calls if self._calls.keeps(c.index)]
        # A delta without a name adds to the call whose block is open: it comes before any
        # text or call that follows that call.
        out = [self._input(call.arguments) for call in calls if call.name is None]
        if update.content:
            if not self._text_open:
                out += self._open({"type": "text", "text": ""})
            out.append(_event({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "text_delta", "text": update.content}}))
        for call in calls:
            if call.name is not None:
                self.called = True
                out += self._open({"type": "tool_use", "id": _tool_use_id(), "name": call.name,
                                   "input": {}})
                if call.arguments:
                    out.append(self._input(call.arguments))
        return out

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self._text_open = block["type"] == "text"
        return [_event({"type": "content_block_stop", "index": self.index - 1}),
                _event({"type": "content_block_start", "index": self.index,
                        "content_block": block})]

    def _input(self, partial_json: str) -> bytes:
        assert not self._text_open, "input goes to the open tool_use block"
        return _event({"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "input_json_delta", "partial_json": partial_json}})


def _event(data: dict[str, Any]) -> bytes:
    # The SDK dispatches on the `event:` line; the JSON repeats it as `type`.
    return sse(data, event=data["type"])
