"""The benchmark's arithmetic against figures worked out by hand: vLLM's TTFT/TPOT/ITL/E2EL
definitions, numpy percentiles, throughputs, peak concurrency, the three hit rates, goodput,
the arrival process, the Prometheus parser and the implied-hit-rate oracle."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.bench.ideal import PrefixOracle, SentPrompt, ideal_cached_tokens, page_aligned
from radixserve.bench.loadgen import arrival_times
from radixserve.bench.metrics import peak_concurrency, summarize, tpot_of
from radixserve.bench.records import RequestRecord
from radixserve.bench.server_metrics import counter_delta, parse_counters


def _records() -> list[RequestRecord]:
    ok = dict(success=True, output_tokens_source="usage")
    return [
        RequestRecord(
            index=0,
            start=0.0,
            ttft=0.1,
            latency=0.5,
            itl=[0.2, 0.2],
            output_tokens=3,
            prompt_tokens=100,
            client_prompt_tokens=100,
            cached_tokens=0,
            ideal_cached_tokens=0,
            **ok,
        ),
        RequestRecord(
            index=1,
            start=0.2,
            ttft=0.3,
            latency=1.0,
            itl=[0.35, 0.35],
            output_tokens=3,
            prompt_tokens=100,
            client_prompt_tokens=100,
            cached_tokens=60,
            ideal_cached_tokens=64,
            **ok,
        ),
        RequestRecord(
            index=2, start=0.3, latency=0.1, error="HTTP 500: boom", client_prompt_tokens=100
        ),
        # One output token: no TPOT; no cached_tokens in its usage: not in the usage hit rate.
        RequestRecord(
            index=3,
            start=1.0,
            ttft=0.2,
            latency=0.2,
            output_tokens=1,
            prompt_tokens=50,
            client_prompt_tokens=50,
            ideal_cached_tokens=10,
            **ok,
        ),
    ]


def test_latency_stats_match_hand_computation() -> None:
    s = summarize(_records(), duration_s=2.0)
    # TTFT over successes: 100, 300, 200 ms.
    assert s.ttft.count == 3
    assert s.ttft.mean_ms == pytest.approx(200.0)
    assert s.ttft.median_ms == pytest.approx(200.0)
    assert s.ttft.p90_ms == pytest.approx(280.0)  # sorted [100,200,300], rank 1.8
    assert s.ttft.p99_ms == pytest.approx(298.0)
    assert s.ttft.std_ms == pytest.approx(math.sqrt(20000 / 3))
    # TPOT = (E2EL - TTFT) / (out - 1): 400/2 = 200 and 700/2 = 350 ms; none for 1 token.
    assert s.tpot.count == 2
    assert s.tpot.mean_ms == pytest.approx(275.0)
    assert s.tpot.p90_ms == pytest.approx(335.0)
    assert s.tpot.p99_ms == pytest.approx(348.5)
    # ITL pools every gap of every request.
    assert s.itl.count == 4
    assert s.itl.median_ms == pytest.approx(275.0)
    assert s.e2el.mean_ms == pytest.approx(1700 / 3)
    assert s.e2el.median_ms == pytest.approx(500.0)


def test_counts_and_throughputs() -> None:
    s = summarize(_records(), duration_s=2.0, not_sent=5)
    assert (s.completed, s.failed, s.not_sent) == (3, 1, 5)
    assert s.total_output_tokens == 7
    assert s.total_input_tokens == 250  # the failed request's prompt is not counted
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(3.5)
    assert s.total_token_throughput == pytest.approx(128.5)
    # r0 [0,0.5], r1 [0.2,1.2], r2 [0.3,0.4] overlap at 0.3; failed requests were in flight.
    assert s.peak_concurrency == 3
    # Chunk times: r0 0.1 0.3 0.5; r1 0.5 0.85 1.2; r3 1.2 -> five in second 0, two in 1.
    assert s.peak_output_throughput == 5.0


def test_hit_rates_three_ways() -> None:
    delta = {"prefix_cache_queries_total": 250.0, "prefix_cache_hits_total": 60.0}
    c = summarize(_records(), 2.0, server_delta=delta, ideal_page_size=16).cache
    # usage: r0 reported an explicit 0 and counts; r3 reported nothing and does not.
    assert c.usage_requests_reported == 2
    assert c.usage_hit_rate == pytest.approx(60 / 200)
    assert c.prefill_tokens_computed == 140
    # implied, page 16: 0 + 64 + floor(10/16)*16 = 64 over 250 client prompt tokens.
    assert c.ideal_hit_rate == pytest.approx(64 / 250)
    assert c.metrics_hit_rate == pytest.approx(60 / 250)
    assert summarize(_records(), 2.0).cache.ideal_hit_rate == pytest.approx(74 / 250)


def test_absent_usage_is_unknown_not_zero() -> None:
    records = [r for r in _records() if r.index in (2, 3)]
    c = summarize(records, 1.0).cache
    assert c.usage_hit_rate is None and c.usage_requests_reported == 0
    assert c.prefill_tokens_computed is None and c.metrics_hit_rate is None


def test_goodput_needs_every_slo() -> None:
    assert summarize(_records(), 2.0, goodput_slos_ms={"ttft": 250}).goodput == 1.0
    # r3 has no TPOT (one token) so cannot miss a TPOT target; r1's 350 ms misses.
    assert summarize(_records(), 2.0, goodput_slos_ms={"tpot": 300}).goodput == 1.0
    assert summarize(_records(), 2.0, goodput_slos_ms={"ttft": 250, "e2el": 100}).goodput == 0.0


def test_tpot_and_peak_concurrency_edges() -> None:
    assert tpot_of(RequestRecord(index=0, ttft=0.1, latency=0.3, output_tokens=2)) == pytest.approx(
        0.2
    )
    assert tpot_of(RequestRecord(index=0, ttft=0.1, latency=0.3, output_tokens=1)) is None
    assert peak_concurrency([(0, 1), (1, 2)]) == 1  # back to back do not overlap
    assert peak_concurrency([]) == 0
    assert summarize([], 0.0).request_throughput == 0.0


def test_arrival_times() -> None:
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(50, 10.0, 1.0, seed=1)
    assert times[-1] == pytest.approx(5.0)  # rescaled: the last at count / rate
    assert times == sorted(times) and times == arrival_times(50, 10.0, 1.0, seed=1)
    bursty, even = arrival_times(400, 10.0, 0.2, 2), arrival_times(400, 10.0, 8.0, 2)

    def gap_spread(ts: list[float]) -> float:
        gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    assert gap_spread(bursty) > 1.5 > 0.6 > gap_spread(even)


def test_prometheus_counters() -> None:
    text = "\n".join(
        [
            "# HELP radixserve:prefix_cache_queries_total tokens queried",
            "# TYPE radixserve:prefix_cache_queries_total counter",
            'radixserve:prefix_cache_queries_total{model_name="a"} 120.0',
            'radixserve:prefix_cache_queries_total{model_name="b"} 30',
            'radixserve:prefix_cache_hits_total{model_name="a"} 45.0',
            'radixserve:external_prefix_cache_hits_total{model_name="a"} 999',
            "vllm:num_preemptions_total 2",
            "radixserve:prefix_cache_queries_created 1.7e9",
        ]
    )
    found = parse_counters(text)
    assert found == {
        "prefix_cache_queries_total": 150.0,
        "prefix_cache_hits_total": 45.0,
        "num_preemptions_total": 2.0,
    }
    after = {**found, "prefix_cache_hits_total": 50.0}
    assert counter_delta(found, after)["prefix_cache_hits_total"] == 5.0
    assert counter_delta(None, after) is None


def _brute_longest(seen: list[list[int]], query: list[int]) -> int:
    best = 0
    for s in seen:
        n = 0
        while n < min(len(s), len(query)) and s[n] == query[n]:
            n += 1
        best = max(best, n)
    return best


@given(
    st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=12),
    st.lists(st.integers(0, 3), max_size=8),
)
def test_oracle_matches_brute_force(seen: list[list[int]], query: list[int]) -> None:
    oracle = PrefixOracle()
    for s in seen:
        oracle.insert(s)
    assert oracle.longest_prefix(query) == _brute_longest(seen, query)


def test_ideal_cached_tokens_order_namespaces_and_replies() -> None:
    a = [1, 2, 3, 4, 5]
    prompts = [
        SentPrompt(start=0.0, end=1.0, prompt_ids=a, reply_ids=[9, 9]),
        SentPrompt(start=2.0, end=3.0, prompt_ids=a, reply_ids=[]),  # identical: len - 1
        SentPrompt(start=2.5, end=None, prompt_ids=a + [9, 9, 7], reply_ids=[]),  # via reply
        SentPrompt(start=4.0, end=5.0, prompt_ids=a, reply_ids=[], namespace="other"),
        SentPrompt(start=0.5, end=0.6, prompt_ids=[1, 2, 8], reply_ids=[]),  # sent second
    ]
    assert ideal_cached_tokens(prompts) == [0, 4, 7, 0, 2]
    assert page_aligned(7, 4) == 4 and page_aligned(3, 4) == 0
