"""A run's summary from its per-request records, with `vllm bench serve`'s definitions:
TTFT, TPOT = (E2EL - TTFT) / (output tokens - 1), ITL pooled over every chunk gap, E2EL,
throughputs over the run's duration; plus the prefix cache's hit rate three ways.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from radixserve.bench.ideal import page_aligned
from radixserve.bench.records import RequestRecord

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds. numpy's defaults: population std, linear-interpolated percentiles."""

    count: int
    mean_ms: float | None
    median_ms: float | None
    std_ms: float | None
    p90_ms: float | None
    p99_ms: float | None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if not seconds:
            return cls(0, None, None, None, None, None)
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(
            count=len(ms),
            mean_ms=float(np.mean(ms)),
            median_ms=float(np.median(ms)),
            std_ms=float(np.std(ms)),
            p90_ms=float(np.percentile(ms, 90)),
            p99_ms=float(np.percentile(ms, 99)),
        )


@dataclass(frozen=True)
class CacheStats:
    # From each response's usage.prompt_tokens_details.cached_tokens; a reported 0 counts.
    usage_hit_rate: float | None
    usage_requests_reported: int
    usage_cached_tokens: int
    usage_prompt_tokens: int
    prefill_tokens_computed: int | None  # prompt - cached, over the requests that reported
    # What the workload implies (bench.ideal), rounded down to `ideal_page_size` per request.
    ideal_hit_rate: float | None
    ideal_page_size: int
    ideal_cached_tokens: int
    # From the server's Prometheus counters, after minus before the measured run.
    metrics_hit_rate: float | None
    metrics_queries: float | None
    metrics_hits: float | None


@dataclass(frozen=True)
class BenchSummary:
    completed: int
    failed: int
    not_sent: int  # never sent: time limit reached, or a request it depends on failed
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float
    peak_concurrency: int
    goodput: float | None  # requests/s meeting every SLO given; None when none given
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    cache: CacheStats


def tpot_of(record: RequestRecord) -> float | None:
    """Time per output token after the first; defined only for more than one output token."""
    if record.ttft is None or record.latency is None or (record.output_tokens or 0) <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals open at once; one ending exactly when another starts does not overlap."""
    events = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    events.sort()  # at equal times -1 sorts before +1: ends first
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def peak_output_throughput(records: Iterable[RequestRecord]) -> float:
    """Most chunks with generated text in any whole second of the run (vLLM counts one token
    per chunk here; a server that sends several tokens per chunk reads lower)."""
    per_second: dict[int, int] = {}
    for r in records:
        if r.ttft is None:
            continue
        t = r.start + r.ttft
        stamps = [t]
        for gap in r.itl:
            t += gap
            stamps.append(t)
        for s in stamps:
            per_second[math.floor(s)] = per_second.get(math.floor(s), 0) + 1
    return float(max(per_second.values(), default=0))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def cache_stats(
    records: Sequence[RequestRecord],
    server_delta: Mapping[str, float] | None = None,
    ideal_page_size: int = 1,
) -> CacheStats:
    ok = [r for r in records if r.success]
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    with_ideal = [r for r in ok if r.ideal_cached_tokens is not None and r.client_prompt_tokens]
    ideal = sum(page_aligned(r.ideal_cached_tokens or 0, ideal_page_size) for r in with_ideal)
    ideal_den = sum(r.client_prompt_tokens or 0 for r in with_ideal)
    queries = hits = None
    if server_delta is not None:
        queries = server_delta.get("prefix_cache_queries_total")
        hits = server_delta.get("prefix_cache_hits_total")
    return CacheStats(
        usage_hit_rate=_ratio(cached, prompt),
        usage_requests_reported=len(reported),
        usage_cached_tokens=cached,
        usage_prompt_tokens=prompt,
        prefill_tokens_computed=prompt - cached if reported else None,
        ideal_hit_rate=_ratio(ideal, ideal_den),
        ideal_page_size=ideal_page_size,
        ideal_cached_tokens=ideal,
        metrics_hit_rate=_ratio(hits, queries) if hits is not None and queries else None,
        metrics_queries=queries,
        metrics_hits=hits,
    )


def _meets(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": tpot_of(record), "e2el": record.latency}
    for name, limit in slos_ms.items():
        value = values[name]
        # A request without a TPOT (one output token) cannot miss a TPOT target.
        if value is not None and value * 1000.0 > limit:
            return False
        if value is None and name != "tpot":
            return False
    return True


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    not_sent: int = 0,
    server_delta: Mapping[str, float] | None = None,
    ideal_page_size: int = 1,
    goodput_slos_ms: Mapping[str, float] | None = None,
) -> BenchSummary:
    """The run's figures. Throughputs divide by `duration_s`, the wall time of the run."""
    ok = [r for r in records if r.success]
    output = sum(r.output_tokens or 0 for r in ok)
    inputs = sum(r.input_tokens for r in ok)
    ended = [(r.start, r.end) for r in records if r.end is not None]
    goodput = None
    if goodput_slos_ms:
        goodput = sum(_meets(r, goodput_slos_ms) for r in ok) / duration_s if duration_s else 0.0
    tpots = [t for r in ok if (t := tpot_of(r)) is not None]
    return BenchSummary(
        completed=len(ok),
        failed=len(records) - len(ok),
        not_sent=not_sent,
        duration_s=duration_s,
        total_input_tokens=inputs,
        total_output_tokens=output,
        request_throughput=len(ok) / duration_s if duration_s else 0.0,
        output_throughput=output / duration_s if duration_s else 0.0,
        total_token_throughput=(inputs + output) / duration_s if duration_s else 0.0,
        peak_output_throughput=peak_output_throughput(ok),
        peak_concurrency=peak_concurrency(ended),
        goodput=goodput,
        ttft=LatencyStats.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl]),
        e2el=LatencyStats.of([r.latency for r in ok if r.latency is not None]),
        cache=cache_stats(records, server_delta, ideal_page_size),
    )
