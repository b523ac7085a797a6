"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

TTFT is taken at the first chunk that carries generated text (a role-only opening chunk is not
a token); ITL is every later gap between such chunks, as `vllm bench serve` measures them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamOutcome:
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    # Reasoning text and tool-call arguments are generated tokens too.
    text += delta.get("reasoning_content") or ""
    for call in delta.get("tool_calls") or []:
        text += (call.get("function") or {}).get("arguments") or ""
    return text


def _read_usage(outcome: StreamOutcome, usage: dict[str, Any]) -> None:
    outcome.prompt_tokens = usage.get("prompt_tokens", outcome.prompt_tokens)
    outcome.completion_tokens = usage.get("completion_tokens", outcome.completion_tokens)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        outcome.cached_tokens = int(details["cached_tokens"])


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool, timeout_s: float
) -> StreamOutcome:
    """POSTs `body` (which must ask for a stream) and reads the SSE reply to its end."""
    outcome = StreamOutcome()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                outcome.error = f"HTTP {response.status_code}: {detail}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    outcome.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return outcome
                now = time.perf_counter()
                if chunk.get("usage"):
                    _read_usage(outcome, chunk["usage"])
                for choice in chunk.get("choices") or []:
                    text = _chunk_text(choice, chat)
                    if choice.get("finish_reason"):
                        outcome.finish_reason = choice["finish_reason"]
                    if not text:
                        continue
                    if outcome.ttft is None:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    outcome.text += text
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        outcome.latency = time.perf_counter() - start
    if not outcome.error and outcome.ttft is None and not outcome.completion_tokens:
        outcome.error = "the stream ended without generating any text"
    return outcome
