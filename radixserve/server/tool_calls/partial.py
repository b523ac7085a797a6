"""Tool calls still being generated, read as their text grows, for streams that send a call's
arguments before the call is complete: which calls name their function before their
arguments object begins (the shape a forced call's grammar writes), and how far each one's
arguments have got.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from radixserve.server.tool_calls.json_spans import DECODER, ValueScan, sendable, skip_space

# A call object that names its function before it opens its arguments, the shape the forced-call
# grammar generates: only then can the arguments stream before the call is complete.
_NAME_FIRST = re.compile(r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,'
                         r'[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*')


@dataclass(frozen=True)
class PartialCall:
    """A call still being generated whose name is known and whose arguments object has begun:
    its arguments so far are text[arguments_start:arguments_end]."""

    name: str
    arguments_start: int
    arguments_end: int


class _CallScan:
    """One call object of an unfinished block, read as it grows: whether it names its function
    first and, if so, the name and how far its arguments object has got."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.object = ValueScan(start)
        self.arguments: ValueScan | None = None
        self.name = ""
        self.streamable: bool | None = None  # None: its head is not complete yet

    def advance(self, text: str) -> None:
        self.object.advance(text)
        if self.streamable is None:
            head = _NAME_FIRST.match(text, self.start)
            if head is not None and head.end() < len(text):
                self.streamable = text[head.end()] == "{" and self._read_name(head.group(1))
                if self.streamable:
                    self.arguments = ValueScan(head.end())
            elif self.object.end is not None:  # ended without the head: not name-first
                self.streamable = False
        if self.arguments is not None:
            self.arguments.advance(text)

    def _read_name(self, literal: str) -> bool:
        try:
            name = DECODER.decode(literal)
        except ValueError:
            return False
        self.name = name
        return bool(name) and sendable(name)

    def partial_call(self) -> PartialCall:
        assert self.arguments is not None
        return PartialCall(self.name, self.arguments.start, self.arguments.pos)


class UnfinishedBlock:
    """The calls of a block still being generated: the JSON between hermes/smollm2 tags (an
    object, or with `lists` a list of objects) or one llama3_json object, from `start`. Calls
    are announced in order, so a call that is not name-first holds back those after it until
    the block ends; `announced` counts the calls announced so far."""

    def __init__(self, start: int, lists: bool) -> None:
        self._next = start  # where reading resumes when no call object is open
        self._lists = lists
        self._expect = "start"  # "start", "call" (after "[" or ","), "after" (a call), "ended"
        self._in_list = False
        self._calls: list[_CallScan] = []
        self.announced = 0

    def partial_calls(self, text: str, announce: bool = True) -> list[PartialCall]:
        """The block's calls that can stream, in order, each with its arguments so far, read
        from where the last call stopped (`text` extends the text of earlier calls); with
        announce=False, only those announced before."""
        opened: list[PartialCall] = []
        index = 0
        while index < len(self._calls) or self._start_call(text):
            call = self._calls[index]
            call.advance(text)
            if not call.streamable or (not announce and index >= self.announced):
                break
            opened.append(call.partial_call())
            if call.object.end is None:
                break
            index += 1
        self.announced = max(self.announced, len(opened))
        return opened

    def _start_call(self, text: str) -> bool:
        """Whether another call object has begun after the last one (which has ended)."""
        while self._expect != "ended":
            if self._expect == "after":
                end = self._calls[-1].object.end
                assert end is not None
                self._next = end
            pos = skip_space(text, self._next)
            if pos == len(text):
                return False
            char = text[pos]
            if char == "{" and self._expect != "after":
                self._calls.append(_CallScan(pos))
                self._expect = "after"
                return True
            if self._expect == "start" and char == "[" and self._lists:
                self._in_list = True
            elif not (self._expect == "after" and self._in_list and char == ","):
                break
            self._expect = "call"
            self._next = pos + 1
        self._expect = "ended"
        return False
