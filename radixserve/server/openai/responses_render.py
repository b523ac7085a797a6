"""A Responses request's prompt tokens: a first turn renders its items through the chat
template; a turn with `previous_response_id` is the stored token sequence followed by only the
new items, rendered as the template continues a conversation, so the stored tokens are reused
exactly (a guaranteed prefix hit), whatever the template would do to earlier turns on a re-render.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2

from radixserve.model.tokenizer import ChatTokenizer
from radixserve.server.errors import bad_request
from radixserve.server.openai.protocol import ChatMessage
from radixserve.server.openai.responses_protocol import chat_messages
from radixserve.server.prompts import message_dicts, render_chat
from radixserve.server.response_store import StoredResponse

# Stand-ins for an earlier exchange: what the template writes between and after them is the
# text a continuation needs, whatever the real earlier turns held.
_USER_MARK = "\u2063user\u2063"
_ASSISTANT_MARK = "\u2063assistant\u2063"


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    history_len: int  # leading tokens taken as stored from the previous response
    dropped_items: int = 0  # oldest items left out by truncation "auto"


def first_turn(tokenizer: ChatTokenizer, instructions: str | None, items: list[dict[str, Any]],
               tools: list[dict[str, Any]]) -> list[int]:
    system = [ChatMessage(role="system", content=instructions)] if instructions else []
    return render_chat(tokenizer, [*system, *chat_messages(items)], tools or None)


def _render(tokenizer: ChatTokenizer, dicts: list[dict[str, Any]], generation: bool) -> str:
    try:
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=generation)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        raise bad_request(f"the chat template cannot render these items: {exc}",
                          "input") from exc


def continuation(tokenizer: ChatTokenizer, stored: StoredResponse,
                 messages: list[ChatMessage]) -> list[int]:
    """The stored tokens, then `messages` as the template would write them after the stored
    assistant turn, ending with the next assistant turn's opening.

    The text between turns comes from rendering a stand-in exchange with and without the new
    messages: the template's turn close after the assistant's reply (less the end-of-turn token
    the model already wrote, when it wrote one), then the new turns."""
    template = tokenizer.chat_template
    if not template:
        raise bad_request("this model has no chat template; it cannot continue a response",
                          "previous_response_id")
    stand_in = [ChatMessage(role="user", content=_USER_MARK),
                ChatMessage(role="assistant", content=_ASSISTANT_MARK)]
    before = _render(tokenizer, message_dicts(stand_in, None, template), False)
    after = _render(tokenizer, message_dicts([*stand_in, *messages], None, template), True)
    if not after.startswith(before) or _ASSISTANT_MARK not in before:
        raise bad_request("this model's chat template does not write a conversation turn by "
                          "turn, so a stored response cannot be continued by id; send the "
                          "whole conversation as input instead", "previous_response_id")
    close = before[before.index(_ASSISTANT_MARK) + len(_ASSISTANT_MARK):]
    last = stored.token_ids[-1] if len(stored.token_ids) > stored.prompt_len else None
    if last is not None and last in tokenizer.stop_token_ids:
        written = tokenizer.decode([last], skip_special_tokens=False)
        close = close.removeprefix(written)
    text = close + after[len(before):]
    return [*stored.token_ids, *tokenizer.encode(text, add_special_tokens=False)]


def history_items(chain: list[StoredResponse]) -> list[dict[str, Any]]:
    """Every item of a chain of stored responses (oldest first): each one's input, then its
    output; for truncation, which must re-render what it shortens."""
    items: list[dict[str, Any]] = []
    for stored in chain:
        items.extend(stored.input_items)
        items.extend(_as_input(item) for item in stored.body.get("output", []))
    return items


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") == "message":
        text = "".join(part.get("text", "") for part in item.get("content", []))
        return {"type": "message", "role": "assistant", "content": text}
    return {k: item[k] for k in ("type", "call_id", "name", "arguments", "content") if k in item}


def truncated(tokenizer: ChatTokenizer, instructions: str | None, items: list[dict[str, Any]],
              tools: list[dict[str, Any]], fits: int) -> Rendered:
    """The items rendered whole, less the oldest ones while the prompt is longer than `fits`
    tokens (truncation "auto"); the last item is always kept."""
    dropped = 0
    while True:
        ids = first_turn(tokenizer, instructions, items[dropped:], tools)
        if len(ids) <= fits or dropped >= len(items) - 1:
            return Rendered(ids, 0, dropped)
        dropped += 1
        # A call's output never stands without its call: drop them together.
        while dropped < len(items) - 1 and items[dropped].get("type") == "function_call_output":
            dropped += 1
