"""The prefix router's settings (`--router-*` flags), apart from the router's module: Ray
pickles that module by value, and the CLI reads these defaults without importing Ray."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixRoutingConfig:
    # More requests in flight than the least loaded replica by this many: passed over. A miss
    # costs a whole prefix's prefill (seconds on a CPU), while requests queued on a busier
    # replica share its batched decode steps, so this is not small (at 8 concurrent requests
    # over 2 replicas, benchmarks/bench_replicas.py: 8 kept 91% of prompt tokens cached, 4
    # only 73%, spilling prefixes onto the other replica).
    imbalance_threshold: int = 8
    # A shorter cached prefix is not worth following: such requests go where load is lowest.
    min_match_tokens: int = 64
    # Blocks of a running request count as held by its replica at most this long.
    provisional_ttl_s: float = 30.0
