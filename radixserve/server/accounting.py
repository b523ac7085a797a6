"""Prompt-cache accounting for both APIs (Anthropic's and OpenAI's): engine truth or vendor
emulation, priced in dollars.

One `CacheLedger` per app opens a `JobAccount` per job, which turns the engine's figures (or a
`VendorCache`'s verdict) into a `CacheUsage`, prices it and feeds the cost metrics. Event loop
only (not thread-safe).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

from radixserve.outputs import RequestOutput
from radixserve.provider_caching import (
    PROFILES,
    Accounting,
    Cost,
    LayoutBreakpoint,
    ModelPrice,
    ModelProfile,
    PriceTable,
    PromptLayout,
    VendorCache,
    default_prices,
    load_prices,
    profile_for_model,
    request_cost,
)
from radixserve.provider_caching.usage import CacheUsage
from radixserve.server.auth import CacheNamespace
from radixserve.server.observability.metrics import ServerMetrics
from radixserve.server.serving import Job
from radixserve.server.settings import ServerSettings

Api = Literal["anthropic", "openai"]


class OffsetClock:
    """`time.monotonic()` plus an offset that only moves forward. With --enable-clock-control
    the engine (TTL pins) and the vendor emulation (entry lifetimes) share one, so a test can
    expire a 5-minute TTL without waiting five minutes."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self.offset_s += seconds  # one float store: safe against the engine thread's reads


def engine_usage(
    prompt_tokens: int, cached_tokens: int, breakpoints: Sequence[LayoutBreakpoint]
) -> CacheUsage:
    """Engine-truth usage: reads are the tokens the prefix cache supplied; writes are the
    tokens this request newly put into the cache up to its last breakpoint, each counted under
    the TTL of the breakpoint whose segment holds it (1h breakpoints come first, so the 1h
    segment ends at the last 1h breakpoint); everything else is uncached input."""
    if not breakpoints:
        return CacheUsage(prompt_tokens, cache_read_tokens=cached_tokens)
    last = max(bp.tokens for bp in breakpoints)
    last_1h = max((bp.tokens for bp in breakpoints if bp.ttl == "1h"), default=0)
    write_1h = max(0, last_1h - cached_tokens)
    write_5m = max(0, last - max(cached_tokens, last_1h))
    return CacheUsage(prompt_tokens, cached_tokens, write_5m, write_1h)


class JobAccount:
    """One job's entry in the `CacheLedger`: its usage, output and cost, fed by
    `EngineService.generate` (it is the job's `serving.UsageObserver`).

    The usage is known at the first output: engine mode needs the engine's cached-token count,
    vendor mode tells the emulation then that the request has started responding (its writes
    become readable to later requests).
    """

    def __init__(
        self, ledger: CacheLedger, api: Api, price: ModelPrice,
        breakpoints: Sequence[LayoutBreakpoint] = (), vendor: VendorCache | None = None,
        accounting: Accounting | None = None, bill_output: bool = True, profile: str = "",
    ) -> None:
        self.ledger = ledger
        self.api = api
        self.price = price
        self.profile = profile  # the price profile's name, for the dashboard
        self.breakpoints = tuple(breakpoints)
        self.vendor = vendor
        self.accounting = accounting
        self.bill_output = bill_output  # False for a max_tokens=0 pre-warm
        self.usage: CacheUsage | None = None
        self.output_tokens = 0
        self.cost: Cost | None = None
        self._closed = False

    def observe(self, output: RequestOutput) -> RequestOutput:
        if self.usage is None:
            if self.vendor is not None and self.accounting is not None:
                self.vendor.first_token(self.accounting.request_id)
                self.usage = self.accounting.usage
            else:
                self.usage = engine_usage(len(output.prompt_token_ids), output.num_cached_tokens,
                                          self.breakpoints)
        if self.bill_output:
            self.output_tokens = sum(len(sample.token_ids) for sample in output.outputs)
        if self.api == "openai" and self.vendor is not None:
            # The OpenAI routes read num_cached_tokens; in vendor mode it is the vendor's figure.
            return dataclasses.replace(output, num_cached_tokens=self.usage.cache_read_tokens)
        return output

    def close(self) -> None:
        """Bills the request once it ends; a request that never responded only drops the
        vendor writes it had announced (the vendor bills nothing for a failed request)."""
        if self._closed:
            return
        self._closed = True
        if self.usage is None:
            if self.vendor is not None and self.accounting is not None:
                self.vendor.abort(self.accounting.request_id)
            return
        self.cost = request_cost(self.usage, self.output_tokens, self.price)
        self.ledger.metrics.request_billed(self.api, self.usage, self.cost.with_cache,
                                           self.cost.without_cache)

    def prompt_cost(self) -> Cost | None:
        """The prompt's cost alone (for stream headers, sent before the output exists)."""
        return None if self.usage is None else request_cost(self.usage, 0, self.price)


# Vendor-emulation caches kept, one per (profile, namespace).
MAX_VENDOR_NAMESPACES = 10_000


class CacheLedger:
    """Per-app accounting state: the mode, the price table and one vendor emulation per
    (profile, tenant namespace), since vendor caches are per model and per organisation."""

    def __init__(self, settings: ServerSettings, metrics: ServerMetrics,
                 clock: Callable[[], float]) -> None:
        self.vendor_mode = settings.cache_accounting == "vendor"
        self.min_cacheable_tokens = settings.min_cacheable_tokens
        self.metrics = metrics
        self.clock = clock
        self.prices: PriceTable = (load_prices(settings.prices_path) if settings.prices_path
                                   else default_prices())
        self.openai_model = settings.model_name
        # Least recently used first; bounded, as clients choose namespaces (cache_salt).
        self._caches: OrderedDict[tuple[str, CacheNamespace], VendorCache] = OrderedDict()

    def profile(self, model: str, vendor: Api) -> ModelProfile:
        base = profile_for_model(model, vendor)
        if self.min_cacheable_tokens is None:
            return base
        return base.with_minimum(self.min_cacheable_tokens)

    def price(self, model: str, vendor: Api) -> ModelPrice:
        # Priced by the base profile: a --min-cacheable-tokens override renames the profile.
        return self.prices.lookup(model, profile_for_model(model, vendor))

    def _vendor_cache(self, profile: ModelProfile, namespace: CacheNamespace) -> VendorCache:
        key = (profile.name, namespace)
        cache = self._caches.pop(key, None) or VendorCache(profile, clock=self.clock)
        self._caches[key] = cache
        if len(self._caches) > MAX_VENDOR_NAMESPACES:
            # Forgetting the least recently used namespace bills its next request as the
            # vendor would after its entries expired: as a miss.
            self._caches.popitem(last=False)
        return cache

    def anthropic(self, model: str, layout: PromptLayout, namespace: CacheNamespace,
                  bill_output: bool = True) -> JobAccount:
        """A Messages request's account; in vendor mode its reads and writes happen now, at
        the request's start, as the vendor's lookup does."""
        price, name = self.price(model, "anthropic"), profile_for_model(model, "anthropic").name
        if not self.vendor_mode:
            return JobAccount(self, "anthropic", price, layout.breakpoints,
                              bill_output=bill_output, profile=name)
        vendor = self._vendor_cache(self.profile(model, "anthropic"), namespace)
        return JobAccount(self, "anthropic", price, layout.breakpoints, vendor,
                          vendor.start(layout), bill_output, profile=name)

    def openai(self, job: Job) -> JobAccount:
        """An OpenAI job's account: engine truth, or OpenAI's automatic-caching rules (1,024
        token minimum, 128-token increments) over the prompt's token ids."""
        model = self.openai_model
        price, name = self.price(model, "openai"), profile_for_model(model, "openai").name
        if not self.vendor_mode:
            return JobAccount(self, "openai", price, profile=name)
        namespace = f"{model}\0{job.namespace!r}"
        layout = PromptLayout(block_hashes=(), breakpoints=(), total_tokens=len(job.prompt_ids),
                              token_ids=tuple(job.prompt_ids), namespace=namespace)
        vendor = self._vendor_cache(self.profile(model, "openai"), job.namespace)
        return JobAccount(self, "openai", price, (), vendor, vendor.start(layout), profile=name)


def is_known_anthropic_model(model: str) -> bool:
    """Whether `model` is an Anthropic model id a profile knows (served as an alias)."""
    return any(model.startswith(prefix) for profile in PROFILES if profile.vendor == "anthropic"
               for prefix in profile.model_prefixes)
