"""One request's prompt-cache accounting, and its rendering as each API's usage fields.

Internally a request has a total prompt length, tokens read from cache and tokens written
(per TTL); every API's fields derive from those four numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheUsage:
    """Prompt tokens split into read from cache, written to cache (5m / 1h) and the rest."""

    prompt_tokens: int
    cache_read_tokens: int = 0
    cache_write_5m_tokens: int = 0
    cache_write_1h_tokens: int = 0

    def __post_init__(self) -> None:
        assert min(self.cache_read_tokens, self.cache_write_5m_tokens,
                   self.cache_write_1h_tokens) >= 0, self
        assert self.uncached_tokens >= 0, self

    @property
    def cache_write_tokens(self) -> int:
        return self.cache_write_5m_tokens + self.cache_write_1h_tokens

    @property
    def uncached_tokens(self) -> int:
        """Anthropic's `input_tokens`: neither read from nor written to the cache."""
        return self.prompt_tokens - self.cache_read_tokens - self.cache_write_tokens

    def anthropic_fields(self) -> dict[str, Any]:
        """Messages API `usage` input fields; all present, zeros rather than omitted."""
        return {
            "input_tokens": self.uncached_tokens,
            "cache_creation_input_tokens": self.cache_write_tokens,
            "cache_read_input_tokens": self.cache_read_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.cache_write_5m_tokens,
                "ephemeral_1h_input_tokens": self.cache_write_1h_tokens,
            },
        }

    def openai_prompt_tokens_details(self) -> dict[str, int]:
        """Chat Completions `usage.prompt_tokens_details` (`prompt_tokens` is the total)."""
        return {"cached_tokens": self.cache_read_tokens, "audio_tokens": 0}
