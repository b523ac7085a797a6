"""The fixes the linter proposes, as edits to a request body, so the simulator can price the
log as it would be once fixed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.lint.patterns import volatile_spans


@dataclass(frozen=True)
class MoveSpan:
    """Move text[start:end] of the text block at `path` to the end of the last message."""

    path: str
    start: int
    end: int


@dataclass(frozen=True)
class MoveMatches:
    """Move every date/time (kind "timestamp") or id ("request_id") on line `line` of the text
    block at `path` to the end of the last message (a log-wide policy)."""

    path: str
    line: int
    kind: str


@dataclass(frozen=True)
class SortJson:
    """Re-serialise every JSON object or array on line `line` of the text block at `path` with
    sorted keys (a log-wide policy)."""

    path: str
    line: int


@dataclass(frozen=True)
class SortAllJson:
    """Serialise every tool schema and tool input of the request with sorted keys (a log-wide
    policy: it applies to every request)."""


@dataclass(frozen=True)
class UnifyTools:
    """Send `tools` (the union seen in the log for this API format, sorted by name) with every
    request of that format (a log-wide policy)."""

    format: str
    tools: tuple[str, ...]  # canonical JSON of each tool


@dataclass(frozen=True)
class PinSetting:
    """Give setting `name` the conversation's first value (`value_json`; None: absent)."""

    name: str
    value_json: str | None


@dataclass(frozen=True)
class AddAutomaticCaching:
    """Add top-level `cache_control: {"type": "ephemeral"}`."""


@dataclass(frozen=True)
class AddBreakpoint:
    """Put `cache_control: {"type": "ephemeral"}` on the block at `path`."""

    path: str


@dataclass(frozen=True)
class Delay:
    """Send the request at `until` (after the first of a concurrent group has responded)."""

    until: float


Repair = (MoveSpan | MoveMatches | SortJson | SortAllJson | UnifyTools | PinSetting | AddAutomaticCaching
          | AddBreakpoint | Delay)
# Repairs that are policies for the whole log rather than edits of one request.
LOG_WIDE = (MoveMatches, SortJson, SortAllJson, UnifyTools)


def repair_body(body: dict[str, Any], repairs: Sequence[Repair]) -> dict[str, Any]:
    """A copy of `body` with the edits applied. Span edits are applied from the end of each
    block backwards so earlier offsets stay valid."""
    fixed = copy.deepcopy(body)
    moved: list[str] = []
    for repair in repairs:
        if isinstance(repair, SortJson):
            _edit_line(fixed, repair.path, repair.line, _sort_json_in)
    spans = sorted((r for r in repairs if isinstance(r, MoveSpan)), key=lambda r: (r.path, -r.start))
    for repair in spans:
        text = _get_text(fixed, repair.path)
        moved.append(text[repair.start:repair.end])
        _set_text(fixed, repair.path, text[:repair.start] + text[repair.end:])
    for repair in repairs:
        if isinstance(repair, MoveMatches):
            moved.extend(_cut_matches(fixed, repair))
    if moved:
        _append_to_last_message(fixed, " ".join(reversed(moved)))
    for repair in repairs:
        if isinstance(repair, SortAllJson):
            _sort_all(fixed)
        elif isinstance(repair, UnifyTools):
            fixed["tools"] = [json.loads(tool) for tool in repair.tools]
        elif isinstance(repair, PinSetting):
            if repair.value_json is None:
                fixed.pop(repair.name, None)
            else:
                fixed[repair.name] = json.loads(repair.value_json)
        elif isinstance(repair, AddAutomaticCaching):
            fixed["cache_control"] = {"type": "ephemeral"}
        elif isinstance(repair, AddBreakpoint):
            _add_breakpoint(fixed, repair.path)
    return fixed


def sorted_keys(value: Any) -> Any:
    """`value` with every object's keys in sorted order (dicts keep insertion order)."""
    if isinstance(value, dict):
        return {k: sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sorted_keys(v) for v in value]
    return value


def _steps(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def _parent(body: Any, path: str) -> tuple[Any, str | int]:
    steps = _steps(path)
    node = body
    for step in steps[:-1]:
        node = node[step]
    return node, steps[-1]


def _get_text(body: Any, path: str) -> str:
    node, last = _parent(body, path)
    value = node[last]
    return value["text"] if isinstance(value, dict) else value


def _set_text(body: Any, path: str, text: str) -> None:
    node, last = _parent(body, path)
    value = node[last]
    if isinstance(value, dict):
        value["text"] = text
    else:
        node[last] = text


def _cut_matches(body: dict[str, Any], repair: MoveMatches) -> list[str]:
    """Removes the dates or ids from the block's line and returns them."""
    cut: list[str] = []

    def edit(line: str) -> str:
        spans: list[list[int]] = []
        for start, end in sorted(volatile_spans(line, repair.kind)):
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        for start, end in reversed(spans):
            cut.append(line[start:end])
            line = line[:start] + line[end:]
        return line

    _edit_line(body, repair.path, repair.line, edit)
    return cut


def _sort_json_in(line: str) -> str:
    decoder = json.JSONDecoder()
    out, i = [], 0
    while i < len(line):
        if line[i] in "{[":
            try:
                value, end = decoder.raw_decode(line, i)
            except ValueError:
                value, end = None, -1
            if end > 0:
                out.append(json.dumps(sorted_keys(value), ensure_ascii=False))
                i = end
                continue
        out.append(line[i])
        i += 1
    return "".join(out)


def _edit_line(body: dict[str, Any], path: str, number: int, edit: Any) -> None:
    """Applies `edit` to line `number` of the text block at `path`, if the body has one."""
    try:
        text = _get_text(body, path)
    except (KeyError, IndexError, TypeError):
        return
    if not isinstance(text, str):
        return
    lines = text.split("\n")
    if number <= len(lines):
        lines[number - 1] = edit(lines[number - 1])
        _set_text(body, path, "\n".join(lines))


def _sort_all(body: dict[str, Any]) -> None:
    if isinstance(body.get("tools"), list):
        body["tools"] = [sorted_keys(tool) for tool in body["tools"]]
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "tool_use":
                part["input"] = sorted_keys(part.get("input"))
        for call in message.get("tool_calls") or () if isinstance(message, dict) else ():
            function = call.get("function") or {}
            try:
                function["arguments"] = json.dumps(sorted_keys(json.loads(function["arguments"])))
            except (KeyError, TypeError, ValueError):
                continue


def _add_breakpoint(body: dict[str, Any], path: str) -> None:
    node, last = _parent(body, path)
    value = node[last]
    if isinstance(value, str):  # a plain-string system or message content becomes a block
        node[last] = [{"type": "text", "text": value}]
        node, last = node[last], 0
        value = node[0]
    value["cache_control"] = {"type": "ephemeral"}


def _append_to_last_message(body: dict[str, Any], text: str) -> None:
    message = body["messages"][-1]
    content = message.get("content")
    if isinstance(content, str) or content is None:
        message["content"] = f"{content or ''}\n\n{text}"
        return
    for part in reversed(content):
        if part.get("type") == "text":
            part["text"] = f"{part['text']}\n\n{text}"
            return
    content.append({"type": "text", "text": text})
