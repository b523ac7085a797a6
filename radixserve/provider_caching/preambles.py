"""Per-request preambles: a line a client puts in front of its whole prompt that changes on
every request (Claude Code's billing header), so that nothing after it ever matches a cache.

The table names the ones known, with the client that sends them and the client's own switch;
`strip_preambles` takes them out of a request body (Anthropic `system`, or the leading
system/developer message of an OpenAI chat body, where proxies put the same text) before it
is rendered. The server strips (`--strip-preambles`); the linter names them.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preamble:
    """A known per-request line: `pattern` matches at the start of the first system text."""

    name: str
    pattern: re.Pattern[str]
    client: str  # who sends it
    client_fix: str  # how that client stops sending it


# Claude Code (since 2.1.36) sends `x-anthropic-billing-header: cc_version=2.1.332.0b8;
# cc_entrypoint=sdk-cli; ...` as the first system block; the suffix after the version changes
# on every request. Anthropic's service reads it as request metadata, not prompt.
KNOWN_PREAMBLES: tuple[Preamble, ...] = (
    Preamble("claude_code_billing_header", re.compile(r"x-anthropic-billing-header:"),
             "Claude Code", "set CLAUDE_CODE_ATTRIBUTION_HEADER=0 in Claude Code's environment"),
)


@dataclass(frozen=True)
class StrippedPreamble:
    """One preamble taken out of a body: which, from where (the body's field path), its text."""

    name: str
    path: str
    text: str


def preamble_table(extra_patterns: Sequence[str] = ()) -> tuple[Preamble, ...]:
    """The known preambles plus the operator's own (regular expressions matched at the start of
    the first system text); raises ValueError on a pattern that does not compile."""
    extra = []
    for i, pattern in enumerate(extra_patterns):
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"preamble pattern {pattern!r}: {exc}") from None
        extra.append(Preamble(f"custom_{i}", compiled, "a client", "stop sending it per request"))
    return KNOWN_PREAMBLES + tuple(extra)


def match_preamble(text: str, table: Sequence[Preamble]) -> Preamble | None:
    """The preamble `text` starts with (whitespace before it allowed), or None."""
    head = text.lstrip()
    return next((p for p in table if p.pattern.match(head)), None)


def _cut_first_line(text: str) -> tuple[str, str]:
    """(the first non-blank line, what follows it with its leading newlines removed)."""
    head = text.lstrip()
    end = head.find("\n")
    if end < 0:
        return head, ""
    return head[:end], head[end:].lstrip("\n")


def strip_preambles(body: dict[str, Any], fmt: str, table: Sequence[Preamble]
                    ) -> tuple[dict[str, Any], list[StrippedPreamble]]:
    """`body` without a known preamble at the head of its system text, and what was taken.

    Anthropic: `system` as a string (its first line goes) or as blocks (a first text block
    holding only the preamble goes whole; one with more text after it loses its first line).
    OpenAI chat: the same in the first message when it is system or developer, content as a
    string or as parts. The body is not changed in place; a malformed one is returned as is
    (its own validation reports it).
    """
    if not table:
        return body, []
    if fmt == "anthropic":
        holder, key = body, "system"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict) \
                or messages[0].get("role") not in ("system", "developer"):
            return body, []
        holder, key = messages[0], "content"
    value = holder.get(key)
    path = "system" if fmt == "anthropic" else "messages.0.content"
    if isinstance(value, str):
        found = match_preamble(value, table)
        if found is None:
            return body, []
        line, rest = _cut_first_line(value)
        return _replaced(body, fmt, rest), [StrippedPreamble(found.name, path, line)]
    if not isinstance(value, list) or not value or not isinstance(value[0], dict) \
            or value[0].get("type") != "text" or not isinstance(value[0].get("text"), str):
        return body, []
    found = match_preamble(value[0]["text"], table)
    if found is None:
        return body, []
    line, rest = _cut_first_line(value[0]["text"])
    blocks = ([{**value[0], "text": rest}] if rest else []) + value[1:]
    return _replaced(body, fmt, blocks), [StrippedPreamble(found.name, f"{path}.0", line)]


def _replaced(body: dict[str, Any], fmt: str, value: Any) -> dict[str, Any]:
    out = dict(body)
    if fmt == "anthropic":
        if value in ("", []):
            out.pop("system", None)
        else:
            out["system"] = value
        return out
    messages = copy.copy(body["messages"])
    if value in ("", []):
        messages.pop(0)  # the system message held only the preamble
    else:
        messages[0] = {**messages[0], "content": value}
    out["messages"] = messages
    return out
