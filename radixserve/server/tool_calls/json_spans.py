"""Where the parts of JSON text lie, for tool calls whose arguments are passed on as the model
wrote them: the members of a complete object, the elements of a complete array, and how far a
value still being generated has got (so a stream never sends past its end).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

JSON_SPACE = " \t\n\r"
# What changes a ValueScan's state; everything between is skipped in one search.
_SPECIAL = re.compile(r'["\\{}\[\]]')


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are Python's extension, not JSON: clients could not parse them back.
    raise ValueError(f"{name} is not JSON")


# Strict JSON: raw_decode(text, pos) gives a value and where it ends, and never skips space.
DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def sendable(value: object) -> bool:
    """Whether a decoded value can be sent as JSON in UTF-8. A lone surrogate escape
    ("\\ud800") decodes but cannot, and many clients' JSON parsers refuse it."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def skip_space(text: str, pos: int) -> int:
    """The first position from `pos` that is not JSON whitespace (len(text) if none)."""
    while pos < len(text) and text[pos] in JSON_SPACE:
        pos += 1
    return pos


@dataclass(frozen=True)
class Member:
    """One member of an object: its key, its decoded value, and its value's text
    text[start:end], with no surrounding whitespace."""

    key: str
    value: Any
    start: int
    end: int


def members(text: str, start: int) -> list[Member]:
    """The members of the object at text[start], in the order written, repeated keys included.
    The object must be valid JSON (decode it first): nothing here checks it."""
    found = []
    pos = skip_space(text, start + 1)
    while text[pos] == '"':
        key, pos = DECODER.raw_decode(text, pos)
        value_start = skip_space(text, skip_space(text, pos) + 1)  # past the ":"
        value, pos = DECODER.raw_decode(text, value_start)
        found.append(Member(key, value, value_start, pos))
        pos = skip_space(text, pos)
        if text[pos] == ",":
            pos = skip_space(text, pos + 1)
    return found


def element_starts(text: str, start: int) -> list[int]:
    """Where each element of the array at text[start] begins; the array must be valid JSON."""
    starts = []
    pos = skip_space(text, start + 1)
    while text[pos] != "]":
        starts.append(pos)
        pos = skip_space(text, DECODER.raw_decode(text, pos)[1])
        if text[pos] == ",":
            pos = skip_space(text, pos + 1)
    return starts


class ValueScan:
    """Finds where an object, array or string that begins at `start` ends while its text is
    still growing: follows strings (and their escapes) and bracket depth, resuming where the
    last `advance` stopped, so a long value is read once. It does not validate: on JSON that
    later fails to decode, its answer means nothing."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start  # text[start:pos] has been read; pos stops at the value's end
        self.end: int | None = None
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def advance(self, text: str) -> None:
        if self._escaped and self.pos < len(text):  # the text stopped right after a backslash
            self.pos += 1
            self._escaped = False
        while self.end is None and not self._escaped:
            found = _SPECIAL.search(text, self.pos)
            if found is None:
                self.pos = len(text)
                return
            char, self.pos = found.group(), found.end()
            if self._in_string:
                if char == '"':
                    self._in_string = False
                elif char == "\\":  # skip the escaped character, whatever it is
                    if self.pos < len(text):
                        self.pos += 1
                    else:
                        self._escaped = True
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
            if self._depth <= 0 and not self._in_string:
                self.end = self.pos
