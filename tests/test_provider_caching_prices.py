"""Prices and the break-even arithmetic: a 5m write (1.25x) plus one read (0.1x) is 1.35 against
2.0 uncached; a 1h write (2x) pays off only after two reads."""

from __future__ import annotations

import json

import pytest

from radixserve.provider_caching import (
    CacheUsage,
    ModelPrice,
    PromptLayout,
    VendorCache,
    break_even_reuses,
    default_prices,
    get_profile,
    load_prices,
    profile_for_model,
    request_cost,
)
from radixserve.provider_caching.layout import LayoutBreakpoint

ONE_DOLLAR = ModelPrice(input_per_mtok=1.0, output_per_mtok=5.0)
MILLION = 1_000_000


def replay(ttl: str, requests: int) -> tuple[float, float]:
    """Dollars with and without caching for `requests` identical 1M-token prompts whose whole
    prompt sits before one breakpoint, at $1/MTok input."""
    now = [0.0]
    cache = VendorCache(get_profile("anthropic-1024"), lambda: now[0])
    prompt = PromptLayout((b"p",), (LayoutBreakpoint(0, MILLION, ttl),), MILLION)
    with_cache = without = 0.0
    for _ in range(requests):
        accounting = cache.start(prompt)
        cache.first_token(accounting.request_id)
        cost = request_cost(accounting.usage, 0, ONE_DOLLAR)
        with_cache += cost.with_cache
        without += cost.without_cache
        now[0] += 60
    return round(with_cache, 6), round(without, 6)


def test_5m_cache_pays_off_after_one_reuse():
    assert replay("5m", 2) == (1.35, 2.0)
    assert break_even_reuses(ONE_DOLLAR, "5m") == 1


def test_1h_cache_pays_off_after_two_reuses():
    assert replay("1h", 2) == (2.1, 2.0)  # one reuse: still dearer than no cache
    assert replay("1h", 3) == (2.2, 3.0)
    assert break_even_reuses(ONE_DOLLAR, "1h") == 2


def test_break_even_edge_cases():
    assert break_even_reuses(ModelPrice(1, 1, cache_write_5m=1.9, cache_read=0.1), "5m") == 2
    assert break_even_reuses(ModelPrice(1, 1, cache_read=1.0), "5m") is None


def test_cost_of_a_usage_record():
    usage = CacheUsage(
        prompt_tokens=10_000,
        cache_read_tokens=6_000,
        cache_write_5m_tokens=2_000,
        cache_write_1h_tokens=1_000,
    )
    cost = request_cost(usage, output_tokens=500, price=ModelPrice(3.0, 15.0))
    unit = 3.0 / MILLION
    expected = unit * (1_000 + 600 + 2_500 + 2_000) + 500 * 15.0 / MILLION
    assert cost.with_cache == pytest.approx(expected)
    assert cost.without_cache == pytest.approx(unit * 10_000 + 500 * 15.0 / MILLION)
    assert cost.saved == pytest.approx(cost.without_cache - cost.with_cache)


def test_price_lookup_prefers_the_longest_model_prefix_then_the_profile():
    prices = default_prices()
    haiku = prices.lookup("claude-haiku-4-5-20251001", profile_for_model("claude-haiku-4-5"))
    assert (haiku.input_per_mtok, haiku.output_per_mtok) == (1.0, 5.0)
    sonnet = prices.lookup("claude-sonnet-4-5", profile_for_model("claude-sonnet-4-5"))
    assert (
        sonnet.input_per_mtok,
        sonnet.cache_write_5m,
        sonnet.cache_write_1h,
        sonnet.cache_read,
    ) == (3.0, 1.25, 2.0, 0.1)
    assert prices.lookup("gpt-4o", get_profile("openai")).cache_write_5m == 1.0


def test_price_file_overrides_defaults(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(
        json.dumps(
            {
                "anthropic-1024": {"input": 2.0, "output": 10.0, "cache_read": 0.05},
                "my-model": {"input": 0.5, "output": 1.0},
            }
        )
    )
    prices = load_prices(path)
    price = prices.lookup("claude-sonnet-4-5", get_profile("anthropic-1024"))
    assert (price.input_per_mtok, price.cache_read, price.cache_write_5m) == (2.0, 0.05, 1.25)
    assert prices.lookup("my-model-7b", get_profile("openai")).input_per_mtok == 0.5
    assert prices.lookup("claude-haiku-4-5", get_profile("anthropic-4096")).input_per_mtok == 1.0


@pytest.mark.parametrize(
    "content, message",
    [
        ({"x": {"input": 1}}, "input"),
        ({"x": {"input": 1, "output": 2, "writes": 3}}, "unknown"),
        ({"x": {"input": -1, "output": 2}}, "non-negative"),
        ([1, 2], "one JSON object"),
    ],
)
def test_bad_price_files_are_rejected(tmp_path, content, message):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_prices(path)


def test_missing_price_says_so():
    from radixserve.provider_caching.prices import MissingPrice, PriceTable

    with pytest.raises(MissingPrice, match="--prices"):
        PriceTable({}).lookup("m", get_profile("openai"))
