"""Prometheus metrics for one app, in a registry of its own (two apps in one process never mix).

Names carry the `radixserve:` prefix and follow vLLM's names and counting rules where vLLM has
one, so `radixserve bench` reads them as they are (`--metrics-compat vllm` adds `vllm:` twins
for tools that read only vLLM's names: metrics_compat). Engine-side figures (cache
counters, pool occupancy) come from a snapshot taken on the engine thread between steps.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from radixserve.cache.base import CacheStats
from radixserve.engine.background_prefill import BackgroundPrefill, BackgroundPrefillStats
from radixserve.engine.engine import LLMEngine, PoolStats
from radixserve.engine.speculative.stats import SpeculationCounters
from radixserve.kv_tier.store import LOAD_BUCKETS, TierStats
from radixserve.provider_caching.usage import CacheUsage
from radixserve.server.observability.metrics_compat import VllmView

PREFIX = "radixserve:"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state at one instant between steps (consistent across its fields)."""

    pool: PoolStats
    cache: CacheStats
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    computed_prompt_tokens: int
    preemptions: int
    kv_tier_hits: int
    tier: TierStats | None  # None without a disk tier
    speculation: SpeculationCounters
    background_prefill: BackgroundPrefillStats | None = None  # None: not on


def take_snapshot(engine: LLMEngine, background: BackgroundPrefill | None = None
                  ) -> EngineSnapshot:
    """Run on the engine thread (`AsyncEngine.run`), never beside a step; `background`: the
    engine's idle-time prefills, if on."""
    counters = engine.scheduler.counters
    return EngineSnapshot(
        pool=engine.pool_stats(),
        cache=engine.cache.stats(),
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        prefix_cache_queries=counters.prefix_cache_queries,
        prefix_cache_hits=counters.prefix_cache_hits,
        computed_prompt_tokens=counters.computed_prompt_tokens,
        preemptions=counters.preemptions,
        kv_tier_hits=counters.kv_tier_hits,
        tier=engine.offload.store.stats() if engine.offload is not None else None,
        speculation=dataclasses.replace(engine.speculation.counters,
                                        accepted_per_position=list(
                                            engine.speculation.counters.accepted_per_position)),
        background_prefill=background.snapshot() if background is not None else None,
    )


def _speculation(spec: SpeculationCounters, counter: Callable[[str, str, float], Metric],
                 label: list[str], value: list[str]) -> Iterator[Metric]:
    """Speculative decoding's counters (vLLM's spec_decode names and counting)."""
    yield counter("spec_decode_num_drafts", "Drafts verified (one request's draft in one "
                  "step).", spec.drafts)
    yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", spec.draft_tokens)
    yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (the model's own "
                  "next token not counted).", spec.accepted_tokens)
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Drafts whose token at this "
        "position (0: the first) was accepted.", labels=[*label, "position"])
    for position, accepted in enumerate(spec.accepted_per_position):
        per_position.add_metric([*value, str(position)], accepted)
    yield per_position
    yield counter("spec_decode_steps", "Engine steps that decoded (the denominator of the "
                  "share that speculated).", spec.steps)
    yield counter("spec_decode_speculative_steps", "Of those, steps that verified at least "
                  "one draft.", spec.speculative_steps)
    yield counter("spec_decode_draft_seconds", "Time spent drafting.", spec.draft_seconds)


class FrozenHeapCollector(Collector):
    """Objects frozen out of the collector's full passes once warm (`server.heap`; 0 before)."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(PREFIX + "gc_frozen_objects", "Objects alive at warm-up, "
                                   "left out of the garbage collector's full passes.")
        family.add_metric([], float(gc.get_freeze_count()))
        yield family


class _EngineCollector(Collector):
    """Emits the latest snapshots' figures; the /metrics route refreshes them before a scrape.
    One engine: labelled by model only; replicas (keyed by id): each labelled `replica` too."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshots: dict[str | None, EngineSnapshot] = {}

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, snap in sorted(self.snapshots.items(), key=lambda kv: str(kv[0])):
            for family in self._families(snap, replica):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()

    def _families(self, snap: EngineSnapshot, replica: str | None) -> Iterator[Metric]:
        label = ["model_name"] if replica is None else ["model_name", "replica"]
        value = [self.model_name] if replica is None else [self.model_name, replica]

        def counter(name: str, doc: str, amount: float) -> Metric:
            family = CounterMetricFamily(PREFIX + name, doc, labels=label)
            family.add_metric(value, amount)
            return family

        def gauge(name: str, doc: str, amount: float) -> Metric:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=label)
            family.add_metric(value, amount)
            return family

        pool = snap.pool
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                      "(counted once per request, at its first admission).",
                      snap.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Of the queried prompt tokens, those found cached.",
                      snap.prefix_cache_hits)
        yield counter("prompt_tokens_computed", "Prompt tokens run through the model "
                      "(preempted requests recompute theirs).", snap.computed_prompt_tokens)
        yield counter("num_preemptions", "Requests preempted to free KV for others.",
                      snap.preemptions)
        yield counter("prefix_cache_inserted_tokens", "Tokens added to the prefix cache.",
                      snap.cache.inserted_tokens_total)
        yield counter("prefix_cache_evicted_tokens", "Tokens evicted from the prefix cache.",
                      snap.cache.evicted_tokens_total)
        yield gauge("num_requests_running", "Requests (samples) in the running batch.",
                    snap.num_running)
        yield gauge("num_requests_waiting", "Requests (samples) waiting for admission.",
                    snap.num_waiting)
        # As vLLM counts it: cached but unlocked KV is reclaimable, so it is not "in use".
        used = pool.total - pool.free - pool.evictable
        yield gauge("kv_cache_usage_perc", "Fraction of KV slots in use (1 = full); evictable "
                    "cached slots count as free.", used / pool.total if pool.total else 0.0)
        yield gauge("kv_cache_capacity_tokens", "KV pool size in tokens.", pool.total)
        slots = GaugeMetricFamily(
            PREFIX + "kv_cache_tokens", "KV slots by state: free, evictable (cached, unlocked), "
            "protected (cached, locked by a request), pinned (cached, held by a TTL), private "
            "(a running request's own). At idle protected and private are 0.",
            labels=[*label, "state"])
        for state in ("free", "evictable", "protected", "pinned", "private"):
            slots.add_metric([*value, state], getattr(pool, state))
        yield slots
        yield gauge("prefix_cache_nodes", "Nodes (radix) or blocks (hash) in the prefix cache.",
                    snap.cache.nodes)
        yield from _speculation(snap.speculation, counter, label, value)
        if snap.background_prefill is not None:
            bg = snap.background_prefill
            yield counter("background_prefill_jobs", "Idle-time prefills started (the next "
                          "turn's history where the chat template rewrites it).", bg.started)
            yield counter("background_prefill_yielded", "Idle-time prefills stopped for a "
                          "request that arrived (their computed part stays cached).", bg.yielded)
            yield counter("background_prefill_tokens", "Tokens idle-time prefills left in the "
                          "cache, first in line for eviction.", bg.tokens)
            yield gauge("background_prefill_pending", "Idle-time prefills queued or running.",
                        bg.pending)
        if snap.tier is not None:
            yield from self._tier(snap, counter, gauge, label, value)

    def _tier(self, snap: EngineSnapshot, counter: Callable[[str, str, float], Metric],
              gauge: Callable[[str, str, float], Metric], label: list[str],
              value: list[str]) -> Iterator[Metric]:
        tier = snap.tier
        assert tier is not None
        c = tier.counters
        yield counter("kv_tier_hits", "Prompt tokens loaded from the disk KV tier instead of "
                      "computed (part of prefix_cache_hits).", snap.kv_tier_hits)
        yield counter("kv_tier_bytes_written", "Bytes of KV entries written to the tier.",
                      c.bytes_written)
        yield counter("kv_tier_bytes_read", "Bytes of KV read back from the tier.", c.bytes_read)
        yield counter("kv_tier_dropped_writes", "Block writes dropped because the write queue "
                      "was full.", c.dropped_writes)
        yield gauge("kv_tier_entries", "Blocks held in the tier.", tier.entries)
        yield gauge("kv_tier_pinned_entries", "Blocks under a live cache_control pin.",
                    tier.pinned_entries)
        yield gauge("kv_tier_disk_bytes", "Bytes the tier's entries take on disk.", tier.bytes)
        yield gauge("kv_tier_capacity_bytes", "The tier's disk budget.", tier.capacity_bytes)
        yield gauge("kv_tier_writable", "1 while the tier takes writes; 0 after a full disk or "
                    "a read-only directory.", float(tier.writable))
        errors = CounterMetricFamily(
            PREFIX + "kv_tier_errors", "Tier entries that could not be used, by kind: missing, "
            "truncated, corrupt, foreign (another block or model), io, write.",
            labels=[*label, "kind"])
        for kind, count in c.errors.items():
            errors.add_metric([*value, kind], count)
        yield errors
        buckets, total = [], 0
        for bound, count in zip(LOAD_BUCKETS, c.load_buckets, strict=True):
            total += count
            buckets.append((repr(bound), total))
        buckets.append(("+Inf", c.load_count))
        load = HistogramMetricFamily(
            PREFIX + "kv_tier_load_seconds", "Time to load one request's blocks from the tier "
            "into the KV pool (read, check, copy).", labels=label)
        load.add_metric(value, buckets, c.load_seconds)
        yield load


class ServerMetrics:
    """Request-side metrics, observed by the routes; engine-side ones come from snapshots."""

    def __init__(self, model_name: str, compat: str | None = None) -> None:
        """`compat` "vllm" adds `vllm:` twins to the exposition (ServerSettings.metrics_compat)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of requests that reached their first "
            "token (cached or not; once per sample).", label, registry=reg).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", label, registry=reg
        ).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success", "Finished requests (samples) by finish reason.",
            ["model_name", "finished_reason"], registry=reg)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "From receipt of the HTTP request to its "
            "first generated token.", label, buckets=_TTFT_BUCKETS, registry=reg
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Gap between successive outputs of one "
            "sample.", label, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "From receipt to the last token, for "
            "requests that finished (stop or length).", label, buckets=_E2E_BUCKETS,
            registry=reg).labels(model_name)
        self._rejected = Counter(
            PREFIX + "request_rejected", "Requests turned away before reaching the engine, by "
            "reason (queue_full, shutting_down).", ["model_name", "reason"], registry=reg)
        # Prompt caching as billed: the usage fields the responses carried, priced at the
        # vendor's rates (--prices), beside what the same requests would cost uncached.
        api = ["model_name", "api"]
        self._cost = Counter(
            PREFIX + "request_cost_usd", "Dollars the requests cost at the price table's rates, "
            "with prompt caching as the usage fields report it.", api, registry=reg)
        self._uncached_cost = Counter(
            PREFIX + "request_uncached_cost_usd", "Dollars the same requests would cost "
            "with nothing cached.", api, registry=reg)
        self._saved = Gauge(
            PREFIX + "prompt_cache_saved_usd", "Cumulative dollars saved by prompt caching "
            "(uncached minus cached cost); negative while cache writes have not paid off yet.",
            api, registry=reg)
        self._cache_usage = Counter(
            PREFIX + "prompt_cache_usage_tokens", "Prompt tokens as the usage fields reported "
            "them, by kind: read, write_5m, write_1h, uncached.", ["model_name", "api", "kind"],
            registry=reg)
        # Per-request preambles (provider_caching.preambles) taken out before rendering.
        self._preambles = Counter(
            PREFIX + "preamble_stripped", "Requests whose per-request preamble (such as "
            "Claude Code's billing header) was taken out before rendering, by preamble.",
            ["model_name", "preamble"], registry=reg)
        self._rewrites = Counter(
            PREFIX + "template_rewrites", "Chat turns whose next turn the chat template "
            "renders otherwise than generated (reasoning dropped from the history).",
            ["model_name"], registry=reg)
        self._rewrite_tokens = Counter(
            PREFIX + "template_rewrite_tokens", "Generated tokens after those rewrites: what "
            "the next turns re-prefill without the next-turn prefill.", ["model_name"],
            registry=reg)
        self._preamble_tokens = Counter(
            PREFIX + "preamble_stripped_tokens", "Tokens of the per-request preambles taken "
            "out, by preamble.", ["model_name", "preamble"], registry=reg)
        self._engine = _EngineCollector(model_name)
        reg.register(self._engine)
        self._exposition: Collector = VllmView(reg, PREFIX) if compat == "vllm" else reg

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def request_billed(self, api: str, usage: CacheUsage, cost: float, uncached_cost: float) -> None:
        """Counts one finished request's cache usage and dollars (`api`: anthropic, openai)."""
        self._cost.labels(self.model_name, api).inc(cost)
        self._uncached_cost.labels(self.model_name, api).inc(uncached_cost)
        self._saved.labels(self.model_name, api).inc(uncached_cost - cost)
        kinds = {"read": usage.cache_read_tokens, "write_5m": usage.cache_write_5m_tokens,
                 "write_1h": usage.cache_write_1h_tokens, "uncached": usage.uncached_tokens}
        for kind, tokens in kinds.items():
            self._cache_usage.labels(self.model_name, api, kind).inc(tokens)

    def template_rewrite(self, tokens: int) -> None:
        self._rewrites.labels(self.model_name).inc()
        self._rewrite_tokens.labels(self.model_name).inc(tokens)

    def preamble_stripped(self, preamble: str, tokens: int) -> None:
        self._preambles.labels(self.model_name, preamble).inc()
        self._preamble_tokens.labels(self.model_name, preamble).inc(tokens)

    def request_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self, snapshot: EngineSnapshot | None) -> bytes:
        """The text exposition; `snapshot` refreshes the engine figures (None keeps the last)."""
        if snapshot is not None:
            self._engine.snapshots = {None: snapshot}
        return generate_latest(self._exposition)

    def render_replicas(self, snapshots: dict[str, EngineSnapshot]) -> bytes:
        """The exposition behind a replica ingress: each replica's engine figures, labelled
        `replica` (sum them for the cluster); the request-side ones are the ingress's own."""
        self._engine.snapshots = dict(snapshots)
        return generate_latest(self._exposition)
