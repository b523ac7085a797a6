"""Model profiles: each vendor model tier's caching parameters (minimum cacheable length,
hit granularity, lookback, idle lifetime of automatic caches), and lookup by model id.

Values follow the vendors' documentation as summarised in shared/reference/prompt-caching-apis.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Vendor = Literal["anthropic", "openai", "gemini"]
VENDORS: tuple[Vendor, ...] = ("anthropic", "openai", "gemini")


@dataclass(frozen=True)
class ModelProfile:
    """How one vendor model tier caches.

    anthropic: explicit breakpoints, writes only at breakpoints, reads by a `lookback_blocks`
    lookback, TTL 5m/1h per breakpoint. openai and gemini: automatic prefix caching that
    reports hits in multiples of `increment_tokens` once the prompt reaches
    `min_cacheable_tokens`, kept `idle_ttl_s` after last use.
    """

    name: str
    vendor: Vendor
    min_cacheable_tokens: int
    increment_tokens: int = 1
    lookback_blocks: int = 20
    idle_ttl_s: float = 300.0
    model_prefixes: tuple[str, ...] = ()

    def with_minimum(self, tokens: int) -> ModelProfile:
        """This profile with another minimum (the server's `--min-cacheable-tokens`)."""
        return replace(self, name=f"{self.name}(min={tokens})", min_cacheable_tokens=tokens)


PROFILES: tuple[ModelProfile, ...] = (
    ModelProfile("anthropic-512", "anthropic", 512,
                 model_prefixes=("claude-opus-5", "claude-fable-5", "claude-mythos-5")),
    ModelProfile("anthropic-1024", "anthropic", 1024, model_prefixes=(
        "claude-opus-4-8", "claude-sonnet-5", "claude-sonnet-4-6", "claude-sonnet-4-5",
        "claude-opus-4-1", "claude-opus-4", "claude-sonnet-4", "claude-3-7-sonnet",
        "claude-3-5-sonnet", "claude-3-opus")),
    ModelProfile("anthropic-2048", "anthropic", 2048, model_prefixes=(
        "claude-mythos-preview", "claude-opus-4-7", "claude-3-5-haiku", "claude-3-haiku")),
    ModelProfile("anthropic-4096", "anthropic", 4096, model_prefixes=(
        "claude-opus-4-6", "claude-opus-4-5", "claude-haiku-4-5")),
    # Classic OpenAI caching: automatic from 1,024 tokens, hits in 128-token increments,
    # in-memory entries live 5 to 10 minutes idle (we take the conservative 5).
    ModelProfile("openai", "openai", 1024, increment_tokens=128, model_prefixes=(
        "gpt", "o1", "o3", "o4", "chatgpt")),
    # Gemini implicit caching. The hit granularity is undocumented; we assume 128 tokens.
    ModelProfile("gemini-1024", "gemini", 1024, increment_tokens=128,
                 model_prefixes=("gemini-3-flash",)),
    ModelProfile("gemini-2048", "gemini", 2048, increment_tokens=128,
                 model_prefixes=("gemini-2.5-flash", "gemini-2.5-pro", "gemini")),
    ModelProfile("gemini-4096", "gemini", 4096, increment_tokens=128, model_prefixes=(
        "gemini-3.5-flash", "gemini-3.1-pro", "gemini-3-pro")),
)

DEFAULT_PROFILES: dict[Vendor, str] = {
    "anthropic": "anthropic-1024", "openai": "openai", "gemini": "gemini-2048",
}


def get_profile(name: str) -> ModelProfile:
    """The profile called `name`; KeyError listing the known names otherwise."""
    for profile in PROFILES:
        if profile.name == name:
            return profile
    raise KeyError(f"unknown model profile {name!r}; known: {', '.join(p.name for p in PROFILES)}")


def profile_for_model(model: str | None, vendor: Vendor | None = None) -> ModelProfile:
    """The profile whose longest model-id prefix matches `model` (within `vendor`, if given).

    Falls back to the vendor's default profile (Anthropic's 1,024-token tier when no vendor is
    known), so an unknown model id still gets a documented rule set.
    """
    best: ModelProfile | None = None
    best_len = -1
    for profile in PROFILES:
        if vendor is not None and profile.vendor != vendor:
            continue
        for prefix in profile.model_prefixes:
            if model and model.startswith(prefix) and len(prefix) > best_len:
                best, best_len = profile, len(prefix)
    return best or get_profile(DEFAULT_PROFILES[vendor or "anthropic"])
