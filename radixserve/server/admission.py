"""Admission control: a request is refused at once (429 with `retry-after` and `retry-after-ms`;
Anthropic's routes answer 529 `overloaded_error`) when queueing it would pass a bound, instead of
waiting to time out after the server has spent its prefill.

A request is judged before any tokenization, on its body's length in bytes; once its prompt is
tokenized its share of the queue is corrected to its real token count, and it leaves the queue
when its first token arrives. Three bounds: queued requests, queued prompt tokens, and the
estimated wait (queued uncached tokens over the measured drain rate, so that cached prompts count
for what they cost). One API key may hold at most `key_share` of each bound, so a flooding key
leaves room for the others.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.server.errors import APIError
from radixserve.server.settings import ServerSettings

# Chat and completion bodies hold about this many bytes per prompt token (JSON around text that
# a BPE vocabulary encodes at ~4 bytes a token); refined once the prompt is tokenized.
BYTES_PER_TOKEN = 4.0
PROMETHEUS_PREFIX = "radixserve:"  # as `observability.metrics`


@dataclass(frozen=True)
class AdmissionLimits:
    """The bounds (`ServerSettings` checks them)."""

    max_queued_requests: int = 1024
    max_queued_tokens: int = 65536
    max_queue_wait_s: float = 30.0  # 0: no wait bound
    key_share: float = 0.5  # the most of each bound one API key may hold (1: no fairness)
    # Until a drain rate has been measured (warm-up measures one), the wait is estimated at it.
    prior_tokens_per_s: float = 1000.0

    @classmethod
    def of(cls, settings: ServerSettings) -> AdmissionLimits:
        return cls(max_queued_requests=settings.max_waiting,
                   max_queued_tokens=settings.max_queued_tokens,
                   max_queue_wait_s=settings.max_queue_wait_s, key_share=settings.queue_key_share)


class DrainRate:
    """Uncached prompt tokens the engine takes off the queue per second, measured over busy
    periods only (time while nothing waited is not counted), over the last `window` starts."""

    def __init__(self, prior: float, window: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prior = prior
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque(maxlen=window)  # (busy seconds, tokens)
        self._since: float | None = None  # start of the current busy interval

    def busy(self) -> None:
        """Work is waiting from now (called when the queue stops being empty)."""
        if self._since is None:
            self._since = self.clock()

    def idle(self) -> None:
        self._since = None

    def observe(self, tokens: int) -> None:
        """A queued job started, having needed `tokens` uncached prompt tokens."""
        now = self.clock()
        if self._since is not None:
            self._samples.append((now - self._since, max(tokens, 1)))
        self._since = now

    def calibrate(self, tokens: int, seconds: float) -> None:
        """A measurement taken apart from traffic (the warm-up prefill) replaces the prior."""
        if seconds > 0 and tokens > 0:
            self.prior = tokens / seconds

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(t for _, t in self._samples)
        seconds = sum(s for s, _ in self._samples)
        if len(self._samples) < 4 or seconds <= 0.05:
            tokens, seconds = self.prior, 1.0  # the prior weighs as one second of measurement
        # The time since the last start counts too: an engine that has stalled (or is deep in
        # one long prefill) drains nothing, and the waits it is asked to estimate grow with it.
        open_s = self.clock() - self._since if self._since is not None else 0.0
        return tokens / (seconds + open_s)


@dataclass
class _Load:
    requests: int = 0
    tokens: float = 0.0  # estimated uncached prompt tokens


@dataclass
class Ticket:
    """One request's place in the queue; `Admission` keeps the totals in step with it."""

    key: str
    tokens: float = 0.0
    requests: int = 0
    left: bool = False
    received_at: float = field(default_factory=time.monotonic)


class Overloaded(APIError):
    """429 (OpenAI shape) or 529 `overloaded_error` (Anthropic shape), with retry headers."""

    def __init__(self, status: int, message: str, retry_after_s: float) -> None:
        super().__init__(status, message,
                         type="rate_limit_error" if status == 429 else "overloaded_error",
                         code="server_overloaded" if status == 429 else None,
                         headers=retry_headers(retry_after_s))
        self.retry_after_s = retry_after_s


def retry_headers(seconds: float) -> dict[str, str]:
    """`retry-after` in whole seconds (the standard form) and `retry-after-ms`, which both
    official SDKs read first; a retry sooner than 100 ms would only meet the same queue."""
    seconds = min(max(seconds, 0.1), 60.0)
    return {"retry-after": str(max(1, math.ceil(seconds))),
            "retry-after-ms": str(int(seconds * 1000))}


class Admission:
    """The queue's bounds, per server. Not thread-safe: used from the event loop only."""

    def __init__(self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.limits = limits
        self.rate = DrainRate(limits.prior_tokens_per_s, clock=clock)
        self.total = _Load()
        self._keys: dict[str, _Load] = {}  # keys with queued work only: bounded by the queue
        # (prompt tokens, cached tokens) of recent starts: the share a queued prompt will find
        # cached, token-weighted.
        self._hits: deque[tuple[int, int]] = deque(maxlen=64)
        self.refused = 0

    def _hit_ratio(self) -> float:
        prompt = sum(p for p, _ in self._hits)
        return sum(c for _, c in self._hits) / prompt if prompt else 0.0

    def estimated_wait_s(self) -> float:
        return self.total.tokens / self.rate.tokens_per_s

    def enter(self, key: str, body_bytes: int, status: int = 429) -> Ticket:
        """A ticket for a request whose body is `body_bytes` long, or Overloaded (`status`)."""
        tokens = body_bytes / BYTES_PER_TOKEN * (1.0 - self._hit_ratio())
        self._check(key, tokens, status)
        ticket = Ticket(key)
        self._add(ticket, 1, tokens)
        return ticket

    def measured(self, ticket: Ticket, prompt_tokens: int, requests: int) -> None:
        """The request's prompt is tokenized: `prompt_tokens` in `requests` engine jobs."""
        if not ticket.left:
            tokens = prompt_tokens * (1.0 - self._hit_ratio())
            self._add(ticket, requests - ticket.requests, tokens - ticket.tokens)

    def job_started(self, ticket: Ticket, prompt_tokens: int, cached_tokens: int) -> None:
        """One job of the request produced its first token."""
        self._hits.append((prompt_tokens, cached_tokens))
        self.rate.observe(prompt_tokens - cached_tokens)
        if not ticket.left and ticket.requests > 0:
            share = ticket.tokens / ticket.requests
            self._add(ticket, -1, -share)

    def leave(self, ticket: Ticket) -> None:
        """The request is done waiting (started, finished, failed or gone); idempotent."""
        if not ticket.left:
            self._add(ticket, -ticket.requests, -ticket.tokens)
            ticket.left = True

    def _add(self, ticket: Ticket, requests: int, tokens: float) -> None:
        ticket.requests += requests
        ticket.tokens += tokens
        load = self._keys.setdefault(ticket.key, _Load())
        for item in (self.total, load):
            item.requests += requests
            item.tokens += tokens
        if load.requests <= 0:
            del self._keys[ticket.key]
        if self.total.requests <= 0:
            self.total = _Load()
            self.rate.idle()
        else:
            self.rate.busy()

    def _check(self, key: str, tokens: float, status: int) -> None:
        lim = self.limits
        own = self._keys.get(key, _Load())
        rate = self.rate.tokens_per_s
        wait_tokens = lim.max_queue_wait_s * rate if lim.max_queue_wait_s else math.inf
        # Requests without a key are one tenant, with nobody to be fair to within it.
        share = lim.key_share if key else 1.0
        bounds = (("requests waiting", self.total.requests + 1, own.requests + 1,
                   lim.max_queued_requests, 0.0),
                  ("prompt tokens waiting", self.total.tokens + tokens, own.tokens + tokens,
                   lim.max_queued_tokens, tokens),
                  ("estimated queue wait", self.total.tokens + tokens, own.tokens + tokens,
                   wait_tokens, tokens))
        for what, total, mine, bound, cost in bounds:
            over_total = total > bound and self.total.requests > 0
            over_share = mine > bound * share and own.requests > 0
            if over_total or over_share:
                self.refused += 1
                raise self._refusal(what, total if over_total else mine,
                                    bound if over_total else bound * share,
                                    over_share and not over_total, cost, status)

    def _refusal(self, what: str, value: float, bound: float, per_key: bool, cost: float,
                 status: int) -> Overloaded:
        # Until enough queued work drains for this request to fit (at least one request's).
        excess_tokens = max(value - bound, cost, self.total.tokens / max(self.total.requests, 1))
        retry = excess_tokens / self.rate.tokens_per_s
        whose = "this API key's share of " if per_key else ""
        if what == "estimated queue wait":
            detail = (f"{whose}the {what} would be {value / self.rate.tokens_per_s:.1f} s, over "
                      f"{bound / self.rate.tokens_per_s:.1f} s")
        else:
            detail = f"{whose}{what} would be {value:.0f}, over {bound:.0f}"
        return Overloaded(status, f"The server is overloaded ({detail}); retry after "
                                  f"{retry:.2f} s.", retry)


class AdmissionCollector(Collector):
    """The queue as admission sees it, for /metrics (read without the engine, so a scrape
    answers even while a step is stalled)."""

    def __init__(self, admission: Admission, model_name: str) -> None:
        self.admission = admission
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        a = self.admission
        figures = (
            ("admission_queued_requests", "Requests admitted and without a first token yet.",
             a.total.requests),
            ("admission_queued_tokens", "Their estimated uncached prompt tokens.",
             a.total.tokens),
            ("admission_drain_rate_tokens_per_second", "Uncached prompt tokens the engine takes "
             "off the queue per second (measured while busy; warm-up's figure before).",
             a.rate.tokens_per_s),
            ("admission_estimated_wait_seconds", "The queue wait a new request would face.",
             a.estimated_wait_s()))
        for name, doc, value in figures:
            family = GaugeMetricFamily(PROMETHEUS_PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family
