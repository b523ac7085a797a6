"""Vendor cache emulation against the documented rules: minimums, writes only at breakpoints,
the 20-block lookback, concurrency misses, TTL expiry and refresh (injected clock), mixed-TTL
billing, OpenAI's 1,024-token minimum and 128-token increments."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.provider_caching import PromptLayout, VendorCache, get_profile, profile_for_model
from radixserve.provider_caching.layout import LayoutBreakpoint

SONNET = get_profile("anthropic-1024")
OPENAI = get_profile("openai")


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def layout(
    names: list[str], tokens: int | list[int], marks: dict[int, str], tail: int = 0
) -> PromptLayout:
    """Blocks `names` (equal names at equal positions = equal content), `tokens` per block,
    breakpoints {block index: ttl}, and `tail` uncached tokens after the last block."""
    sizes = tokens if isinstance(tokens, list) else [tokens] * len(names)
    ends, total = [], 0
    for n in sizes:
        total += n
        ends.append(total)
    hashes = tuple(
        hashlib.sha256("|".join(names[: i + 1]).encode()).digest() for i in range(len(names))
    )
    return PromptLayout(
        hashes,
        tuple(LayoutBreakpoint(i, ends[i], ttl) for i, ttl in sorted(marks.items())),
        total + tail,
    )


def served(cache: VendorCache, prompt: PromptLayout):
    """A request that starts and at once starts responding."""
    accounting = cache.start(prompt)
    cache.first_token(accounting.request_id)
    return accounting.usage


def test_first_request_writes_and_the_next_reads():
    clock = FakeClock()
    cache = VendorCache(SONNET, clock)
    prompt = layout(["tools", "system", "question"], [500, 1500, 50], {1: "5m"}, tail=10)
    first = served(cache, prompt)
    assert first.anthropic_fields() == {
        "input_tokens": 60,
        "cache_creation_input_tokens": 2000,
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_5m_input_tokens": 2000, "ephemeral_1h_input_tokens": 0},
    }
    clock.now = 10
    second = served(
        cache, layout(["tools", "system", "other question"], [500, 1500, 70], {1: "5m"})
    )
    assert (second.cache_read_tokens, second.cache_write_tokens, second.uncached_tokens) == (
        2000,
        0,
        70,
    )


def test_prefix_below_the_minimum_is_not_cached_and_not_an_error():
    cache = VendorCache(SONNET, FakeClock())
    prompt = layout(["system", "q"], [800, 12], {0: "5m"})
    for _ in range(2):
        usage = served(cache, prompt)
        assert (usage.cache_read_tokens, usage.cache_write_tokens, usage.uncached_tokens) == (
            0,
            0,
            812,
        )
    assert cache.entry_count == 0
    haiku = VendorCache(get_profile("anthropic-4096"), FakeClock())
    assert served(haiku, layout(["system"], [2000], {0: "5m"})).cache_write_tokens == 0


def test_no_breakpoint_no_cache():
    cache = VendorCache(SONNET, FakeClock())
    prompt = layout(["system", "q"], [3000, 10], {})
    assert served(cache, prompt).cache_read_tokens == 0
    assert served(cache, prompt).uncached_tokens == 3010


def test_lookback_window_is_20_blocks_the_documented_example():
    cache = VendorCache(SONNET, FakeClock())
    names = [f"b{i}" for i in range(35)]
    turn1 = served(cache, layout(names[:10], 200, {9: "5m"}))
    assert turn1.cache_write_tokens == 2000
    turn2 = served(cache, layout(names[:15], 200, {14: "5m"}))
    assert (turn2.cache_read_tokens, turn2.cache_write_5m_tokens) == (2000, 1000)
    # Turn 3 checks blocks 35..16; the turn-2 entry at block 15 is one outside the window.
    turn3 = served(cache, layout(names, 200, {34: "5m"}))
    assert (turn3.cache_read_tokens, turn3.cache_write_5m_tokens) == (0, 7000)


def test_a_second_breakpoint_restarts_the_lookback():
    cache = VendorCache(SONNET, FakeClock())
    names = [f"b{i}" for i in range(40)]
    served(cache, layout(names[:6], 200, {5: "5m"}))
    usage = served(cache, layout(names, 200, {6: "5m", 39: "5m"}))
    assert usage.cache_read_tokens == 1200


def test_reads_need_an_earlier_write_not_just_equal_content():
    cache = VendorCache(SONNET, FakeClock())
    served(cache, layout(["system", "q1"], [2000, 10], {1: "5m"}))  # wrote at block 1 only
    usage = served(cache, layout(["system", "q2"], [2000, 10], {1: "5m"}))
    assert usage.cache_read_tokens == 0  # block 0 is the same, but nobody wrote an entry there


def test_concurrent_identical_requests_all_pay_for_writes():
    clock = FakeClock()
    cache = VendorCache(SONNET, clock)
    prompt = layout(["system", "q"], [2000, 10], {0: "5m"})
    started = [cache.start(prompt) for _ in range(4)]
    assert [a.usage.cache_write_tokens for a in started] == [2000] * 4
    assert [a.usage.cache_read_tokens for a in started] == [0] * 4
    clock.now = 1.5
    cache.first_token(started[2].request_id)
    assert served(cache, prompt).cache_read_tokens == 2000


def test_aborted_writer_leaves_no_entry():
    cache = VendorCache(SONNET, FakeClock())
    prompt = layout(["system"], [2000], {0: "5m"})
    cache.abort(cache.start(prompt).request_id)
    assert cache.entry_count == 0
    assert served(cache, prompt).cache_read_tokens == 0


def test_ttl_expires_from_the_request_start_and_a_read_refreshes_it():
    clock = FakeClock()
    cache = VendorCache(SONNET, clock)
    prompt = layout(["system", "q"], [2000, 10], {0: "5m"})
    served(cache, prompt)
    clock.now = 299.0
    assert served(cache, prompt).cache_read_tokens == 2000  # refreshed to 599
    clock.now = 598.0
    assert served(cache, prompt).cache_read_tokens == 2000  # refreshed to 898
    clock.now = 898.0
    expired = served(cache, prompt)
    assert (expired.cache_read_tokens, expired.cache_write_tokens) == (0, 2000)


def test_a_1h_entry_outlives_a_5m_one():
    clock = FakeClock()
    cache = VendorCache(SONNET, clock)
    served(cache, layout(["a"], [2000], {0: "1h"}))
    served(cache, layout(["b"], [2000], {0: "5m"}))
    clock.now = 3000.0
    assert served(cache, layout(["a"], [2000], {0: "1h"})).cache_read_tokens == 2000
    assert served(cache, layout(["b"], [2000], {0: "5m"})).cache_read_tokens == 0


def test_mixed_ttl_billing_reads_a_then_1h_to_b_then_5m_to_c():
    cache = VendorCache(SONNET, FakeClock())
    served(cache, layout(["tools"], [1200], {0: "1h"}))
    usage = served(
        cache,
        layout(
            ["tools", "system", "history"], [1200, 800, 500], {0: "1h", 1: "1h", 2: "5m"}, tail=48
        ),
    )
    assert usage.anthropic_fields() == {
        "input_tokens": 48,
        "cache_creation_input_tokens": 1300,
        "cache_read_input_tokens": 1200,
        "cache_creation": {"ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 800},
    }


def test_openai_caches_from_1024_tokens_in_128_token_increments():
    clock = FakeClock()
    cache = VendorCache(OPENAI, clock)

    def prompt(ids):
        return PromptLayout((), (), len(ids), token_ids=tuple(ids))

    short = list(range(1000))
    assert served(cache, prompt(short)).cache_read_tokens == 0
    assert served(cache, prompt(short)).cache_read_tokens == 0  # under 1,024: always 0
    long = list(range(1300))
    assert served(cache, prompt(long)).cache_read_tokens == 0  # first sight
    assert served(cache, prompt(long)).cache_read_tokens == 1280  # whole increments only
    branch = list(range(1100)) + [-1] * 300
    assert served(cache, prompt(branch)).cache_read_tokens == 1024
    early_change = [-5] + list(range(1, 1300))
    assert served(cache, prompt(early_change)).cache_read_tokens == 0
    clock.now = 301.0  # idle past the in-memory lifetime
    assert served(cache, prompt(long)).cache_read_tokens == 0


def test_openai_layout_needs_token_ids():
    with pytest.raises(ValueError, match="token_ids"):
        VendorCache(OPENAI, FakeClock()).start(PromptLayout((), (), 10))


@pytest.mark.parametrize(
    "model, profile",
    [
        ("claude-opus-4-5-20251101", "anthropic-4096"),
        ("claude-haiku-4-5", "anthropic-4096"),
        ("claude-opus-4-20250514", "anthropic-1024"),
        ("claude-sonnet-4-5", "anthropic-1024"),
        ("claude-3-5-haiku-latest", "anthropic-2048"),
        ("claude-opus-4-7", "anthropic-2048"),
        ("claude-opus-5", "anthropic-512"),
        ("some-unknown-model", "anthropic-1024"),
        ("gpt-4o-mini", "openai"),
        ("gemini-2.5-flash", "gemini-2048"),
        ("gemini-3-pro-preview", "gemini-4096"),
    ],
)
def test_profiles_by_model_id(model, profile):
    assert profile_for_model(model).name == profile


def test_profile_minimum_override_and_vendor_default():
    assert SONNET.with_minimum(256).min_cacheable_tokens == 256
    assert profile_for_model("claude-sonnet-4-5", "openai").name == "openai"
    with pytest.raises(KeyError, match="known"):
        get_profile("nope")


_request = st.tuples(
    st.integers(0, 3),  # which system prompt
    st.integers(0, 2),  # which question
    st.sampled_from([{0: "5m"}, {1: "5m"}, {0: "1h", 1: "5m"}, {0: "1h"}, {}]),
    st.floats(0, 400),  # seconds since the previous request
    st.booleans(),  # does it start responding before the next request
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_request, min_size=1, max_size=25))
def test_accounting_invariants(requests):
    clock = FakeClock()
    cache = VendorCache(SONNET, clock)
    pending = []
    for system, question, marks, gap, responds in requests:
        clock.now += gap
        prompt = layout([f"s{system}", f"q{question}"], [600 * (system + 1), 300], marks, tail=7)
        accounting = cache.start(prompt)
        usage = accounting.usage
        assert (
            usage.cache_read_tokens + usage.cache_write_tokens + usage.uncached_tokens
            == prompt.total_tokens
        )
        last = prompt.breakpoints[-1].tokens if prompt.breakpoints else 0
        assert usage.cache_read_tokens <= last
        assert (
            usage.cache_read_tokens == 0 or usage.cache_read_tokens >= SONNET.min_cacheable_tokens
        )
        if last < SONNET.min_cacheable_tokens:
            assert usage.cache_write_tokens == 0 and usage.cache_read_tokens == 0
        assert usage.uncached_tokens >= 7
        pending.append(accounting.request_id)
        if responds:
            for request_id in pending:
                cache.first_token(request_id)
            pending.clear()
