"""Chat messages and tools to prompt token ids, with the model's own chat template.

Rendering is deterministic (sorted JSON keys, fixed wording) so that the same conversation
prefix always becomes the same tokens: the prefix cache can only reuse what renders identically.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2

from radixserve.model.tokenizer import ChatTokenizer
from radixserve.server.errors import bad_request
from radixserve.server.openai.protocol import ChatMessage

# For templates that ignore `tools`, the tools go into the system message in this form.
TOOLS_PREAMBLE = (
    "You can call the tools below. Each line is one tool's JSON definition:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\nTo call a tool, reply with one line per call: "
    '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
)
_TEXT_PARTS = ("text", "input_text")
# What the server itself passes to every template render: not a client's to set.
_RENDER_ARGUMENTS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The deterministic text that carries `tools` for templates without tool support."""
    return TOOLS_PREAMBLE + "\n".join(_json(tool) for tool in tools) + TOOLS_POSTAMBLE


def _content_text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type != "refusal":
            raise bad_request(
                f"content part type {part.type!r} is not supported: this model reads text "
                "parts only ({\"type\": \"text\", \"text\": ...})",
                param=f"messages.{index}.content.{j}")
    # Parts are concatenated as written: splitting a text into parts (for example at a cache
    # breakpoint) must not change the tokens.
    return "".join(texts)


def _tool_calls_text(calls: list[dict[str, Any]]) -> str:
    lines = []
    for call in calls:
        function = call.get("function") if isinstance(call.get("function"), dict) else call
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        # The name first, as the tools section asks and a forced call is generated; arguments
        # with sorted keys, so that a turn's history renders the same every time.
        call = json.dumps({"name": function.get("name")}, ensure_ascii=False)[:-1] + (
            ', "arguments": ' + _json(arguments) + "}")
        lines.append(f"<tool_call>{call}</tool_call>")
    return "\n".join(lines)


def message_dicts(
    messages: list[ChatMessage], tools: list[dict[str, Any]] | None, template: str
) -> list[dict[str, Any]]:
    """Messages as the template expects them: string content, known roles, tools in text
    where the template itself has no place for them."""
    template_tools = "tools" in template
    template_calls = "tool_calls" in template
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        # "developer" is OpenAI's new name for "system"; templates only know the old one.
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": _content_text(message, i)}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None and "reasoning_content" in template:
            item["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            if template_calls:
                item["tool_calls"] = message.tool_calls
            else:
                calls = _tool_calls_text(message.tool_calls)
                item["content"] = f"{item['content']}\n{calls}" if item["content"] else calls
        result.append(item)
    if tools and not template_tools:
        section = tools_section(tools)
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": f"{result[0]['content']}\n\n{section}"}
        else:
            result.insert(0, {"role": "system", "content": section})
    return result


def template_arguments(template: str, arguments: dict[str, Any] | None,
                       param: str = "chat_template_kwargs") -> dict[str, Any]:
    """A client's extra template arguments, checked: 400 for one the server sets itself or
    one this template never reads (it would be ignored)."""
    for name in arguments or {}:
        if name in _RENDER_ARGUMENTS:
            raise bad_request(f"{param}: {name!r} is set by the server", param)
        if name not in template:
            raise bad_request(f"{param}: this model's chat template does not read {name!r}",
                              param)
    return dict(arguments or {})


def render_chat(
    tokenizer: ChatTokenizer, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids of a conversation, ending with the assistant's turn opening;
    `template_kwargs` go to the template as extra arguments (`template_arguments`).

    Raises APIError(400) when the template cannot render the conversation.
    """
    template = tokenizer.chat_template
    if not template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    dicts = message_dicts(messages, tools, template)
    extra = template_arguments(template, template_kwargs)
    try:
        return tokenizer.encode_chat(dicts, tools if tools and "tools" in template else None,
                                     **extra)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        # Templates reject some conversations themselves (raise_exception), e.g. roles out
        # of order; that is the client's input, not a server fault.
        raise bad_request(f"the chat template cannot render these messages: {exc}",
                          "messages") from exc
