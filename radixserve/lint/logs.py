"""Reading request logs: JSON Lines files (or directories of them), one request a line.

Accepted line shapes (the API format is detected per line):
  1. a plain request body, OpenAI chat completions or Anthropic messages, optionally with a
     top-level "timestamp" key (removed before rendering);
  2. a wrapper {"timestamp": ..., "body": {...}} ("request" works as well as "body"), with
     optional "format": "openai" | "anthropic" and "output_tokens" (for cost simulation).
Timestamps are Unix seconds (numbers; values above 1e11 are taken as milliseconds) or ISO 8601
strings. Blank lines are ignored; any other unreadable line is reported, never fatal.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from radixserve.provider_caching.render import ApiFormat, BodyError, detect_format

_WRAPPER_BODY_KEYS = ("body", "request")


@dataclass(frozen=True)
class LoggedRequest:
    """One request body from a log, with where it came from and when it was sent."""

    source: str
    line: int
    timestamp: float | None
    body: dict[str, Any]
    format: ApiFormat
    output_tokens: int = 0

    @property
    def location(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass(frozen=True)
class MalformedLine:
    source: str
    line: int
    reason: str

    @property
    def location(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass(frozen=True)
class LogContents:
    requests: tuple[LoggedRequest, ...]
    malformed: tuple[MalformedLine, ...]
    files: tuple[str, ...]


def log_files(paths: Iterable[str | Path]) -> list[Path]:
    """The .jsonl files named, directories expanded (sorted, recursively); FileNotFoundError
    for a path that does not exist."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*.jsonl") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such log file or directory: {raw}")
    return files


def read_logs(paths: Iterable[str | Path]) -> LogContents:
    """All requests and malformed lines of the given files and directories, in file order."""
    requests: list[LoggedRequest] = []
    malformed: list[MalformedLine] = []
    files = log_files(paths)
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    requests.append(parse_line(text, str(path), number))
                except (ValueError, TypeError) as exc:
                    malformed.append(MalformedLine(str(path), number, str(exc)))
    return LogContents(tuple(requests), tuple(malformed), tuple(str(f) for f in files))


def parse_line(text: str, source: str = "<line>", line: int = 1) -> LoggedRequest:
    """One log line as a request; ValueError saying what is wrong otherwise."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    wrapped = next((k for k in _WRAPPER_BODY_KEYS if isinstance(record.get(k), dict)), None)
    if wrapped and "messages" not in record:
        body = dict(record[wrapped])
        meta: Mapping[str, Any] = record
    else:
        body = dict(record)
        meta = {"timestamp": body.pop("timestamp", None)}
    stated = meta.get("format")
    if stated is not None and stated not in ("openai", "anthropic"):
        raise ValueError(f"format must be 'openai' or 'anthropic', got {stated!r}")
    try:
        fmt: ApiFormat = stated or detect_format(body)
    except BodyError as exc:
        raise ValueError(str(exc)) from None
    output_tokens = meta.get("output_tokens", 0)
    if not isinstance(output_tokens, int) or output_tokens < 0:
        raise ValueError(f"output_tokens must be a non-negative integer, got {output_tokens!r}")
    return LoggedRequest(source, line, parse_timestamp(meta.get("timestamp")), body, fmt,
                         output_tokens)


def parse_timestamp(value: Any) -> float | None:
    """Unix seconds from a number (milliseconds above 1e11) or an ISO 8601 string."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"bad timestamp {value!r}")
    if isinstance(value, (int, float)):
        return value / 1000.0 if value > 1e11 else float(value)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"bad timestamp {value!r}: use Unix seconds or ISO 8601") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        return parsed.timestamp()
    raise ValueError(f"bad timestamp {value!r}: use Unix seconds or ISO 8601")
