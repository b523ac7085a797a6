"""The human summary of a run, laid out like `vllm bench serve`'s so the figures read the same."""

from __future__ import annotations

from radixserve.bench.metrics import LatencyStats
from radixserve.bench.results import BenchResult

_WIDTH = 60


def _rule(title: str, fill: str = "=") -> str:
    return f"{title:{fill}^{_WIDTH}}" if title else fill * _WIDTH


def _row(name: str, value: object) -> str:
    return f"{name + ':':<44}{value!s:>16}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _latency(name: str, label: str, stats: LatencyStats) -> list[str]:
    return [
        _rule(f" {name} ", "-"),
        _row(f"Mean {label} (ms)", _num(stats.mean_ms)),
        _row(f"Median {label} (ms)", _num(stats.median_ms)),
        _row(f"P90 {label} (ms)", _num(stats.p90_ms)),
        _row(f"P99 {label} (ms)", _num(stats.p99_ms)),
    ]


def summary_table(result: BenchResult) -> str:
    s = result.summary
    c = s.cache
    load = result.load
    lines = [
        _rule(" Serving Benchmark Result "),
        _row("System", result.system),
        _row("Workload", result.workload_name),
        _row("Successful requests", s.completed),
        _row("Failed requests", s.failed),
    ]
    if s.not_sent:
        lines.append(_row("Requests not sent", s.not_sent))
    if load.get("max_concurrency"):
        lines.append(_row("Maximum request concurrency", load["max_concurrency"]))
    if load.get("request_rate") is not None:
        lines.append(_row("Request rate configured (RPS)", _num(load["request_rate"])))
    lines += [
        _row("Benchmark duration (s)", _num(s.duration_s)),
        _row("Total input tokens", s.total_input_tokens),
        _row("Total generated tokens", s.total_output_tokens),
        _row("Request throughput (req/s)", _num(s.request_throughput)),
    ]
    if s.goodput is not None:
        lines.append(_row("Request goodput (req/s)", _num(s.goodput)))
    lines += [
        _row("Output token throughput (tok/s)", _num(s.output_throughput)),
        _row("Peak output token throughput (tok/s)", _num(s.peak_output_throughput)),
        _row("Peak concurrent requests", s.peak_concurrency),
        _row("Total token throughput (tok/s)", _num(s.total_token_throughput)),
    ]
    lines += _latency("Time to First Token", "TTFT", s.ttft)
    lines += _latency("Time per Output Token (excl. 1st token)", "TPOT", s.tpot)
    lines += _latency("Inter-token Latency", "ITL", s.itl)
    lines += _latency("End-to-end Latency", "E2EL", s.e2el)
    reported = f"{c.usage_requests_reported}/{s.completed}"
    lines += [
        _rule(" Prefix cache ", "-"),
        _row("Hit rate, from usage (cached/prompt)", _pct(c.usage_hit_rate)),
        _row("Requests reporting cached_tokens", reported),
        _row("Prefill tokens computed (usage)", "-" if c.prefill_tokens_computed is None
             else c.prefill_tokens_computed),
        _row("Hit rate, from server /metrics", _pct(c.metrics_hit_rate)),
        _row(f"Hit rate the workload implies (page {c.ideal_page_size})", _pct(c.ideal_hit_rate)),
        _rule(""),
    ]
    return "\n".join(lines)
