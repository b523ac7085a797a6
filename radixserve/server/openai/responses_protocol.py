"""The Responses API request body (POST /v1/responses, /v1/responses/input_tokens) as a strict
model, and its input items turned into chat messages.

Every field OpenAI documents is either acted on or refused with a 400 naming it; so is every
field it does not document (a Responses client that sends one expects it to mean something).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field

from radixserve.sampling_params import StructuredOutputsParams
from radixserve.server.errors import bad_request
from radixserve.server.openai.protocol import ChatMessage
from radixserve.server.tool_calls.constraints import response_format_constraint
from radixserve.server.transport import StrictModel

# Documented by OpenAI and refused when set to anything but off: what this server cannot do.
REFUSED = {
    "background": "background responses are not supported; send the request and wait for it "
                  "(or stream it)",
    "conversation": "conversations are not supported; continue with previous_response_id",
    "prompt": "stored prompt templates are not supported; send the input itself",
    "max_tool_calls": "max_tool_calls is not supported; this server runs no built-in tools",
    "context_management": "context_management is not supported; use truncation",
    "stream_options": "stream_options is not supported on /v1/responses",
}
INCLUDABLE = ("message.output_text.logprobs",)
_INPUT_TEXT = ("input_text", "output_text", "text")


class TextFormat(StrictModel):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextFormat | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    # Keys the prefix-cache namespace (as cache_salt does on chat completions).
    prompt_cache_key: str | None = Field(None, min_length=1)
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    # Accepted without effect on the output: they describe the caller or OpenAI's billing.
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    background: bool | None = None

    def check_supported(self) -> None:
        """400 naming the first field set that this server cannot honour."""
        extra = self.model_extra or {}
        for name, value in {**extra, "background": self.background}.items():
            if value in (None, False):
                continue
            if name in REFUSED:
                raise bad_request(f"{name}: {REFUSED[name]}.", name)
            raise bad_request(f"{name} is not a parameter this server knows for /v1/responses.",
                              name)
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise bad_request("reasoning (effort, summary) is not supported: no chat template "
                              "this server renders takes an effort setting, and it writes no "
                              "summaries. Where the model reasons (--reasoning-parser), its "
                              "reasoning is returned as a reasoning item. Omit the field or "
                              "send null.", "reasoning")
        for name in self.include or []:
            if name not in INCLUDABLE:
                raise bad_request(f"include {name!r} is not supported; this server can include "
                                  f"{', '.join(INCLUDABLE)}.", "include")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise bad_request("text.verbosity is not supported.", "text.verbosity")
        if self.metadata is not None and len(self.metadata) > 16:
            raise bad_request("metadata holds at most 16 pairs.", "metadata")

    # ----- as SamplingParams and the chat machinery take them -----

    def sampling_options(self) -> dict[str, Any]:
        logprobs = None
        if "message.output_text.logprobs" in (self.include or []) or self.top_logprobs:
            logprobs = self.top_logprobs or 0
        options = {"temperature": self.temperature, "top_p": self.top_p, "logprobs": logprobs}
        return {name: value for name, value in options.items() if value is not None}

    def field_name(self, option: str) -> str:
        return {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}.get(option, option)

    def function_tools(self) -> list[dict[str, Any]]:
        """The tools in chat completions' shape; built-in tools are a 400."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise bad_request(f"tool type {tool.get('type')!r} is not supported: this "
                                  "server runs no built-in tools; declare function tools.",
                                  f"tools.{i}.type")
            function = {k: v for k, v in tool.items() if k != "type"}
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad_request('tool_choice must be "none", "auto", "required" or '
                                  '{"type": "function", "name": ...}.', "tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def output_constraint(self) -> StructuredOutputsParams | None:
        """text.format as a grammar: json_schema and json_object through the grammar engine."""
        spec = self.text.format if self.text is not None else None
        if spec is None or spec.get("type") != "json_schema":
            return response_format_constraint(spec)
        schema = {"name": spec.get("name"), "schema": spec.get("schema", {"type": "object"})}
        return response_format_constraint({"type": "json_schema", "json_schema": schema})


def _text(content: Any, path: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{path} must be a string or a list of content parts.", path)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _INPUT_TEXT:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"content part type {kind!r} is not supported: this model reads "
                              "text parts only (input_text).", f"{path}.{j}")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _arguments(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (a string input is one user message)."""
    raw = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                            "text": body.input}]}] \
        if isinstance(body.input, str) else body.input
    items = []
    for item in raw:
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}.get(kind, "item")
        items.append({"id": f"{prefix}_{uuid.uuid4().hex}", **item, "type": kind})
    return items


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise bad_request(f"{path}.content must be a list of reasoning_text parts.",
                          f"{path}.content")
    return "".join(str(part.get("text", "")) for part in parts)


def chat_messages(items: list[dict[str, Any]], param: str = "input") -> list[ChatMessage]:
    """Input items as chat messages: consecutive function calls join one assistant message
    (the one before them, if it is the assistant's), outputs become tool messages, and a
    reasoning item is the next assistant message's `reasoning_content` (templates that keep
    earlier reasoning render it)."""
    messages: list[ChatMessage] = []
    thought: str | None = None
    for i, item in enumerate(items):
        kind, path = item.get("type"), f"{param}.{i}"
        if kind == "reasoning":
            thought = _reasoning_text(item, path)
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{path}.role must be user, system, developer or assistant.",
                                  f"{path}.role")
            messages.append(ChatMessage(role=role, content=_text(item.get("content"),
                                                                 f"{path}.content")))
            if role == "assistant":
                messages[-1].reasoning_content, thought = thought, None
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": _arguments(item.get("arguments"))}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call],
                                            reasoning_content=thought))
                thought = None
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(ChatMessage(role="tool", tool_call_id=item.get("call_id"),
                                        content=_text(output, f"{path}.output")))
        else:
            raise bad_request(f"input item type {kind!r} is not supported (message, "
                              "function_call, function_call_output and reasoning are).",
                              f"{path}.type")
    return messages
