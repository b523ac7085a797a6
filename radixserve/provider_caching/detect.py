"""Which API a request body is written for: OpenAI chat completions or Anthropic messages,
judged by the fields only one of them has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

ApiFormat = Literal["anthropic", "openai"]


class BodyError(ValueError):
    """A body that is not a chat request we can render; `path` names the offending field."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


_OPENAI_KEYS = frozenset({
    "response_format", "reasoning_effort", "reasoning", "n", "logprobs", "top_logprobs",
    "max_completion_tokens", "stream_options", "prompt_cache_key", "prompt_cache_retention",
    "frequency_penalty", "presence_penalty", "seed", "parallel_tool_calls", "logit_bias", "user",
    "functions", "function_call", "modalities", "audio", "verbosity", "store",
    "safety_identifier", "web_search_options", "prediction", "stop",
})
_ANTHROPIC_KEYS = frozenset({
    "system", "stop_sequences", "top_k", "thinking", "cache_control", "output_config",
    "output_format", "container", "mcp_servers",
})
_ANTHROPIC_PARTS = frozenset({
    "tool_use", "tool_result", "document", "thinking", "redacted_thinking", "search_result",
    "server_tool_use", "container_upload",
})
_OPENAI_PARTS = frozenset({"image_url", "input_audio", "file", "refusal"})


def detect_format(body: Any) -> ApiFormat:
    """Says whether `body` is an Anthropic messages or an OpenAI chat-completions request.

    Votes on keys only one API has (top-level fields, message roles, content-part types, tool
    shapes, `cache_control`); a tie goes to the model name ("claude-..."), then to Anthropic
    when `max_tokens` is present (it is required there), else OpenAI.
    """
    if not isinstance(body, Mapping):
        raise BodyError("a request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BodyError("no 'messages' list: neither a chat-completions nor a messages request")
    votes = sum(1 for k in body if k in _ANTHROPIC_KEYS) - sum(1 for k in body if k in _OPENAI_KEYS)
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        if message.get("role") in ("system", "developer", "tool", "function"):
            votes -= 1
        if "tool_calls" in message or "tool_call_id" in message:
            votes -= 1
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            votes += (kind in _ANTHROPIC_PARTS) + ("cache_control" in part)
            votes += kind == "image" and "source" in part
            votes -= kind in _OPENAI_PARTS
    for tool in body.get("tools") or ():
        if isinstance(tool, Mapping):
            votes += "input_schema" in tool
            votes -= "function" in tool
    if votes:
        return "anthropic" if votes > 0 else "openai"
    model = str(body.get("model") or "")
    if model.startswith("claude"):
        return "anthropic"
    if model.startswith(("gpt", "o1", "o3", "o4", "chatgpt")):
        return "openai"
    return "anthropic" if "max_tokens" in body else "openai"
