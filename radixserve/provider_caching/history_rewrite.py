"""Where a chat template renders a conversation's history otherwise than the model generated
it. Reasoning families' templates leave an earlier assistant turn's reasoning out of the
history: Qwen3's unless the client sends it back (`reasoning_content`, and only after the last
user message), SmolLM3's always. The next turn's prompt then leaves the cached conversation
inside that turn.

Pure functions over a tokenizer with a chat template: the server (`server.next_turn`) and
the linter (`lint.template_rewrites`) share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.provider_caching.template import ChatTemplateTokenizer
from radixserve.sequences import common_prefix_len

# Two contents that differ at their first character: where renderings with them part is where
# the next message's content begins.
_SENTINELS = ("A", "B")


@dataclass(frozen=True)
class HistoryRewrite:
    """Where the next turn's rendering leaves the generated conversation."""

    assistant_turn: int  # 1-based, among the conversation's assistant messages
    diverges_at: int  # token offset
    tokens: int  # cached tokens after it that the next turn cannot reuse

    def describe(self) -> str:
        return (f"the template rewrote assistant turn {self.assistant_turn}: "
                f"{self.tokens:,} tokens re-prefilled")


def encode_chat(tokenizer: ChatTemplateTokenizer, dicts: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                extra: dict[str, Any]) -> list[int]:
    text = tokenizer.apply_chat_template(dicts, tools, add_generation_prompt, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def next_turn_history(tokenizer: ChatTemplateTokenizer, dicts: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, extra: dict[str, Any]) -> list[int]:
    """The conversation `dicts` (ending with the assistant's reply, as the client will send it
    back) rendered as the next turn's prompt begins: up to the content of the message that
    follows (a tool result after calls, else a user message). Templates render the last
    message apart (Qwen3's keeps an empty think block there), so the reply is rendered with
    a message after it: twice, with two contents, and cut where they part."""
    role = "tool" if dicts and dicts[-1].get("tool_calls") else "user"
    first, second = (tokenizer.apply_chat_template(
        [*dicts, {"role": role, "content": text}], tools, False, **extra)
        for text in _SENTINELS)
    return tokenizer.encode(first[:common_prefix_len(first, second)], add_special_tokens=False)


def find_rewrite(tokenizer: ChatTemplateTokenizer, dicts: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None, extra: dict[str, Any],
                 generated: Sequence[int], history: Sequence[int]) -> HistoryRewrite | None:
    """The rewrite between `generated` (the cached conversation) and `history` (the next
    turn's rendering of `dicts`); None when the history extends the generated text (bar its
    last token: the end-of-turn marker may be written otherwise)."""
    at = common_prefix_len(generated, history)
    if at >= len(generated) - 1:
        return None
    assistants = [i for i, message in enumerate(dicts) if message["role"] == "assistant"]
    # The turn is the last whose prompt, as the history renders it, ends at or before the
    # divergence; searched from the newest (where it usually is: one render).
    for turn in range(len(assistants), 1, -1):
        start = encode_chat(tokenizer, dicts[:assistants[turn - 1]], tools, True, extra)
        if len(start) <= at and common_prefix_len(start, history) == len(start):
            return HistoryRewrite(turn, at, len(generated) - at)
    return HistoryRewrite(1, at, len(generated) - at)
