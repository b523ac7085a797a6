"""Prices per model profile (or model-id prefix) and the dollar cost of a request's usage,
with and without prompt caching. Defaults can be overridden from a JSON file.

JSON shape: {"anthropic-1024": {"input": 3.0, "output": 15.0}, "claude-haiku-4-5": {"input": 1,
"output": 5, "cache_write_5m": 1.25, "cache_write_1h": 2.0, "cache_read": 0.1}}; $ per million
tokens, multipliers relative to the input price.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.provider_caching.profiles import ModelProfile
from radixserve.provider_caching.usage import CacheUsage


@dataclass(frozen=True)
class ModelPrice:
    """$ per million tokens, and cache multipliers on the input price (vendor defaults:
    writes 1.25x for 5 minutes, 2x for 1 hour, reads 0.1x)."""

    input_per_mtok: float
    output_per_mtok: float
    cache_write_5m: float = 1.25
    cache_write_1h: float = 2.0
    cache_read: float = 0.1


@dataclass(frozen=True)
class Cost:
    """Dollars for one request (or a sum of them), with caching and as if uncached."""

    with_cache: float
    without_cache: float

    @property
    def saved(self) -> float:
        return self.without_cache - self.with_cache

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.with_cache + other.with_cache, self.without_cache + other.without_cache)


# Published list prices at the time of writing; check the vendors' pricing pages and override
# with --prices when they change. Automatic caches (OpenAI, Gemini implicit) charge no write
# surcharge, so their write multipliers are 1.
_DEFAULTS: dict[str, ModelPrice] = {
    "anthropic-512": ModelPrice(5.0, 25.0),
    "anthropic-1024": ModelPrice(3.0, 15.0),
    "anthropic-2048": ModelPrice(5.0, 25.0),
    "anthropic-4096": ModelPrice(5.0, 25.0),
    "claude-opus-4-8": ModelPrice(5.0, 25.0),
    "claude-opus-4-1": ModelPrice(15.0, 75.0),
    "claude-opus-4-2": ModelPrice(15.0, 75.0),  # claude-opus-4-2025xxxx (Opus 4)
    "claude-3-opus": ModelPrice(15.0, 75.0),
    "claude-haiku-4-5": ModelPrice(1.0, 5.0),
    "claude-3-5-haiku": ModelPrice(0.8, 4.0),
    "claude-3-haiku": ModelPrice(0.25, 1.25),
    "openai": ModelPrice(1.25, 10.0, 1.0, 1.0, 0.1),
    "gemini-1024": ModelPrice(0.5, 3.0, 1.0, 1.0, 0.1),
    "gemini-2048": ModelPrice(0.3, 2.5, 1.0, 1.0, 0.1),
    "gemini-4096": ModelPrice(2.0, 12.0, 1.0, 1.0, 0.1),
}

_FIELDS = {"input": "input_per_mtok", "output": "output_per_mtok", "cache_write_5m": "cache_write_5m",
           "cache_write_1h": "cache_write_1h", "cache_read": "cache_read"}


class MissingPrice(KeyError):
    """No entry of the price table covers a model."""


@dataclass(frozen=True)
class PriceTable:
    """Prices keyed by profile name or model-id prefix; the longest matching prefix wins."""

    prices: Mapping[str, ModelPrice]

    def lookup(self, model: str | None, profile: ModelProfile) -> ModelPrice:
        """The price for `model` (longest key that prefixes it), else for its profile."""
        keys = [k for k in self.prices if model and model.startswith(k)]
        if keys:
            return self.prices[max(keys, key=len)]
        if profile.name in self.prices:
            return self.prices[profile.name]
        raise MissingPrice(f"no price for model {model!r} or profile {profile.name!r}; "
                       "add one to the --prices file")

    def merged(self, overrides: Mapping[str, ModelPrice]) -> PriceTable:
        return PriceTable({**self.prices, **overrides})


def default_prices() -> PriceTable:
    return PriceTable(dict(_DEFAULTS))


def parse_prices(data: Mapping[str, Any]) -> dict[str, ModelPrice]:
    """Price entries from the JSON shape in the module docstring; ValueError if malformed."""
    prices = {}
    for key, entry in data.items():
        if not isinstance(entry, Mapping) or not {"input", "output"} <= entry.keys():
            raise ValueError(f"price {key!r}: need an object with 'input' and 'output' $/MTok")
        unknown = set(entry) - _FIELDS.keys()
        if unknown:
            raise ValueError(f"price {key!r}: unknown fields {sorted(unknown)}; "
                             f"known: {sorted(_FIELDS)}")
        values = {_FIELDS[name]: float(value) for name, value in entry.items()}
        if any(v < 0 or math.isnan(v) for v in values.values()):
            raise ValueError(f"price {key!r}: prices and multipliers must be non-negative numbers")
        prices[key] = ModelPrice(**values)
    return prices


def load_prices(path: str | Path, base: PriceTable | None = None) -> PriceTable:
    """`base` (the defaults if None) with the entries of the JSON file at `path` on top."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: a price file holds one JSON object")
    return (base or default_prices()).merged(parse_prices(data))


def request_cost(usage: CacheUsage, output_tokens: int, price: ModelPrice) -> Cost:
    """Dollars for one request under `price`, and what it would cost with no cache at all."""
    unit = price.input_per_mtok / 1e6
    output = output_tokens * price.output_per_mtok / 1e6
    with_cache = unit * (
        usage.uncached_tokens
        + usage.cache_read_tokens * price.cache_read
        + usage.cache_write_5m_tokens * price.cache_write_5m
        + usage.cache_write_1h_tokens * price.cache_write_1h
    )
    return Cost(with_cache + output, unit * usage.prompt_tokens + output)


def break_even_reuses(price: ModelPrice, ttl: str) -> int | None:
    """Fewest reads after one write for which caching a prefix costs less than not caching:
    the smallest n with write + n*read < n + 1 (1 for 5m at 1.25/0.1, 2 for 1h at 2/0.1).
    None if caching never pays (reads cost as much as uncached input)."""
    write = price.cache_write_1h if ttl == "1h" else price.cache_write_5m
    if price.cache_read >= 1.0:
        return None
    reuses = 1
    while write + reuses * price.cache_read >= reuses + 1:
        reuses += 1
    return reuses
