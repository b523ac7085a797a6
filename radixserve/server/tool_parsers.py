"""Model output text to OpenAI-style tool calls, for each chat-template family's call format.

The server needs calls as structured values for a finished reply and piece by piece while
streaming; both views come from one splitter per family, so a stream always adds up to the parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS: tuple[str, ...] = ("hermes", "smollm2", "llama3_json")

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# SmolLM2-style prompts show a JSON list right after the open tag (possibly as an escaped "\n").
_LIST_STYLE_HINT = re.compile(r"<tool_call>(?:\s|\\n)*\[")
_LLAMA_HINTS = (PYTHON_TAG, "ipython")
# Between llama3_json call objects; also skipped after <|python_tag|>.
_JSON_SEPARATORS = " \t\r\n;"


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is json.dumps(object, ensure_ascii=False) of the model's arguments
    object, keys in the model's order."""

    name: str
    arguments: str


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


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are Python's extension, not JSON: clients could not parse them back.
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _decode_call(value: Any) -> ToolCall | None:
    """The call a decoded JSON value describes, or None when it is not a well-formed call."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    # Hermes prompts say "arguments", Llama's say "parameters"; models mix them up.
    arguments = value["arguments"] if "arguments" in value else value.get("parameters")
    if arguments is None:  # a function without parameters
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _DECODER.decode(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    try:  # a lone surrogate escape ("\ud800") decodes but could never be sent as UTF-8
        (name + text).encode("utf-8")
    except UnicodeEncodeError:
        return None
    return ToolCall(name, text)


def _decode_block(body: str) -> list[ToolCall] | None:
    """The calls between one pair of tags: an object, or a list of objects (SmolLM2, where
    `[]` means "no call"). One bad call makes the whole block None."""
    try:
        value = _DECODER.decode(body)
    except (ValueError, RecursionError):
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        call = _decode_call(item)
        if call is None:
            return None
        calls.append(call)
    return calls


def _partial_open_tag(text: str, start: int) -> int:
    """Length of the longest end of text[start:] that could still grow into TOOL_CALL_OPEN."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text) - start), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:size]):
            return size
    return 0


class _TagSplitter:
    """hermes and smollm2: calls are JSON between <tool_call> and the next </tool_call>; the
    rest is content. A block that does not decode to calls stays content, tags included."""

    def __init__(self) -> None:
        self._done = 0  # text[:_done] has been split
        self._close_from = 0  # where to resume looking for the open call's close tag

    def split(self, text: str, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
        while self._done < len(text):
            start = text.find(TOOL_CALL_OPEN, self._done)
            if start < 0:
                end = len(text) if final else len(text) - _partial_open_tag(text, self._done)
                pieces.append(text[self._done:end])
                self._done = end
                break
            pieces.append(text[self._done:start])
            body_start = start + len(TOOL_CALL_OPEN)
            close = text.find(TOOL_CALL_CLOSE, max(body_start, self._close_from))
            if close < 0:
                if final:  # unterminated: the model stopped inside the call
                    pieces.append(text[start:])
                    self._done = len(text)
                else:
                    self._done = start
                    # A close tag can only end in text not searched yet: scanning from here
                    # keeps a long call linear rather than quadratic in its length.
                    self._close_from = max(body_start, len(text) - len(TOOL_CALL_CLOSE) + 1)
                break
            end = close + len(TOOL_CALL_CLOSE)
            calls = _decode_block(text[body_start:close])
            if calls is None:
                pieces.append(text[start:end])
            else:
                pieces.extend(calls)
            self._done = end
        return pieces


class _JsonSplitter:
    """llama3_json: a reply that starts with `{` or <|python_tag|> is a run of JSON call objects
    separated by `;` or whitespace. Text from the first thing that is not a well-formed call
    object is content; if that is the very first object, the whole reply is content."""

    def __init__(self) -> None:
        self._done = 0
        self._decided = False  # whether the reply's start has shown if it is calls or content
        self._in_calls = False
        self._has_calls = False
        # Text length at the last failed decode: an object can only complete with a new "}".
        self._failed_at = 0

    def split(self, text: str, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
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

    def _split_calls(self, text: str, final: bool, pieces: list[str | ToolCall]) -> None:
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
            if not final and text.find("}", self._failed_at) < 0:
                return
            try:
                value, end = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                # Incomplete and malformed look alike until the reply ends.
                if final:
                    self._switch_to_content(start)
                else:
                    self._failed_at = len(text)
                return
            call = _decode_call(value)
            if call is None:
                self._switch_to_content(start)
                return
            pieces.append(call)
            self._has_calls = True
            self._done = end

    def _switch_to_content(self, start: int) -> None:
        self._in_calls = False
        # Before any call, the reply was never a call: all of it is content, tag included.
        self._done = start if self._has_calls else 0


def _splitter(family: str) -> _TagSplitter | _JsonSplitter:
    if family in ("hermes", "smollm2"):
        return _TagSplitter()
    if family == "llama3_json":
        return _JsonSplitter()
    raise ValueError(f"unknown tool-call family {family!r}; choose one of: {', '.join(PARSERS)}")


def parse_tool_calls(text: str, family: str) -> ParsedOutput:
    """The calls in a finished reply, and the text outside them with surrounding whitespace
    stripped. Malformed or unterminated calls stay in the content as written; never raises
    for model output. Raises ValueError for a family not in PARSERS."""
    pieces = _splitter(family).split(text, final=True)
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
    (a possible start of <tool_call> is held back), and each call once its JSON is complete,
    as one delta with its name and all its arguments. With final=True everything left is
    flushed, malformed calls as content. The content of all updates concatenates to
    parse_tool_calls(text, family).content: leading whitespace is dropped and trailing
    whitespace is held until more content follows it."""

    def __init__(self, family: str) -> None:
        self._splitter = _splitter(family)
        self._next_index = 0
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
        for piece in self._splitter.split(text_so_far, final):
            if isinstance(piece, ToolCall):
                calls.append(ToolCallDelta(self._next_index, piece.name, piece.arguments))
                self._next_index += 1
            else:
                content.append(self._sendable(piece))
        return StreamUpdate("".join(content), calls)

    def _sendable(self, text: str) -> str:
        if not self._sent_text:
            text = text.lstrip()
            if not text:
                return ""
            self._sent_text = True
        text = self._held_space + text
        sendable = text.rstrip()
        self._held_space = text[len(sendable):]
        return sendable
