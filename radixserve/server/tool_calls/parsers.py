"""Model output text to OpenAI-style tool calls, for each chat-template family's call format.

The server needs calls as structured values for a finished reply and piece by piece while
streaming; both views come from one splitter per family, so a stream always adds up to the parse.
A call's arguments are the JSON text the model wrote, so a stream can send them as they are
generated (`ToolCallStream(incremental=True)`) and still add up to the parse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.server.tool_calls.json_spans import (
    DECODER,
    Member,
    element_starts,
    members,
    sendable,
    skip_space,
)
from radixserve.server.tool_calls.partial import PartialCall, UnfinishedBlock

PARSERS: tuple[str, ...] = ("hermes", "smollm2", "llama3_json")

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# SmolLM2-style prompts show a JSON list right after the open tag (possibly as an escaped "\n").
_LIST_STYLE_HINT = re.compile(r"<tool_call>(?:\s|\\n)*\[")
_LLAMA_HINTS = (PYTHON_TAG, "ipython")
# Between llama3_json call objects; also skipped after <|python_tag|>.
_JSON_SEPARATORS = " \t\r\n;"
_CALL_KEYS = ("name", "arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    """One call. `arguments` is the model's arguments object as it wrote it (valid JSON, less
    surrounding whitespace), so streamed pieces of it add up to it; arguments written as a JSON
    string holding an object are decoded and re-encoded (json.dumps, ensure_ascii=False), and
    missing or null arguments are "{}"."""

    name: str
    arguments: str


# Whether a well-formed call counts as one (the server's check of names and strict schemas);
# a refused call stays content, like a malformed one.
CallCheck = Callable[[ToolCall], bool]


@dataclass(frozen=True)
class ParsedOutput:
    """A finished reply: the text outside well-formed calls (stripped) and the calls in order."""

    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI streaming semantics: the first delta of call `index` carries its name; the
    arguments of all deltas of one index concatenate to that call's `arguments`."""

    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StreamUpdate:
    """What became safe to send since the previous feed."""

    content: str
    calls: list[ToolCallDelta]


@dataclass(frozen=True)
class _Abandoned:
    """The calls announced from an unfinished block will not complete (it turned out malformed
    or the reply ended in it): they stay as sent, and the block's text is not content."""


_Piece = str | ToolCall | PartialCall | _Abandoned


def _decode_call(text: str, start: int) -> ToolCall | None:
    """The call the JSON value at text[start] describes, or None when it is not a well-formed
    call. The value must be valid JSON. A repeated name or arguments key, or both "arguments"
    and "parameters", is ambiguous (a stream may have sent the first), so not a call."""
    if text[start] != "{":
        return None
    found: dict[str, Member] = {}
    for member in members(text, start):
        if member.key in _CALL_KEYS:
            if member.key in found:
                return None
            found[member.key] = member
    name = found["name"].value if "name" in found else None
    if not isinstance(name, str) or not name or not sendable(name):
        return None
    # Hermes prompts say "arguments", Llama's say "parameters"; models mix them up.
    if "arguments" in found and "parameters" in found:
        return None
    member = found.get("arguments", found.get("parameters"))
    if member is None or member.value is None:  # a function without parameters
        return ToolCall(name, "{}")
    if isinstance(member.value, dict):
        arguments = text[member.start:member.end]
        return ToolCall(name, arguments) if sendable(member.value) else None
    if not isinstance(member.value, str):
        return None
    try:  # some models write the arguments as a JSON string
        value = DECODER.decode(member.value)
        arguments = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    return ToolCall(name, arguments) if isinstance(value, dict) and sendable(value) else None


def _decode_block(body: str) -> list[ToolCall] | None:
    """The calls between one pair of tags: an object, or a list of objects (SmolLM2, where
    `[]` means "no call"). One bad call makes the whole block None."""
    try:
        value = DECODER.decode(body)
    except (ValueError, RecursionError):
        return None
    start = skip_space(body, 0)
    calls = []
    for item in element_starts(body, start) if isinstance(value, list) else [start]:
        call = _decode_call(body, item)
        if call is None:
            return None
        calls.append(call)
    return calls


def _abandoned(block: UnfinishedBlock, text: str) -> list[_Piece]:
    """The end of a block whose announced calls will not complete: what they gained since the
    last feed, then the mark that they are over."""
    return [*block.partial_calls(text, announce=False), _Abandoned()]


def _partial_open_tag(text: str, start: int) -> int:
    """Length of the longest end of text[start:] that could still grow into TOOL_CALL_OPEN."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text) - start), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:size]):
            return size
    return 0


class _TagSplitter:
    """hermes and smollm2: calls are JSON between <tool_call> and the next </tool_call>; the
    rest is content. A block that does not decode to calls stays content, tags included, unless
    an incremental stream has announced calls from it."""

    def __init__(self, incremental: bool, accept: CallCheck | None) -> None:
        self._incremental = incremental
        self._accept = accept
        self._done = 0  # text[:_done] has been split
        self._close_from = 0  # where to resume looking for the open call's close tag
        self._block: UnfinishedBlock | None = None  # the open block's calls, when incremental

    def split(self, text: str, final: bool) -> list[_Piece]:
        pieces: list[_Piece] = []
        while self._done < len(text):
            start = text.find(TOOL_CALL_OPEN, self._done)
            if start < 0:
                end = len(text) if final else len(text) - _partial_open_tag(text, self._done)
                pieces.append(text[self._done:end])
                self._done = end
                break
            pieces.append(text[self._done:start])
            body_start = start + len(TOOL_CALL_OPEN)
            if self._incremental and self._block is None:
                self._block = UnfinishedBlock(body_start, lists=True)
            close = text.find(TOOL_CALL_CLOSE, max(body_start, self._close_from))
            if close < 0:
                if final:  # unterminated: the model stopped inside the call
                    pieces.extend(self._abandon(text) or [text[start:]])
                    self._done = len(text)
                else:
                    self._done = start
                    # A close tag can only end in text not searched yet: scanning from here
                    # keeps a long call linear rather than quadratic in its length.
                    self._close_from = max(body_start, len(text) - len(TOOL_CALL_CLOSE) + 1)
                    if self._block is not None:
                        pieces.extend(self._block.partial_calls(text))
                break
            end = close + len(TOOL_CALL_CLOSE)
            calls = _accepted(_decode_block(text[body_start:close]), self._accept)
            if calls is None:
                pieces.extend(self._abandon(None) or [text[start:end]])
            else:
                assert self._block is None or len(calls) >= self._block.announced
                pieces.extend(calls)
            self._block = None
            self._done = end
        return pieces

    def _abandon(self, text: str | None) -> list[_Piece]:
        """The end of a block that is not calls, when it had announced some ([] when not). An
        unterminated block's calls get what they gained from `text`; a closed block's, nothing
        (a malformed object could run on into the close tag)."""
        block, self._block = self._block, None
        if block is None or not block.announced:
            return []
        return [_Abandoned()] if text is None else _abandoned(block, text)


class _JsonSplitter:
    """llama3_json: a reply that starts with `{` or <|python_tag|> is a run of JSON call objects
    separated by `;` or whitespace. Text from the first thing that is not a well-formed call
    object is content; if that is the very first object, the whole reply is content (but an
    object an incremental stream has announced a call from is dropped, not content)."""

    def __init__(self, incremental: bool, accept: CallCheck | None) -> None:
        self._incremental = incremental
        self._accept = accept
        self._done = 0
        self._decided = False  # whether the reply's start has shown if it is calls or content
        self._in_calls = False
        self._has_calls = False
        # Text length at the last failed decode: an object can only complete with a new "}".
        self._failed_at = 0
        self._block: UnfinishedBlock | None = None  # the open object's call, when incremental

    def split(self, text: str, final: bool) -> list[_Piece]:
        pieces: list[_Piece] = []
        if not self._decided:
            head = text.lstrip()
            if not final and PYTHON_TAG.startswith(head):  # nothing yet, or part of the tag
                return pieces
            self._decided = True
            self._in_calls = head.startswith(("{", PYTHON_TAG))
            if head.startswith(PYTHON_TAG):
                self._done = len(text) - len(head) + len(PYTHON_TAG)
        if self._in_calls:
            self._split_calls(text, final, pieces)
        if not self._in_calls:
            pieces.append(text[self._done:])
            self._done = len(text)
        return pieces

    def _split_calls(self, text: str, final: bool, pieces: list[_Piece]) -> None:
        while True:
            start = self._done
            while start < len(text) and text[start] in _JSON_SEPARATORS:
                start += 1
            if start == len(text):
                if final:
                    self._done = start
                return
            if text[start] != "{":
                self._switch_to_content(start)
                return
            if self._incremental and self._block is None:
                self._block = UnfinishedBlock(start, lists=False)
            if not final and text.find("}", self._failed_at) < 0:
                self._partial_calls(text, pieces)
                return
            try:
                _, end = DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                # Incomplete and malformed look alike until the reply ends.
                if final:
                    self._give_up(text, start, len(text), pieces)
                else:
                    self._failed_at = len(text)
                    self._partial_calls(text, pieces)
                return
            call = _decode_call(text, start)
            calls = _accepted(None if call is None else [call], self._accept)
            if calls is None:
                self._give_up(text, start, end, pieces)
                return
            assert self._block is None or self._block.announced <= 1
            self._block = None
            pieces.extend(calls)
            self._has_calls = True
            self._done = end

    def _partial_calls(self, text: str, pieces: list[_Piece]) -> None:
        if self._block is not None:
            pieces.extend(self._block.partial_calls(text))

    def _give_up(self, text: str, start: int, end: int, pieces: list[_Piece]) -> None:
        """text[start:end] is not a call: content from there on, less that object if an
        incremental stream has announced its call."""
        block, self._block = self._block, None
        if block is None or not block.announced:
            self._switch_to_content(start)
            return
        pieces.extend(_abandoned(block, text))
        self._in_calls = False
        self._done = end

    def _switch_to_content(self, start: int) -> None:
        self._in_calls = False
        # Before any call, the reply was never a call: all of it is content, tag included.
        self._done = start if self._has_calls else 0


def _accepted(calls: list[ToolCall] | None, accept: CallCheck | None) -> list[ToolCall] | None:
    """`calls`, or None (a malformed block) when `accept` refuses any of them."""
    if calls is None or accept is None or all(accept(call) for call in calls):
        return calls
    return None


def _splitter(family: str, incremental: bool = False,
              accept: CallCheck | None = None) -> _TagSplitter | _JsonSplitter:
    if family in ("hermes", "smollm2"):
        return _TagSplitter(incremental, accept)
    if family == "llama3_json":
        return _JsonSplitter(incremental, accept)
    raise ValueError(f"unknown tool-call family {family!r}; choose one of: {', '.join(PARSERS)}")


def parse_tool_calls(text: str, family: str, accept: CallCheck | None = None) -> ParsedOutput:
    """The calls in a finished reply, and the text outside them with surrounding whitespace
    stripped. Malformed or unterminated calls, and calls `accept` refuses (an unknown tool,
    arguments outside a strict schema), stay in the content as written; never raises for
    model output. Raises ValueError for a family not in PARSERS."""
    pieces = _splitter(family, accept=accept).split(text, final=True)
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    return ParsedOutput(content.strip(), [piece for piece in pieces if isinstance(piece, ToolCall)])


def family_for_template(chat_template: str | None) -> str:
    """The tool-call family a chat template teaches its model. Templates without tool support
    get radixserve's fallback tools prompt, which asks for hermes calls."""
    template = chat_template or ""
    if TOOL_CALL_OPEN in template:
        return "smollm2" if _LIST_STYLE_HINT.search(template) else "hermes"
    if any(hint in template for hint in _LLAMA_HINTS):
        return "llama3_json"
    return "hermes"


class ToolCallStream:
    """Splits a reply into content and calls while it is generated. Each call of `feed` gets the
    whole text so far and returns what is new: content that can no longer turn into a call
    (a possible start of <tool_call> is held back), and call deltas. With final=True everything
    left is flushed, malformed calls as content. The content of all updates concatenates to
    parse_tool_calls(text, family).content: leading whitespace is dropped and trailing
    whitespace is held until more content follows it.

    By default each call is sent once its JSON is complete, as one delta with its name and all
    its arguments. With incremental=True a call that names its function before its arguments
    object begins (as a forced call's grammar writes it) is announced as soon as that object
    has begun (a delta with the name and the arguments so far), and the arguments' text
    follows as it is generated, never past the object's end; other calls are sent whole.
    Either way a call's deltas concatenate to its parsed `arguments`, with one exception in
    incremental mode: a call announced and then cut off (the reply ends, as at max_tokens) or
    malformed is not taken back. Its deltas stay as sent and its text is not sent as content,
    where parse_tool_calls keeps it as content: a client sees a partial call, as from
    OpenAI's API when a call is cut by the length limit."""

    def __init__(self, family: str, incremental: bool = False,
                 accept: CallCheck | None = None) -> None:
        self._splitter = _splitter(family, incremental, accept)
        self._next_index = 0
        # Calls announced and not complete, numbered from _next_index: where each one's
        # arguments begin in the text, and how far they have been sent.
        self._announced: list[tuple[int, int]] = []
        self._sent_text = False
        self._held_space = ""
        self._seen = 0
        self._finished = False

    def feed(self, text_so_far: str, final: bool) -> StreamUpdate:
        """Raises ValueError after a final feed or when the text is shorter than before."""
        if self._finished:
            raise ValueError("this stream has had its final feed")
        if len(text_so_far) < self._seen:
            raise ValueError("text_so_far must extend the text fed before")
        self._seen = len(text_so_far)
        self._finished = final
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        partial = 0  # the partial calls of this feed, which are those of the open block
        for piece in self._splitter.split(text_so_far, final):
            if isinstance(piece, ToolCall):
                calls.extend(self._complete(piece, text_so_far))
            elif isinstance(piece, PartialCall):
                calls.extend(self._grow(partial, piece, text_so_far))
                partial += 1
            elif isinstance(piece, _Abandoned):
                self._next_index += len(self._announced)
                self._announced.clear()
            else:
                content.append(self._sendable(piece))
        return StreamUpdate("".join(content), calls)

    def _complete(self, call: ToolCall, text: str) -> list[ToolCallDelta]:
        """The delta of a complete call: all of it, or what was not sent when announced."""
        index = self._next_index
        self._next_index += 1
        if not self._announced:
            return [ToolCallDelta(index, call.name, call.arguments)]
        start, sent = self._announced.pop(0)
        assert call.arguments[:sent - start] == text[start:sent], "a call extends what was sent"
        rest = call.arguments[sent - start:]
        return [ToolCallDelta(index, None, rest)] if rest else []

    def _grow(self, ordinal: int, call: PartialCall, text: str) -> list[ToolCallDelta]:
        """The delta of the `ordinal`th call of the open block: its announcement, or the
        arguments it gained since the last feed."""
        index = self._next_index + ordinal
        if ordinal == len(self._announced):
            self._announced.append((call.arguments_start, call.arguments_end))
            return [ToolCallDelta(index, call.name,
                                  text[call.arguments_start:call.arguments_end])]
        start, sent = self._announced[ordinal]
        self._announced[ordinal] = (start, call.arguments_end)
        gained = text[sent:call.arguments_end]
        return [ToolCallDelta(index, None, gained)] if gained else []

    def _sendable(self, text: str) -> str:
        if not self._sent_text:
            text = text.lstrip()
            if not text:
                return ""
            self._sent_text = True
        text = self._held_space + text
        ready = text.rstrip()
        self._held_space = text[len(ready):]
        return ready
