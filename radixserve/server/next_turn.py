"""A chat's next turn as the template will render it. Reasoning families' templates (Qwen3's,
SmolLM3's, gpt-oss's) render an earlier assistant turn without the reasoning it was generated
with when the client does not send `reasoning_content` back, so the next request's prompt leaves
the cached conversation inside that turn and re-prefills everything after it.

At a turn's end this renders the history the next turn will start with, finds where it leaves
what the engine generated (the template rewrote assistant turn N, costing the next turn K
tokens), remembers that for the next request's dashboard note, and hands the history to the
engine's background prefill so that the next turn hits anyway.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.model.tokenizer import ChatTokenizer
from radixserve.sequences import common_prefix_len

logger = logging.getLogger(__name__)

# Conversations whose next turn is remembered (least recently ended out first).
MAX_REMEMBERED = 1024

PrefillFn = Callable[[list[int], Hashable], None]
# Two contents that differ at their first character: where renderings with them part is where
# the next message's content begins.
_SENTINELS = ("A", "B")


@dataclass(frozen=True)
class TemplateRewrite:
    """Where the next turn's rendering leaves the generated conversation."""

    assistant_turn: int  # 1-based, among the conversation's assistant messages
    diverges_at: int  # token offset
    tokens: int  # generated tokens after it: what the next turn would re-prefill
    prefilled: bool  # the history was handed to the background prefill

    def note(self) -> str:
        fix = ("prefilled in the background (--next-turn-prefill)" if self.prefilled else
               "send reasoning_content back, or serve with --next-turn-prefill")
        return (f"the template rewrote assistant turn {self.assistant_turn}: "
                f"{self.tokens:,} tokens re-prefilled; {fix}")


def history_ids(tokenizer: ChatTokenizer, dicts: list[dict[str, Any]],
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


def find_rewrite(tokenizer: ChatTokenizer, dicts: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None, extra: dict[str, Any],
                 generated: Sequence[int], history: Sequence[int],
                 prefilled: bool) -> TemplateRewrite | None:
    """The rewrite between `generated` (prompt and reply, as cached) and `history`; None when
    the history extends the generated text (bar the reply's last token: the end-of-turn
    marker may be written differently)."""
    at = common_prefix_len(generated, history)
    if at >= len(generated) - 1:
        return None
    assistants = [i for i, message in enumerate(dicts) if message["role"] == "assistant"]
    # The turn is the last whose prompt, as the history renders it, ends at or before the
    # divergence; searched from the newest (where it usually is: one render).
    for turn in range(len(assistants), 1, -1):
        start = tokenizer.encode_chat(dicts[:assistants[turn - 1]], tools,
                                      add_generation_prompt=True, **extra)
        if len(start) <= at and common_prefix_len(start, history) == len(start):
            return TemplateRewrite(turn, at, len(generated) - at, prefilled)
    return TemplateRewrite(1, at, len(generated) - at, prefilled)


class NextTurnLedger:
    """Rewrites found at turns' ends, by the history they predict (bounded); a request whose
    prompt starts with one carries its note."""

    def __init__(self, prefill: PrefillFn | None) -> None:
        self.prefill = prefill
        self._rewrites: OrderedDict[bytes, TemplateRewrite] = OrderedDict()
        self._lengths: dict[int, int] = {}  # history length -> entries of that length
        self._tasks: set[asyncio.Task[None]] = set()  # the loop holds tasks only weakly

    def spawn(self, analysis: Coroutine[Any, Any, None]) -> None:
        """Runs a turn's analysis (`analyse` then `record`) beside the response."""
        task = asyncio.get_running_loop().create_task(analysis)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def analyse(self, tokenizer: ChatTokenizer, dicts: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, extra: dict[str, Any],
                generated: list[int]) -> tuple[list[int], TemplateRewrite | None]:
        """The next turn's history and the rewrite in it, if any. Touches no state: run it
        off the event loop (it renders and tokenises the whole conversation)."""
        history = history_ids(tokenizer, dicts, tools, extra)
        return history, find_rewrite(tokenizer, dicts, tools, extra, generated, history,
                                     self.prefill is not None)

    def record(self, history: list[int], rewrite: TemplateRewrite, namespace: Hashable) -> None:
        """Remembers a rewrite for the next request's note and hands the history to the
        background prefill (on the event loop)."""
        if self.prefill is not None:
            self.prefill(history, namespace)
        self._remember(_key(history, namespace), len(history), rewrite)

    def note_for(self, prompt: Sequence[int], namespace: Hashable) -> tuple[str, ...]:
        """The note of the rewrite this prompt continues from, if any."""
        for length in sorted(self._lengths, reverse=True):
            if length <= len(prompt):
                found = self._rewrites.get(_key(prompt[:length], namespace))
                if found is not None:
                    return (found.note(),)
        return ()

    def _remember(self, key: bytes, length: int, rewrite: TemplateRewrite) -> None:
        if key not in self._rewrites:
            self._lengths[length] = self._lengths.get(length, 0) + 1
        self._rewrites[key] = rewrite
        self._rewrites.move_to_end(key)
        while len(self._rewrites) > MAX_REMEMBERED:
            old_key, _ = self._rewrites.popitem(last=False)
            old_length = int.from_bytes(old_key[:4], "big")
            self._lengths[old_length] -= 1
            if not self._lengths[old_length]:
                del self._lengths[old_length]


def _key(ids: Sequence[int], namespace: Hashable) -> bytes:
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=16)
    digest.update(b"".join(i.to_bytes(4, "little") for i in ids))
    return len(ids).to_bytes(4, "big") + digest.digest()
