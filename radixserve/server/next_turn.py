"""A chat's next turn as the template will render it. Reasoning families' templates (Qwen3's,
SmolLM3's) render an earlier assistant turn without the reasoning it was generated with when
the client does not send `reasoning_content` back (SmolLM3's even when it does), so the next request's prompt leaves
the cached conversation inside that turn and re-prefills everything after it.

At a turn's end this renders the history the next turn will start with, finds where it leaves
what the engine generated (the template rewrote assistant turn N, costing the next turn K
tokens), remembers that for the next request's dashboard note, and hands the history to the
engine's background prefill so that the next turn hits anyway.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.model.tokenizer import ChatTokenizer
from radixserve.provider_caching.history_rewrite import (
    HistoryRewrite,
    find_rewrite,
    next_turn_history,
)

# Conversations whose next turn is remembered (least recently ended out first).
MAX_REMEMBERED = 1024

# (history, namespace, the engine the turn ran on among several: EngineFront's affinity)
PrefillFn = Callable[[list[int], Hashable, str | None], None]


@dataclass(frozen=True)
class TemplateRewrite:
    """A rewrite found at a turn's end, and whether its history went to the prefill."""

    rewrite: HistoryRewrite
    prefilled: bool

    @property
    def tokens(self) -> int:
        return self.rewrite.tokens

    def note(self) -> str:
        fix = ("prefilled in the background (--next-turn-prefill)" if self.prefilled else
               "send reasoning_content back, or serve with --next-turn-prefill")
        return f"{self.rewrite.describe()}; {fix}"


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
        history = next_turn_history(tokenizer, dicts, tools, extra)
        found = find_rewrite(tokenizer, dicts, tools, extra, generated, history)
        return history, (None if found is None else
                         TemplateRewrite(found, self.prefill is not None))

    def record(self, history: list[int], rewrite: TemplateRewrite, namespace: Hashable,
               affinity: str | None = None) -> None:
        """Remembers a rewrite for the next request's note and hands the history to the
        background prefill (on the event loop), on the engine `affinity` names."""
        if self.prefill is not None:
            self.prefill(history, namespace, affinity)
        self._remember(_key(history, namespace), len(history), rewrite)

    def note_for(self, prompt: Sequence[int], namespace: Hashable) -> tuple[str, ...]:
        """The note of the longest remembered history this prompt starts with, if any: one
        pass over the prompt, whatever the number of histories remembered."""
        digest, done, found = _digest(namespace), 0, None
        for length in sorted(n for n in self._lengths if n <= len(prompt)):
            digest.update(_ids_bytes(prompt[done:length]))
            done = length
            found = self._rewrites.get(_sealed(length, digest)) or found
        return (found.note(),) if found is not None else ()

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
    digest = _digest(namespace)
    digest.update(_ids_bytes(ids))
    return _sealed(len(ids), digest)


def _digest(namespace: Hashable) -> Any:
    return hashlib.blake2b(repr(namespace).encode(), digest_size=16)


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return array("I", ids).tobytes()


def _sealed(length: int, digest: Any) -> bytes:
    """A history's key: its length first (read back when it is forgotten), then its digest."""
    return length.to_bytes(4, "big") + digest.copy().digest()
