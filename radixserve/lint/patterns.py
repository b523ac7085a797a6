"""Patterns of text that changes on every request: dates and times, ids and UUIDs."""

from __future__ import annotations

import re
from collections.abc import Iterator

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
DATE_PATTERNS = tuple(re.compile(p) for p in (
    r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?",
    r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s*[AaPp][Mm])?\b",
    r"\b\d{1,2}/\d{1,2}/\d{2,4}\b",
    rf"\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b",
    rf"\b\d{{1,2}}\s+{_MONTH}\s+\d{{4}}\b",
    r"\b(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)\b",
    r"\b1[5-9]\d{8}(?:\d{3})?(?:\.\d+)?\b",
))
ID_PATTERNS = tuple(re.compile(p) for p in (
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",
    r"\b(?:req|sess|session|msg|run|trace|conv|user|usr|chatcmpl|call|toolu|span|txn)[_-][A-Za-z0-9]{6,}\b",
    r"\b[0-9a-fA-F]{16,}\b",
    r"(?i)\b(?:session|request|req|trace|conversation|correlation|user|client)[ _-]?id\b\s*[:=]?\s*\S+",
))

_BY_KIND = {"timestamp": DATE_PATTERNS, "request_id": ID_PATTERNS}


def volatile_spans(text: str, kind: str) -> Iterator[tuple[int, int]]:
    """(start, end) of every match of `kind` ("timestamp" or "request_id") in `text`."""
    for pattern in _BY_KIND[kind]:
        for match in pattern.finditer(text):
            yield match.start(), match.end()


def volatile_kind(text: str) -> str | None:
    """'timestamp' or 'request_id' if `text` holds a date/time or an id pattern, else None."""
    for kind in _BY_KIND:
        if next(volatile_spans(text, kind), None) is not None:
            return kind
    return None
