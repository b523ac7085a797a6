"""Decides, every step, which tokens of which requests the model computes.

Continuous batching: running requests decode one token each, partly prefilled ones continue
in chunks, and waiting ones are admitted while the token budget, `max_num_seqs` and the KV
pool allow. Short prompts (`short_prefill_tokens` uncached at most) go before long ones: each
step serves decodes and short prefills, then admits short waiting requests within half the
budget, then continues long prefills, then admits in the policy's order (fcfs or lpm), so a
short request waits at most a step behind another's long prompt. Admission reuses the prefix
cache: match, lock, budget memory (counting what eviction can free), allocate. When decode runs out of pages the newest request is preempted
(recompute later); its computed KV stays in the cache so it can hit on the way back in.
Tokens taken without a step (a grammar's forced text) are computed as a chunk before the
next sample; a finished request whose forced tail or pinned output has no KV yet settles it
in one more chunk, its client already answered, so the next turn reads the whole sequence.

With a disk tier (`KVTier`), admission also asks it for the blocks that follow the pool's match:
the request is then admitted into `loading` (radixserve/engine/tier_loads.py: its slots
allocated, its match locked) while a loader thread copies them in, and joins the running batch
once they are there. Other requests' steps go on meanwhile. A block that fails to load is
simply computed.

A decoding request may also speculate (radixserve/engine/speculative): its row then carries a
draft after its newest token, whose KV goes into slots taken from free pages only (a draft never
evicts or preempts); `settle` keeps what verification accepted and gives the rest back, before
anything is published, so the cache only ever holds verified tokens.

A request that asks for prompt log-probabilities needs the logits of every prompt position, and
a cached position has none: until it has them all it skips the cache match (computing its whole
prompt, reporting 0 cached tokens, not counted as a cache query), but publishes its KV as usual.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.cache.base import PrefixCache
from radixserve.config import DEDUP_MIN_TOKENS, EngineConfig
from radixserve.engine.kv_pool import OutOfSlots, PageAllocator
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.speculative.policy import Speculation
from radixserve.engine.tier_loads import KVTier, TierLoads
from radixserve.engine.window_kv import FullKV
from radixserve.outputs import FinishReason
from radixserve.sequences import common_prefix_len

# How many waiting requests, from the head of the queue, the short-prompt lane considers.
SHORT_LANE_SCAN = 32


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # computed this step, from request.num_computed on

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the newest token, so logits must be sampled."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass
class ScheduledDraft:
    """A speculating decode row: the request's newest token, then `draft`, to verify."""

    request: Request
    draft: list[int]


@dataclass
class SchedulerOutput:
    decodes: list[Request] = field(default_factory=list)  # one token each
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    verifies: list[ScheduledDraft] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return (len(self.decodes) + sum(c.num_tokens for c in self.prefills)
                + sum(1 + len(v.draft) for v in self.verifies))

    @property
    def num_requests(self) -> int:
        return len(self.decodes) + len(self.prefills) + len(self.verifies)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies


@dataclass
class SchedulerCounters:
    """Cumulative, in tokens; vLLM's counting rules for queries and hits."""

    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of those, tokens found in the cache (the pool or the tier)
    kv_tier_hits: int = 0  # of the hits, tokens loaded from the disk tier
    computed_prompt_tokens: int = 0  # prompt tokens actually run through the model
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: PageAllocator,
        cache: PrefixCache,
        clock: Callable[[], float] = time.monotonic,
        tier: KVTier | None = None,
        device_type: str = "cpu",
        speculation: Speculation | None = None,
        window_kv: FullKV | None = None,
    ) -> None:
        self.config = config
        self.speculation = speculation
        # The sliding-window layers' own slot space, where they have one (window_kv.py).
        self.window_kv = window_kv or FullKV(allocator.release)
        self.dedup_min_tokens = (config.dedup_min_tokens if config.dedup_min_tokens is not None
                                 else DEDUP_MIN_TOKENS[device_type])
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self.clock = clock
        self.tier = tier if cache.stores_slots else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose output still has tokens without K/V that a next turn will
        # read (a grammar's forced tail, or the output a pin reaches into): one chunk computes
        # them for the cache. Their clients already have the output (`_settles`).
        self.settling: list[Request] = []
        self.loading = TierLoads(self.tier, allocator)  # admitted, their tier blocks on the way
        self.counters = SchedulerCounters()

    # ----- queue management -----

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if self.tier is not None and not request.needs_prompt_logprobs:
            lookup = request.token_ids[: request.num_tokens - 1]
            self.tier.prefetch(request, self.cache.match_prefix(request.namespace, lookup).length)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.settling or self.loading.in_flight)

    @property
    def holders(self) -> list[Request]:
        """The requests that hold slots for their own rows: running and settling."""
        return self.running + self.settling

    def finish(self, request: Request, reason: FinishReason, keep_kv: bool = True) -> None:
        """Ends a request wherever it is; releases every slot and lock it holds, once.

        `keep_kv=False` (the forward pass failed) leaves its KV out of the cache.
        """
        if request.finished:
            return
        if self.speculation is not None:
            self.speculation.finished(request)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            if keep_kv and self._settles(request, reason):
                self.settling.append(request)
                request.jump_pending = request.num_tokens - request.num_computed
            else:
                if keep_kv:
                    self.publish(request)
                    self._pin_to_end(request)
                self._release(request, publish=False)
        elif request.status is RequestStatus.LOADING:
            self.loading.abandon(request)  # its slots past the cache's wait for the loader
            self._release(request, publish=False)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _settles(self, request: Request, reason: FinishReason) -> bool:
        """Whether a finished request computes its output's last tokens before it lets go:
        tokens a grammar forced at its end (a call's `"}}</tool_call>`: an agent's next turn
        replays them, and unforced they would have been computed as decoded), or a pin reaches
        past its K/V into the output (a stored Responses turn), so a continuation is expected
        to read all of it."""
        return (reason in ("stop", "length") and self.cache.stores_slots
                and request.num_computed < request.num_tokens
                and (request.jump_pending > 0
                     or any(offset > request.num_computed for offset, _ in request.pins)))

    def _settle(self, request: Request, out: SchedulerOutput, budget: int) -> int:
        """Schedules a settling request's uncomputed tail (no logits); returns its tokens. It
        takes only free or evictable slots, never a running request's: without them it ends
        with what it has."""
        todo = request.num_tokens - request.num_computed
        pages = -(-(request.num_tokens - len(request.slots)) // self.page_size)
        chunk = 0
        if pages <= 0 or self._allocate_pages(pages, request):
            self.window_kv.slide(request)
            chunk = self.window_kv.reserve(request, min(todo, budget))
        if chunk:
            out.prefills.append(ScheduledChunk(request, chunk))
        else:
            self._settled(request)
        return chunk

    def _settled(self, request: Request) -> None:
        self.settling.remove(request)
        self._pin_to_end(request)
        self._release(request, publish=False)

    # ----- one step -----

    def schedule(self) -> SchedulerOutput:
        self._collect_loads()
        out = self._plan()
        if out.empty and self.loading.in_flight:
            # Nothing to compute until a load lands: wait for one (briefly, so the caller
            # still gets to its inbox) rather than spin.
            self.loading.wait(timeout=0.05)
            self._collect_loads()
            out = self._plan()
        return out

    def _plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # With short_prefill_tokens: decodes first, then short prefills running and admitted
        # (the short lane: at most half the budget, so long prompts keep moving), then long
        # prefills, then admission in the policy's order. Without: running order.
        short_lane = self.config.short_prefill_tokens > 0
        short_prefills: list[Request | None] = []
        long_prefills: list[Request] = []
        for request in list(self.settling):  # a few tokens each, done in one step
            if budget > 0:
                budget -= self._settle(request, out, budget)
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.jump_pending and not self._grow(request, out, request.num_tokens):
                continue  # (slots for the tokens a grammar forced: their extend chunk)
            if short_lane and request.is_prefilling:
                (long_prefills if self._is_long_prefill(request) else short_prefills).append(
                    request)
                continue
            if not request.is_prefilling and not self._grow(request, out):
                continue  # the request itself was preempted
            budget -= self._schedule_tokens(request, out, budget)
        admits = not out.preempted  # admitting while preempting would thrash
        # Ranked once a step (under lpm, one cache match per waiting request), for both passes.
        order = self._admission_order() if admits and self.waiting else []
        if short_lane:
            lane = min(budget, self.config.max_num_batched_tokens // 2)
            left = lane
            # The lane takes only what it can finish this step: a chunk cut at the lane's
            # edge could not go on in the same step, though budget were left after it.
            for i, request in enumerate(short_prefills):
                if (request is not None and request.status is RequestStatus.RUNNING
                        and request.num_tokens - request.num_computed <= left):
                    left -= self._schedule_tokens(request, out, left)
                    short_prefills[i] = None  # its turn is taken
            if admits and self.waiting:
                left = self._admit(out, left, order, short_only=True)
            budget -= lane - left
            # What the long prompts leave goes to short ones the lane had no room for.
            for request in [*long_prefills, *short_prefills]:
                if budget <= 0:
                    break
                if request is not None and request.status is RequestStatus.RUNNING:
                    budget -= self._schedule_tokens(request, out, budget)
        if admits:
            self._admit(out, budget, order)
        return out

    def _is_long_prefill(self, request: Request) -> bool:
        return request.num_tokens - request.num_computed > self.config.short_prefill_tokens

    def _schedule_tokens(self, request: Request, out: SchedulerOutput, budget: int) -> int:
        """Adds the request's next tokens to the step (one decode token, or a prefill chunk
        within `budget` and the sliding-window layers' room); returns how many."""
        todo = request.num_tokens - request.num_computed
        # The prompt's last token of a request that only scores its prompt (max_tokens 0) is
        # a prefill chunk, so that nothing is sampled for it.
        decode = todo == 1 and bool(request.params.max_tokens or request.output_token_ids)
        if decode:
            draft = self._draft(request, budget - 1)
            if draft:
                # The window group's room for the row and its draft, without preempting
                # anyone for a guess: the draft shrinks to what is there.
                self.window_kv.slide(request)
                room = self.window_kv.reserve(request, 1 + len(draft))
                draft = draft[: max(room - 1, 0)]
            if draft:
                out.verifies.append(ScheduledDraft(request, draft))
                return 1 + len(draft)
        chunk = self._window_room(request, min(todo, budget), out)
        if not chunk:
            return 0
        if decode:
            out.decodes.append(request)
        else:
            out.prefills.append(ScheduledChunk(request, chunk))
        return chunk

    def _draft(self, request: Request, budget: int) -> list[int]:
        """The request's draft for this step, cut to the slots free pages can give it."""
        if self.speculation is None or budget <= 0:
            return []
        draft = self.speculation.draft(request, budget, len(self.running))
        short = request.num_computed + 1 + len(draft) - len(request.slots)
        if draft and short > 0:
            pages = min(-(-short // self.page_size), self.allocator.free_slots // self.page_size)
            request.slots.extend(self.allocator.allocate(pages))
            draft = draft[: len(request.slots) - request.num_computed - 1]
        return draft

    def settle(self, request: Request) -> None:
        """After a verified row's accepted tokens were appended: every token but the newest has
        its KV, and the slots past the page that holds them (a rejected draft's) go back."""
        request.num_computed = request.num_tokens - 1
        keep = max(request.cache_len, -(-request.num_computed // self.page_size) * self.page_size)
        self.window_kv.truncate(request, keep)  # the window group's pages past it go first
        dropped = request.truncate_slots(keep)
        if dropped:
            self.allocator.release(dropped)

    def _window_room(self, request: Request, count: int, out: SchedulerOutput) -> int:
        """Holds the sliding-window layers' KV for up to `count` next tokens of the request,
        after giving back what left its window (the window group gives up cached resume
        windows first), else preempts newer requests. Returns how many tokens it holds room for (0: none, the request itself may
        have been preempted)."""
        self.window_kv.slide(request)
        while True:
            room = self.window_kv.reserve(request, count)
            if room:
                return room
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return 0

    def _grow(self, request: Request, out: SchedulerOutput, upto: int | None = None) -> bool:
        """Gives `request` slots up to position `upto` (default: its next token's), preempting
        newer requests if needed."""
        need = request.num_computed + 1 if upto is None else upto
        while len(request.slots) < need:
            if self._allocate_pages(1, request):
                continue
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _allocate_pages(self, num_pages: int, request: Request, idle: bool = False) -> bool:
        short = num_pages * self.page_size - self.allocator.free_slots
        if short > 0:
            short -= self.cache.evict(short)
            if short > 0 and idle:
                # Nothing runs that could free slots: the pins that hold them end early,
                # rather than the request waiting out their TTL.
                self.cache.yield_pins(short)
                self.cache.evict(short)
        try:
            request.slots.extend(self.allocator.allocate(num_pages))
        except OutOfSlots:
            return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request, publish=True)
        request.status = RequestStatus.WAITING
        self.counters.preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        if request in out.decodes:
            out.decodes.remove(request)
        out.verifies = [v for v in out.verifies if v.request is not request]
        out.prefills = [c for c in out.prefills if c.request is not request]

    def advance(self, plan: SchedulerOutput) -> None:
        """Records that the plan's tokens were computed. Prefill chunks publish their KV into
        the cache at once, so concurrent requests hit it instead of computing it again."""
        for chunk in plan.prefills:
            request = chunk.request
            request.num_computed += chunk.num_tokens
            jumped = min(chunk.num_tokens, request.jump_pending)
            request.jump_pending -= jumped
            if request.counted:
                self.counters.computed_prompt_tokens += chunk.num_tokens - jumped
            self.publish(request)
            if request.finished and request.num_computed == request.num_tokens:
                self._settled(request)
        for request in plan.decodes:
            request.num_computed += 1

    def fail(self, plan: SchedulerOutput) -> list[Request]:
        """Ends every request of a step whose forward pass failed: its KV is undefined, so
        none of it is published. Returns those requests."""
        failed = (list(plan.decodes) + [c.request for c in plan.prefills]
                  + [v.request for v in plan.verifies])
        for request in failed:
            if request in self.settling:  # finished already: what it published stays
                self._settled(request)
            else:
                self.finish(request, "error", keep_kv=False)
        return [r for r in failed if r.finish_reason == "error"]

    # ----- admission -----

    def _admit(self, out: SchedulerOutput, budget: int, order: list[Request],
               short_only: bool = False) -> int:
        """Admits waiting requests of `order` (the policy's) while `budget` lasts (with
        `short_only`, only those whose uncached prompt is short); returns what is left."""
        if short_only:  # each candidate costs a cache match: only the queue's head is looked at
            order = order[:SHORT_LANE_SCAN]
        for request in order:
            if budget <= 0 or len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                break
            if request.status is not RequestStatus.WAITING:  # admitted by the short lane
                continue
            # (see _plan) the lane takes a short prompt whole, and a smaller one may still fit
            if short_only and not self._uncached(request) <= min(
                    budget, self.config.short_prefill_tokens):
                continue
            if self._waits_for_shared_prefill(request):
                continue
            if not self.window_kv.admits():
                break  # the running requests' windows fill the window group: they go first
            admitted = self._try_admit(request)
            if admitted is None:
                break  # out of memory: later requests would not fit either
            if request.status is RequestStatus.RUNNING:
                budget -= self._schedule_tokens(request, out, budget)
        return budget

    def _uncached(self, request: Request) -> int:
        """The waiting request's prompt tokens the pool does not hold (an upper bound)."""
        if request.num_tokens <= self.config.short_prefill_tokens or request.needs_prompt_logprobs:
            return request.num_tokens
        hit = self.cache.match_prefix(request.namespace,
                                      request.token_ids[: request.num_tokens - 1]).length
        return request.num_tokens - hit

    def _admission_order(self) -> list[Request]:
        if self.config.schedule_policy == "fcfs" or len(self.waiting) <= 1:
            return list(self.waiting)
        # lpm: longest cached prefix first, but a request that has waited past the limit goes
        # first in arrival order, so cache-cold requests are never starved. Only the head of
        # the queue is scanned, which bounds the matching cost with long queues.
        now = self.clock()
        scan = list(self.waiting)[: self.config.lpm_scan_limit]
        aged = [r for r in scan if now - r.arrival_time >= self.config.lpm_max_wait_s]
        fresh = [r for r in scan if now - r.arrival_time < self.config.lpm_max_wait_s]
        limit = [0 if r.needs_prompt_logprobs else r.num_tokens - 1 for r in fresh]
        hits = [
            self.cache.match_prefix(r.namespace, r.token_ids[:n]).length
            for r, n in zip(fresh, limit, strict=True)
        ]
        fresh = [r for _, r in sorted(zip(hits, fresh, strict=True), key=lambda p: -p[0])]
        return aged + fresh + list(self.waiting)[self.config.lpm_scan_limit :]

    def _waits_for_shared_prefill(self, request: Request) -> bool:
        """True if a running prefill is computing a long prefix this request shares.

        Admitting it now would compute that prefix a second time; once the other request
        publishes its chunks, this one hits them instead.
        """
        if not self.cache.stores_slots or request.needs_prompt_logprobs:
            return False
        need = self.dedup_min_tokens
        tokens = request.token_ids
        for other in [*self.running, *self.loading]:
            if other.namespace != request.namespace or not other.is_prefilling:
                continue
            shared = common_prefix_len(tokens, other.token_ids)
            if shared - other.num_computed >= need:
                return True
        return False

    def _try_admit(self, request: Request) -> Request | None:
        # Check, lock, re-check, allocate: locking the match takes it out of what eviction
        # could free, so the budget is computed after the lock. Prompt logprobs need every
        # position computed: such a request matches nothing (the empty prefix).
        reads_cache = not request.needs_prompt_logprobs
        lookup = request.num_tokens - 1 if reads_cache else 0
        match = self.cache.match_prefix(request.namespace, request.token_ids[:lookup])
        resumable = self.window_kv.resumable(match.slots, match.length)
        if resumable < match.length:  # the window KV before the match's end was freed
            match = self.cache.match_prefix(request.namespace, request.token_ids[:resumable])
        self.cache.lock(match.handle)
        need_tokens = request.num_tokens - match.length
        need_pages = -(-need_tokens // self.page_size)
        # Headroom of one page per running request keeps the next decode step from
        # preempting what was just admitted.
        headroom = (len(self.running) + len(self.loading)) * self.page_size
        available = self.allocator.free_slots + self.cache.stats().evictable_tokens
        if need_pages * self.page_size + headroom > available and self.running:
            self.cache.unlock(match.handle)
            return None
        request.slots = list(match.slots)
        request.cache_len = match.length
        request.cache_handle = match.handle
        request.num_computed = match.length
        self.window_kv.adopt(request)
        if not self._allocate_pages(need_pages, request,
                                    idle=not self.running and not len(self.loading)):
            self._release(request, publish=False)
            return None
        self.waiting.remove(request)
        if request.num_cached_tokens is None:  # once per request, as the hit counters count
            self.cache.record_use(match.handle)
        self._apply_pins(request)
        if reads_cache and self.loading.start(request):
            request.status = RequestStatus.LOADING
            return request
        self._start(request, reads_cache, loaded=0)
        return request

    def _start(self, request: Request, reads_cache: bool, loaded: int) -> None:
        """Moves an admitted request into the running batch; counts its cache hit once."""
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed
            request.metrics.first_scheduled_time = self.clock()
            if reads_cache and request.counted:
                self.counters.prefix_cache_queries += len(request.prompt_token_ids)
                self.counters.prefix_cache_hits += request.num_computed
                self.counters.kv_tier_hits += loaded

    def _collect_loads(self) -> None:
        """Starts the requests whose loads landed; frees the slots of abandoned ones."""
        for request, result in self.loading.landed():
            if result is not None and result.loaded_tokens:
                request.num_computed = result.end
                self.publish(request)
                if result.pinned_end and result.pinned_until > self.clock():
                    # A pin that outlived a restart: the pool keeps it for the time it has left.
                    end = min(result.pinned_end, request.cache_len)
                    match = self.cache.match_prefix(request.namespace, request.token_ids[:end])
                    self.cache.pin(match.handle, result.pinned_until)
            self._start(request, reads_cache=True,
                        loaded=result.loaded_tokens if result is not None else 0)
        self.loading.release_abandoned()

    # ----- cache bookkeeping -----

    def publish(self, request: Request) -> None:
        """Puts the request's computed, page-aligned KV into the prefix cache.

        Called after each prefill chunk (so concurrent requests can hit it at once) and at
        finish. Where the cache already held a run, our copy is a duplicate: freed, and the
        slot table re-pointed at the cache's.
        """
        if not self.cache.stores_slots:
            return
        aligned = request.num_computed // self.page_size * self.page_size
        if aligned <= request.cache_len:
            return
        result = self.cache.insert(
            request.namespace, request.token_ids[:aligned], request.slots[:aligned]
        )
        duplicates: list[int] = []
        for i in range(request.cache_len, aligned):
            if request.slots[i] != result.slots[i]:
                duplicates.append(request.slots[i])
                self.window_kv.repoint(request, i, request.slots[i], result.slots[i])
                request.repoint_slot(i, result.slots[i])
        if duplicates:
            self.allocator.release(duplicates)
        self.cache.lock(result.handle)
        if request.cache_handle is not None:
            self.cache.unlock(request.cache_handle)
        request.cache_handle = result.handle
        request.cache_len = aligned
        self.window_kv.keep(request, aligned)
        if self.tier is not None:
            self.tier.write_through(request, aligned)
        self._apply_pins(request)

    def _apply_pins(self, request: Request) -> None:
        """Pins each breakpoint's prefix once the cache holds it (a read refreshes the pin)."""
        if not request.pins or not self.cache.stores_slots:
            return
        waiting = []
        for offset, ttl in request.pins:
            aligned = offset // self.page_size * self.page_size
            if aligned > request.cache_len:
                waiting.append((offset, ttl))
            elif aligned > 0:
                match = self.cache.match_prefix(request.namespace, request.token_ids[:aligned])
                self.cache.pin(match.handle, request.arrival_time + ttl)
                if self.tier is not None:
                    self.tier.pin(request, aligned, request.arrival_time + ttl)
        request.pins = waiting

    def _pin_to_end(self, request: Request) -> None:
        """Pins that reach past what the finished request cached end where its KV does: a
        Responses API turn pins its whole sequence before knowing the output's length, and the
        last sampled token has no KV."""
        request.pins = [(min(offset, request.cache_len), ttl) for offset, ttl in request.pins]
        self._apply_pins(request)

    def _release(self, request: Request, publish: bool) -> None:
        if publish:
            self.publish(request)
        self.window_kv.release(request)
        if request.cache_handle is not None:
            self.cache.unlock(request.cache_handle)
        private = request.slots[request.cache_len :]
        if private:
            self.allocator.release(private)
        request.slots = []
        request.cache_len = 0
        request.cache_handle = None
        request.num_computed = 0
        request.jump_pending = 0  # a resumed request recomputes its output as a prefill

    def private_slots(self) -> int:
        """Slots held by requests outside the cache: running, settling, loading, or abandoned
        mid-load."""
        return (sum(r.num_private_slots for r in self.holders)
                + sum(r.num_private_slots for r in self.loading)
                + self.loading.abandoned_slots())
