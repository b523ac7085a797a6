"""Anthropic Messages API shapes: request models (types checked here, cache blocks and
breakpoints by `radixserve.provider_caching`), the response and usage bodies, and the error shape
`{"type": "error", "error": {"type", "message"}}` with a `request-id` header.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import Field

from radixserve.outputs import CompletionOutput
from radixserve.provider_caching.usage import CacheUsage
from radixserve.server.errors import APIError
from radixserve.server.transport import StrictModel

# Block types a text model can read; image and document sources cannot be rendered as text.
TEXT_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")

# The vendor's error type for each status (other 4xx are invalid_request_error).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class CacheControlParam(StrictModel):
    type: str
    ttl: str | None = None


class MessageParam(StrictModel):
    # "system": a system message inside the conversation (what Claude Code sends for its
    # environment); rendered with the template's system role where it stands.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]
    # Only on role "system": "next_user_message" shows it until a later user message exists.
    clear_at: Literal["next_user_message", "never"] | None = None


class CountTokensRequest(StrictModel):
    """POST /v1/messages/count_tokens: a Messages request without the generation fields."""

    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: CacheControlParam | None = None
    # Accepted (agent clients send it by default) and not acted on: this model has no
    # reasoning mode; a response to a request that enables it carries THINKING_HEADER.
    thinking: dict[str, Any] | None = None
    # Anthropic's context editing (server.anthropic.context_editing); checked there.
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Unknown fields are accepted, as the SDK may add some, and named in
    the not-applied header (field_audit.py)."""

    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool | None = None
    service_tier: str | None = None
    # {"format": {"type": "json_schema", "schema": ...}} is enforced (what
    # `client.messages.parse(output_format=Model)` sends); "effort" is a reasoning knob, a
    # no-op here like `thinking`.
    output_config: dict[str, Any] | None = None
    # This request's speculative decoding (extensions, as on the OpenAI routes; the SDK sends
    # them through extra_body; SamplingParams checks the values).
    speculative: str | None = None
    num_speculative_tokens: int | None = None

    def sampling_options(self) -> dict[str, Any]:
        """SamplingParams arguments for the fields set (`validation.SamplingFields`)."""
        options = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                   "stop": self.stop_sequences, "speculative": self.speculative,
                   "num_speculative_tokens": self.num_speculative_tokens}
        return {name: value for name, value in options.items() if value is not None}

    def field_name(self, option: str) -> str:
        return "stop_sequences" if option == "stop" else option


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def error_type(error: APIError) -> str:
    return _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500
                            else "api_error")


def error_body(error: APIError, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error",
                            "error": {"type": error_type(error), "message": error.message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def render_error(error: APIError) -> Response:
    """The error renderer for /v1/messages paths (registered with `errors`)."""
    request_id = new_request_id()
    headers = {**error.headers, "request-id": request_id}
    if error.status >= 500 and error.status not in (503, 529):
        headers.setdefault("x-should-retry", "false")  # a bug: retrying repeats it
    return JSONResponse(error_body(error, request_id), status_code=error.status, headers=headers)


def usage_body(usage: CacheUsage, output_tokens: int) -> dict[str, Any]:
    """`usage` with every cache field present (zeros rather than omitted)."""
    return {**usage.anthropic_fields(), "output_tokens": output_tokens}


def stop_fields(sample: CompletionOutput) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason."""
    if sample.finish_reason == "stop":
        if isinstance(sample.stop_reason, str):
            return "stop_sequence", sample.stop_reason
        return "end_turn", None
    return "max_tokens", None


def message_body(
    message_id: str, model: str, content: list[dict[str, Any]], stop_reason: str,
    stop_sequence: str | None, usage: CacheUsage, output_tokens: int,
) -> dict[str, Any]:
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": usage_body(usage, output_tokens),
    }
