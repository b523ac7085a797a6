"""Cost simulation: replays requests in time order through `VendorCache` (the same code as
the server's vendor accounting) and prices each request with and without caching.

Each request's writes become readable `first_token_s` after it starts, as at the vendor.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.lint.corpus import Corpus
from radixserve.provider_caching.breakpoints import check_breakpoints
from radixserve.provider_caching.layout import PromptLayout, build_layout
from radixserve.provider_caching.prices import Cost, PriceTable, break_even_reuses, request_cost
from radixserve.provider_caching.profiles import ModelProfile, Vendor
from radixserve.provider_caching.usage import CacheUsage
from radixserve.provider_caching.vendor_rules import VendorCache


@dataclass(frozen=True)
class SimRequest:
    """A request to replay; `rejected` holds the vendor's error when it would answer 400."""

    time: float
    layout: PromptLayout
    profile: ModelProfile
    model: str | None = None
    output_tokens: int = 0
    rejected: str | None = None


@dataclass(frozen=True)
class SimulationResult:
    vendor: Vendor
    profiles: tuple[str, ...]
    requests: int
    rejected: int
    usages: tuple[CacheUsage | None, ...]  # per request, in input order; None if rejected
    cost: Cost
    unmarked: int  # Anthropic rules: accepted requests without any breakpoint (nothing cached)
    break_even_5m: int | None  # reads needed after a write, for the first profile's price
    break_even_1h: int | None

    @property
    def prompt_tokens(self) -> int:
        return sum(u.prompt_tokens for u in self.usages if u)

    @property
    def cache_read_tokens(self) -> int:
        return sum(u.cache_read_tokens for u in self.usages if u)

    @property
    def cache_write_tokens(self) -> int:
        return sum(u.cache_write_tokens for u in self.usages if u)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens read from cache."""
        return self.cache_read_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_with_hits(self) -> int:
        return sum(1 for u in self.usages if u and u.cache_read_tokens)


@dataclass
class _Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    requests: Sequence[SimRequest], vendor: Vendor, prices: PriceTable, first_token_s: float = 1.0
) -> SimulationResult:
    """Replays `requests` by time (input order breaks ties); one cache per model profile."""
    clock = _Clock()
    caches: dict[str, VendorCache] = {}
    # (time, phase, sequence): at equal times a first token lands before a new arrival.
    events: list[tuple[float, int, int]] = [(r.time, 1, i) for i, r in enumerate(requests)]
    heapq.heapify(events)
    usages: list[CacheUsage | None] = [None] * len(requests)
    started: dict[int, tuple[VendorCache, int]] = {}
    total = Cost(0.0, 0.0)
    while events:
        clock.now, phase, index = heapq.heappop(events)
        request = requests[index]
        if phase == 0:
            cache, request_id = started.pop(index)
            cache.first_token(request_id)
            continue
        if request.rejected is not None:
            continue
        cache = caches.setdefault(request.profile.name, VendorCache(request.profile, clock))
        accounting = cache.start(request.layout)
        started[index] = (cache, accounting.request_id)
        heapq.heappush(events, (clock.now + first_token_s, 0, index))
        usages[index] = accounting.usage
        price = prices.lookup(request.model, request.profile)
        total = total + request_cost(accounting.usage, request.output_tokens, price)
    first = requests[0] if requests else None
    price = prices.lookup(first.model, first.profile) if first else None
    return SimulationResult(
        vendor=vendor,
        profiles=tuple(dict.fromkeys(r.profile.name for r in requests)),
        requests=len(requests),
        rejected=sum(1 for r in requests if r.rejected is not None),
        usages=tuple(usages),
        cost=total,
        unmarked=sum(1 for r in requests if vendor == "anthropic" and r.rejected is None
                     and not r.layout.breakpoints),
        break_even_5m=break_even_reuses(price, "5m") if price and vendor == "anthropic" else None,
        break_even_1h=break_even_reuses(price, "1h") if price and vendor == "anthropic" else None,
    )


def corpus_requests(
    corpus: Corpus, vendor: Vendor, profile_for: Callable[[str | None], ModelProfile],
    times: Sequence[float] | None = None,
) -> list[SimRequest]:
    """The corpus as simulator input under `vendor`'s rules. Breakpoints count only for
    Anthropic (and only in Anthropic-format bodies); OpenAI and Gemini cache automatically."""
    out = []
    for r in corpus.requests:
        profile = profile_for(r.rendered.model)
        rejected = None
        breakpoints: tuple = ()
        if vendor == "anthropic":
            check = check_breakpoints(r.rendered)
            rejected = check.errors[0].message if check.errors else None
            breakpoints = check.breakpoints
        layout = build_layout(
            r.rendered, breakpoints, [r.block_ends[bp.block_index] for bp in breakpoints],
            r.total_tokens,
            token_ids=r.token_ids(corpus.tokenizer) if vendor != "anthropic" else None,
        )
        out.append(SimRequest(times[r.index] if times else r.time, layout, profile,
                              r.rendered.model, r.logged.output_tokens, rejected))
    return out
