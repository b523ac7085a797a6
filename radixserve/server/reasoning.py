"""A reply's reasoning split from its answer, for each reasoning format a model family writes:
`think` (Qwen3, Qwen3-MoE, SmolLM3: `<think>...</think>` opening the assistant turn, or opened
by the template in the prompt so that the reply starts inside it) and `none`.

The OpenAI chat route returns the reasoning as `reasoning_content`, the Anthropic route as a
`thinking` block; the answer alone goes on to the tool-call parser. Like the tool-call streams,
a stream is fed the whole text so far and what it sends always adds up to the split of the
finished reply.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

REASONING_PARSERS: tuple[str, ...] = ("auto", "none", "think")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """A reply's parts: the reasoning (stripped of surrounding whitespace), the answer after it
    (leading whitespace dropped), and where in the reply the reasoning ends (the end of its
    closing tag; 0 without reasoning, the reply's length when it never closed)."""

    reasoning: str
    content: str
    reasoning_end: int


class ReasoningFormat(ABC):
    """How one family marks reasoning in its replies."""

    name: str

    @abstractmethod
    def split(self, text: str, final: bool) -> ReasoningSplit:
        """The parts of `text`. Not final: text that could still turn into a marker is in
        neither part (held back), and the reasoning's trailing whitespace is held too."""

    @abstractmethod
    def opened_in_prompt(self, prompt_tail: str) -> bool:
        """Whether the rendered prompt (its last characters) leaves reasoning open, so that
        the reply starts inside it."""


class NoReasoning(ReasoningFormat):
    name = "none"

    def split(self, text: str, final: bool) -> ReasoningSplit:
        return ReasoningSplit("", text, 0)

    def opened_in_prompt(self, prompt_tail: str) -> bool:
        return False


class ThinkTags(ReasoningFormat):
    """`<think>reasoning</think>answer`; `inside`: the prompt opened the tag already."""

    name = "think"

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside

    def opened_in_prompt(self, prompt_tail: str) -> bool:
        return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)

    def split(self, text: str, final: bool) -> ReasoningSplit:
        start = 0
        if not self.inside:
            lead = len(text) - len(text.lstrip())
            if text.startswith(THINK_OPEN, lead):
                start = lead + len(THINK_OPEN)
            elif not final and THINK_OPEN.startswith(text[lead:]):
                return ReasoningSplit("", "", 0)  # may still open
            else:
                return ReasoningSplit("", text, 0)
        close = text.find(THINK_CLOSE, start)
        if close >= 0:
            end = close + len(THINK_CLOSE)
            return ReasoningSplit(text[start:close].strip(), text[end:].lstrip(), end)
        if final:  # never closed (cut off by max_tokens or a stop): all of it was reasoning
            return ReasoningSplit(text[start:].strip(), "", len(text))
        held = _partial_suffix(text, start, THINK_CLOSE)
        return ReasoningSplit(text[start:len(text) - held].strip(), "", 0)


def _partial_suffix(text: str, start: int, marker: str) -> int:
    """Length of the longest end of text[start:] that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def reasoning_format(name: str, prompt_tail: str = "") -> ReasoningFormat:
    """The format named `name` ("none" or "think"), told whether the prompt left it open."""
    if name == "none":
        return NoReasoning()
    if name == "think":
        return ThinkTags(inside=ThinkTags().opened_in_prompt(prompt_tail))
    raise ValueError(f"unknown reasoning parser {name!r}; choose one of: "
                     f"{', '.join(REASONING_PARSERS)}")


def format_for(family_parser: str, chat_template: str | None) -> str:
    """The `auto` choice: the model family's own format, else `think` where the chat template
    writes think tags, else none."""
    if family_parser != "none":
        return family_parser
    return "think" if THINK_CLOSE in (chat_template or "") else "none"


@dataclass(frozen=True)
class ReasoningUpdate:
    """What a feed made safe to send: reasoning text since the last feed, and the answer so
    far (all of it: the tool-call stream takes the whole text each time)."""

    reasoning: str
    content_so_far: str
    reasoning_done: bool  # the answer has begun, or the reply ended


class ReasoningStream:
    """Splits a reply while it is generated; the reasoning of all updates concatenates to the
    split of the finished reply."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._format = fmt
        self._sent = 0

    def feed(self, text_so_far: str, final: bool) -> ReasoningUpdate:
        split = self._format.split(text_so_far, final)
        new = split.reasoning[self._sent:]
        self._sent = len(split.reasoning)
        done = final or split.reasoning_end > 0 or (split.content != "" and not split.reasoning)
        return ReasoningUpdate(new, split.content, done)


def reasoning_tokens(token_ids: list[int], split: ReasoningSplit,
                     decode: Callable[[list[int]], str]) -> int:
    """How many of the reply's tokens its reasoning took: the shortest run of leading tokens
    whose text reaches the end of the reasoning (its closing tag included)."""
    if split.reasoning_end == 0:
        return 0
    low, high = 1, len(token_ids)
    while low < high:  # decoding a longer prefix only adds text
        middle = (low + high) // 2
        if len(decode(token_ids[:middle])) >= split.reasoning_end:
            high = middle
        else:
            low = middle + 1
    return high
