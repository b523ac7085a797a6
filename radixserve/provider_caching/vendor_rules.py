"""Vendor cache emulation: a stateful cache that reproduces a vendor's documented accounting.

Shared by the server's `--cache-accounting vendor` mode and the linter's simulator; time comes
from an injected clock so tests and replays control TTL expiry and concurrency.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.provider_caching.layout import PromptLayout
from radixserve.provider_caching.profiles import ModelProfile
from radixserve.provider_caching.usage import CacheUsage

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
_SWEEP_INTERVAL_S = 60.0


@dataclass
class _Entry:
    tokens: int
    ttl_s: float
    expires_at: float
    readable_at: float = math.inf  # set when a writing request starts responding
    pending_writers: int = 0


@dataclass(frozen=True)
class Accounting:
    """The vendor's usage for one request; `request_id` is for `first_token` / `abort`.

    `hit_block` is the block index whose entry was read (Anthropic; None on a miss or for
    automatic caching).
    """

    request_id: int
    usage: CacheUsage
    hit_block: int | None = None


@dataclass
class VendorCache:
    """One vendor's cache for one organisation, fed requests in arrival order.

    Rules (see shared/reference/prompt-caching-apis.md, sections 1.5-1.10, 2.1, 3.1):
    - anthropic: a request writes exactly one entry per breakpoint whose prefix reaches the
      profile's minimum; it reads the longest entry that an earlier request wrote, found by
      walking back at most `lookback_blocks` blocks from each breakpoint. Billing: reads up to
      the hit A, 1h writes up to the last 1h breakpoint B, 5m writes up to the last breakpoint C.
    - openai / gemini: automatic; every prompt of at least the minimum writes its prefixes at
      each `increment_tokens` boundary; a hit counts whole increments and is 0 below the
      minimum. No write surcharge, so writes are not reported.
    - An entry becomes readable only when its writer starts responding (`first_token`), so
      concurrent identical requests all pay for writes. Entries expire `ttl` after the start
      of the last request that wrote or read them (a read refreshes the lifetime).
    """

    profile: ModelProfile
    clock: Callable[[], float] = time.monotonic
    _entries: dict[bytes, _Entry] = field(default_factory=dict, init=False, repr=False)
    _pending: dict[int, list[bytes]] = field(default_factory=dict, init=False, repr=False)
    _ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)
    _next_sweep: float = field(default=-math.inf, init=False, repr=False)

    def start(self, layout: PromptLayout) -> Accounting:
        """Accounts a request starting now: reads, then writes (pending until `first_token`)."""
        now = self.clock()
        self._sweep(now)
        request_id = next(self._ids)
        self._pending[request_id] = []
        if self.profile.vendor == "anthropic":
            usage, hit_block = self._start_breakpoints(layout, now, request_id)
            return Accounting(request_id, usage, hit_block)
        return Accounting(request_id, self._start_automatic(layout, now, request_id))

    def first_token(self, request_id: int) -> None:
        """The request has started responding: its writes become readable from now on."""
        now = self.clock()
        for key in self._pending.pop(request_id, ()):
            entry = self._entries.get(key)
            if entry is not None:
                entry.readable_at = min(entry.readable_at, now)
                entry.pending_writers -= 1

    def abort(self, request_id: int) -> None:
        """The request failed before responding: writes nobody else made are dropped."""
        for key in self._pending.pop(request_id, ()):
            entry = self._entries.get(key)
            if entry is not None:
                entry.pending_writers -= 1
                if entry.pending_writers == 0 and entry.readable_at == math.inf:
                    del self._entries[key]

    @property
    def entry_count(self) -> int:
        return len(self._entries)

    def _start_breakpoints(
        self, layout: PromptLayout, now: float, request_id: int
    ) -> tuple[CacheUsage, int | None]:
        hit, hit_block = 0, None
        for bp in layout.breakpoints:
            stop = max(-1, bp.block_index - self.profile.lookback_blocks)
            for position in range(bp.block_index, stop, -1):
                entry = self._readable(layout.block_hashes[position], now)
                if entry is not None:
                    entry.expires_at = max(entry.expires_at, now + entry.ttl_s)
                    if entry.tokens > hit:
                        hit, hit_block = entry.tokens, position
                    break
        written = [bp for bp in layout.breakpoints if bp.tokens >= self.profile.min_cacheable_tokens]
        if not written:
            assert hit == 0  # entries are only ever written at or above the minimum
            return CacheUsage(layout.total_tokens), None
        last = written[-1].tokens
        last_1h = max((bp.tokens for bp in written if bp.ttl == "1h" and bp.tokens > hit),
                      default=hit)
        for bp in written:
            self._write(layout.block_hashes[bp.block_index], bp.tokens, TTL_SECONDS[bp.ttl],
                        now, request_id)
        usage = CacheUsage(
            layout.total_tokens,
            cache_read_tokens=hit,
            cache_write_1h_tokens=last_1h - hit,
            cache_write_5m_tokens=max(0, last - max(hit, last_1h)),
        )
        return usage, hit_block

    def _start_automatic(self, layout: PromptLayout, now: float, request_id: int) -> CacheUsage:
        if layout.token_ids is None:
            raise ValueError(f"{self.profile.vendor} caching is automatic: the layout needs token_ids")
        step, minimum = self.profile.increment_tokens, self.profile.min_cacheable_tokens
        keys = _chunk_hashes(layout.namespace, layout.token_ids, step)
        hit_chunks = next((k for k in range(len(keys), 0, -1)
                           if self._readable(keys[k - 1], now) is not None), 0)
        cached = hit_chunks * step if hit_chunks * step >= minimum else 0
        for key in keys[: cached // step]:
            entry = self._entries.get(key)  # chunks below the minimum are never written
            if entry is not None:
                entry.expires_at = max(entry.expires_at, now + entry.ttl_s)
        if layout.total_tokens >= minimum:
            for k in range(math.ceil(minimum / step), len(keys) + 1):
                self._write(keys[k - 1], k * step, self.profile.idle_ttl_s, now, request_id)
        return CacheUsage(layout.total_tokens, cache_read_tokens=cached)

    def _readable(self, key: bytes, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.readable_at > now or entry.expires_at <= now:
            return None
        return entry

    def _write(self, key: bytes, tokens: int, ttl_s: float, now: float, request_id: int) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= now and entry.pending_writers == 0:
            entry = None  # expired: this is a fresh write
        if entry is None:
            self._entries[key] = entry = _Entry(tokens, ttl_s, now + ttl_s)
        entry.ttl_s = max(entry.ttl_s, ttl_s)
        entry.expires_at = max(entry.expires_at, now + ttl_s)
        if entry.readable_at == math.inf:
            entry.pending_writers += 1
            self._pending[request_id].append(key)

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_INTERVAL_S
        expired = [k for k, e in self._entries.items()
                   if e.expires_at <= now and e.pending_writers == 0]
        for key in expired:
            del self._entries[key]


def _chunk_hashes(namespace: str, token_ids: tuple[int, ...], step: int) -> list[bytes]:
    """Chained hashes of the token prefix at every multiple of `step` tokens."""
    state = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    hashes = []
    for start in range(0, len(token_ids) - step + 1, step):
        chunk = array("q", token_ids[start:start + step]).tobytes()
        state = hashlib.blake2b(state + chunk, digest_size=16).digest()
        hashes.append(state)
    return hashes
