"""What the client saw of one request: timings, token counts, cache usage, error.

Times are seconds; `start` is relative to the start of the measured run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class RequestRecord:
    index: int  # position in the workload
    group: str = ""
    parent: int | None = None
    cache_salt: str | None = None
    start: float = 0.0  # when it was sent
    ttft: float | None = None  # sent -> first chunk carrying generated text
    latency: float | None = None  # sent -> end of the stream (E2EL)
    itl: list[float] = field(default_factory=list)  # gaps between chunks with generated text
    success: bool = False
    error: str = ""
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    client_prompt_tokens: int | None = None  # our tokenizer's count of what we sent
    output_tokens: int | None = None  # usage.completion_tokens, else re-tokenised text
    output_tokens_source: str = ""  # "usage" or "tokenizer"
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: absent
    ideal_cached_tokens: int | None = None  # see bench.ideal
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def end(self) -> float | None:
        return None if self.latency is None else self.start + self.latency

    @property
    def input_tokens(self) -> int:
        """The server's prompt count when it reported one, else ours."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return self.client_prompt_tokens or 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
