"""A benchmark run as a JSON document: the command that made it, what ran where, the summary,
the server's counters and every request's record. `bench report` reads these.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from radixserve.bench.metrics import BenchSummary, CacheStats, LatencyStats
from radixserve.bench.records import RequestRecord

SCHEMA = "radixserve-bench/1"


def summary_from_json(data: dict[str, Any]) -> BenchSummary:
    values = dict(data)
    for name in ("ttft", "tpot", "itl", "e2el"):
        values[name] = LatencyStats(**data[name])
    values["cache"] = CacheStats(**data["cache"])
    return BenchSummary(**values)


@dataclass
class BenchResult:
    command: str  # the exact command line that reproduces this run
    system: str  # what was measured, e.g. "radixserve-radix" or "llama-cpp-python"
    label: str  # free text shown in reports
    base_url: str
    endpoint: str
    model: str
    tokenizer: str
    started_at: str
    load: dict[str, Any]  # concurrency, rate, burstiness, warm-ups, limits
    workload: dict[str, Any]  # the spec, its description and request count
    summary: BenchSummary
    server_metrics: dict[str, Any]  # {"before": ..., "after": ..., "delta": ...}; None where absent
    records: list[RequestRecord]
    metadata: dict[str, str] = field(default_factory=dict)  # e.g. prefix_cache=radix
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """How reports name this run's system: the system, with its label if it has one."""
        return f"{self.system} ({self.label})" if self.label else self.system

    @property
    def workload_name(self) -> str:
        return str(self.workload["name"])

    @property
    def concurrency(self) -> int:
        """The configured cap, else the peak the client actually saw."""
        cap = self.load.get("max_concurrency")
        return int(cap) if cap else self.summary.peak_concurrency

    @property
    def cache_mode(self) -> str | None:
        """radix, hash or off for a radixserve run (metadata prefix_cache), else None."""
        mode = self.metadata.get("prefix_cache")
        return mode if mode in ("radix", "hash", "off") else None

    @property
    def hit_rate(self) -> tuple[float | None, str]:
        """The measured hit rate and where it came from: usage when the server reported
        cached_tokens, else its /metrics counters, else none."""
        cache = self.summary.cache
        if cache.usage_requests_reported:
            return cache.usage_hit_rate, "usage"
        if cache.metrics_hit_rate is not None:
            return cache.metrics_hit_rate, "/metrics"
        return None, "not reported"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["records"] = [r.to_json() for r in self.records]
        return {"schema": SCHEMA, **data}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchResult:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} result (schema {data.get('schema')!r})")
        values = {k: v for k, v in data.items() if k != "schema"}
        values["summary"] = summary_from_json(data["summary"])
        values["records"] = [RequestRecord.from_json(r) for r in data["records"]]
        return cls(**values)

    @classmethod
    def load_file(cls, path: str | Path) -> BenchResult:
        return cls.from_json(json.loads(Path(path).read_text()))
