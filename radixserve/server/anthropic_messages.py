"""POST /v1/messages, streamed or not: one job per request, its usage fields from the app's
`CacheLedger` (engine truth or vendor rules), its dollar cost in response headers.

A stream waits for the engine's first output before it answers: message_start carries the
usage, and the cost headers price the prompt (the output is not known yet).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.accounting import CacheLedger, JobAccount
from radixserve.server.anthropic_prompt import PreparedPrompt, prepare_prompt
from radixserve.server.anthropic_protocol import (
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
from radixserve.server.serving import Job
from radixserve.server.transport import sse
from radixserve.server.validation import checked_sampling_params
from radixserve.vendors import Cost

COST_HEADER = "x-radixserve-cost-usd"
UNCACHED_COST_HEADER = "x-radixserve-uncached-cost-usd"


async def create_message(request: Request) -> Response:
    return await handle(request, prepare_message)


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
    # A pre-warm still samples one token (the engine always computes logits); it is not sent.
    params = checked_sampling_params(ctx, body, prompt.token_ids, max(1, body.max_tokens),
                                     "messages")
    namespace = cache_namespace(ctx.settings, request.state.api_key, None)
    ledger: CacheLedger = request.app.state.cache_ledger
    return MessagesExchange(ledger, prompt, params, namespace, bool(body.stream),
                            prewarm=body.max_tokens == 0)


def _cost_headers(request_id: str, cost: Cost | None) -> dict[str, str]:
    headers = {"request-id": request_id}
    if cost is not None:
        headers[COST_HEADER] = f"{cost.with_cache:.8f}"
        headers[UNCACHED_COST_HEADER] = f"{cost.without_cache:.8f}"
    return headers


class MessagesExchange(Exchange):
    waits_for_first_output = True

    def __init__(self, ledger: CacheLedger, prompt: PreparedPrompt, params: SamplingParams,
                 namespace: CacheNamespace, stream: bool, prewarm: bool) -> None:
        super().__init__(new_message_id(), stream)
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
                    self._account)]

    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        sample = finals[0].outputs[0]
        usage = self.account.usage
        assert usage is not None  # known from the first output
        if self.prewarm:
            text, (stop_reason, stop_sequence), output_tokens = "", ("max_tokens", None), 0
        else:
            text, (stop_reason, stop_sequence) = sample.text, stop_fields(sample)
            output_tokens = len(sample.token_ids)
        return message_body(self.response_id, self.prompt.model, text, stop_reason,
                            stop_sequence, usage, output_tokens)

    def response_headers(self) -> dict[str, str]:
        return _cost_headers(self.request_id, self.account.cost)

    def stream_headers(self) -> dict[str, str]:
        return _cost_headers(self.request_id, self.account.prompt_cost())

    def opening_events(self) -> list[bytes]:
        assert self.account.usage is not None  # the first output has been seen
        self._start_usage = usage_body(self.account.usage, 1)
        message = {"id": self.response_id, "type": "message", "role": "assistant",
                   "model": self.prompt.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": self._start_usage}
        return [_event({"type": "message_start", "message": message}),
                _event({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
                _event({"type": "ping"})]

    def delta_event(self, delta: Delta) -> bytes | None:
        if not delta.text:
            return None
        return _event({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": delta.text}})

    def closing_events(self, finals: list[RequestOutput]) -> list[bytes]:
        sample = finals[0].outputs[0]
        stop_reason, stop_sequence = stop_fields(sample)
        # Cumulative, and the same input and cache figures as message_start: the SDK
        # overwrites its accumulated usage with any non-null value here.
        usage = {key: self._start_usage[key] for key in
                 ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")}
        usage["output_tokens"] = len(sample.token_ids)
        return [_event({"type": "content_block_stop", "index": 0}),
                _event({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": usage}),
                _event({"type": "message_stop"})]

    def error_events(self, error: APIError) -> list[bytes]:
        return [_event(error_body(error))]  # {"type": "error", "error": {...}}


def _event(data: dict[str, Any]) -> bytes:
    # The SDK dispatches on the `event:` line; the JSON repeats it as `type`.
    return sse(data, event=data["type"])
