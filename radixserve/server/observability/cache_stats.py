"""The cache dashboard's book for one app (GET /v1/cache/stats): rolling series, totals, money,
per-tenant figures and the last finished requests.

Fed on the event loop by the submission service (each job as it ends, `record`) and by a
sampler task that takes one engine snapshot a second (`sample_pool`); not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from radixserve.engine.async_engine import AsyncEngine, EngineDeadError
from radixserve.engine.engine import PoolStats
from radixserve.server.accounting import JobAccount
from radixserve.server.auth import CacheNamespace
from radixserve.server.observability.metrics import take_snapshot
from radixserve.server.serving import JobEnd

logger = logging.getLogger(__name__)

# window name -> (bucket seconds, buckets)
WINDOWS = {"5m": (1, 300), "1h": (60, 60)}
RECENT_REQUESTS = 50
MISS_TOKENS = 8  # tokens of the prompt shown from where the cache match ended
# cache_salt is chosen by clients, so the tenants' table is bounded: least recently seen go.
MAX_TENANTS = 1024
TTFT_SAMPLES = 256  # per bucket; a uniform reservoir beyond that keeps percentiles honest


def namespace_label(namespace: CacheNamespace) -> str:
    """How a tenant is shown: "default", "salt:<cache_salt>", or "tenant:<8 hex of its key's
    hash>" (and "/salt:<cache_salt>" when that tenant splits its space)."""
    if namespace is None:
        return "default"
    if isinstance(namespace, str):
        return f"salt:{namespace}"
    if isinstance(namespace, tuple) and len(namespace) == 3:  # auth.cache_namespace's shape
        _, key_hash, salt = namespace
        return f"tenant:{key_hash[:8]}" + (f"/salt:{salt}" if salt is not None else "")
    return str(namespace)


@dataclass(frozen=True)
class FinishedRequest:
    """One job as the dashboard lists it; times are unix seconds."""

    request_id: str
    api: str
    at: float
    namespace: CacheNamespace
    prompt_tokens: int
    cached_tokens: int  # the engine's own figure
    ttft_s: float | None
    cost_usd: float | None  # None: not billed
    miss_at: int | None  # where the cache match ended; None: all but the last token was cached
    miss_token_ids: tuple[int, ...]  # the prompt's tokens from there
    notes: tuple[str, ...] = ()  # what the server changed in the prompt (`Job.notes`)


@dataclass
class Tally:
    """Requests and their prompt tokens: in all, per tenant, per bucket."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, record: FinishedRequest) -> None:
        self.requests += 1
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens

    @property
    def hit_rate(self) -> float | None:
        """Token-weighted, as vLLM counts it; None without prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass
class Bucket(Tally):
    """One interval of a series: what finished in it, and the pool as last sampled in it."""

    saved_usd: float = 0.0
    ttft_seen: int = 0
    ttft: list[float] = field(default_factory=list)  # a uniform sample of TTFT_SAMPLES at most
    pool: PoolStats | None = None  # the last sample taken in this bucket

    def percentile(self, q: float) -> float | None:
        """The nearest-rank TTFT percentile (0 < q <= 1); None if nothing finished."""
        if not self.ttft:
            return None
        ordered = sorted(self.ttft)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Series:
    """`length` buckets of `interval_s` seconds ending now, keyed by unix time // interval_s;
    only buckets that saw something are stored."""

    def __init__(self, interval_s: int, length: int) -> None:
        self.interval_s, self.length = interval_s, length
        self._buckets: dict[int, Bucket] = {}

    def bucket(self, now: float) -> Bucket:
        index = int(now // self.interval_s)
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = Bucket()
            for old in [i for i in self._buckets if i <= index - self.length]:
                del self._buckets[old]
        return bucket

    def points(self, now: float) -> list[tuple[float, Bucket | None]]:
        """(bucket start time, bucket or None), oldest first, the current bucket last."""
        last = int(now // self.interval_s)
        return [(i * self.interval_s, self._buckets.get(i))
                for i in range(last - self.length + 1, last + 1)]


@dataclass
class Money:
    with_cache_usd: float = 0.0
    without_cache_usd: float = 0.0
    profiles: set[str] = field(default_factory=set)  # the price profiles billed so far

    @property
    def saved_usd(self) -> float:
        return self.without_cache_usd - self.with_cache_usd


class CacheStatsBook:
    """Everything the stats endpoint reports that the engine does not know itself."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # unix seconds
        self.started_at = clock()
        self.series = {name: Series(*shape) for name, shape in WINDOWS.items()}
        self.totals = Tally()
        self.money = Money()
        self.tenants: OrderedDict[CacheNamespace, Tally] = OrderedDict()
        self.recent: deque[FinishedRequest] = deque(maxlen=RECENT_REQUESTS)
        self._rng = random.Random(0)

    def record(self, end: JobEnd) -> None:
        """Books a job that ended (the service's `on_job_end`); one that never produced output
        (refused, failed, or abandoned before its first token) is not a request served."""
        if end.cached_tokens is None:
            return
        account = end.usage if isinstance(end.usage, JobAccount) else None
        cost = account.cost if account is not None else None
        prompt = end.job.prompt_ids
        cached = end.cached_tokens
        miss_at = cached if cached < len(prompt) - 1 else None
        record = FinishedRequest(
            request_id=end.request_id, api=account.api if account else "openai", at=self.clock(),
            namespace=end.job.namespace, prompt_tokens=len(prompt), cached_tokens=cached,
            ttft_s=end.ttft_s, cost_usd=cost.with_cache if cost is not None else None,
            miss_at=miss_at,
            miss_token_ids=() if miss_at is None else tuple(prompt[miss_at : miss_at + MISS_TOKENS]),
            notes=end.job.notes)
        self.totals.add(record)
        tenant = self.tenants.pop(record.namespace, None) or Tally()
        tenant.add(record)
        self.tenants[record.namespace] = tenant  # most recently seen last
        if len(self.tenants) > MAX_TENANTS:
            self.tenants.popitem(last=False)
        self.recent.append(record)
        if cost is not None and account is not None:
            self.money.with_cache_usd += cost.with_cache
            self.money.without_cache_usd += cost.without_cache
            self.money.profiles.add(account.profile)
        for series in self.series.values():
            bucket = series.bucket(record.at)
            bucket.add(record)
            if cost is not None:
                bucket.saved_usd += cost.saved
            if record.ttft_s is not None:
                self._sample_ttft(bucket, record.ttft_s)

    def _sample_ttft(self, bucket: Bucket, ttft_s: float) -> None:
        bucket.ttft_seen += 1
        if len(bucket.ttft) < TTFT_SAMPLES:
            bucket.ttft.append(ttft_s)
        else:  # reservoir sampling: each value seen stays with equal probability
            slot = self._rng.randrange(bucket.ttft_seen)
            if slot < TTFT_SAMPLES:
                bucket.ttft[slot] = ttft_s

    def sample_pool(self, pool: PoolStats) -> None:
        now = self.clock()
        for series in self.series.values():
            series.bucket(now).pool = pool

    def saved_usd_per_hour(self) -> float:
        """Dollars saved over the last hour (or the uptime, if shorter), as an hourly rate."""
        now = self.clock()
        span = min(now - self.started_at, 3600.0)
        if span <= 0:
            return 0.0
        saved = sum(b.saved_usd for _, b in self.series["1h"].points(now) if b is not None)
        return saved * 3600.0 / max(span, 1.0)

    @contextlib.asynccontextmanager
    async def sampling(self, aengine: AsyncEngine) -> AsyncIterator[None]:
        """Samples the pool in the background while the body runs (the app's lifespan)."""
        task = asyncio.create_task(self.sample_forever(aengine))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def sample_forever(self, aengine: AsyncEngine, interval_s: float = 1.0) -> None:
        """Samples the pool once per `interval_s`, just after each bucket starts, until
        cancelled or the engine stops."""
        while aengine.alive:
            # Shielded: a cancelled engine call would break the engine thread (serving._pump).
            call = asyncio.ensure_future(aengine.run(take_snapshot))
            try:
                snapshot = await asyncio.shield(call)
            except EngineDeadError:
                return
            except asyncio.CancelledError:
                call.add_done_callback(_retrieve)  # the snapshot lands after we stop
                raise
            except Exception:  # a gap in the chart, never a reason to stop the server
                logger.exception("cache stats: pool sample failed")
            else:
                if snapshot is not None:  # None from stand-in engines in tests
                    self.sample_pool(snapshot.pool)
            await asyncio.sleep(interval_s - self.clock() % interval_s + 0.01)


def _retrieve(call: asyncio.Future[object]) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        call.result()
