"""The scheduler's policies on a real cache and allocator, without a model: each step's plan
is "computed" by advancing the requests as the engine would."""

from __future__ import annotations

import random

import pytest

from radixserve.cache import make_prefix_cache
from radixserve.config import EngineConfig
from radixserve.engine.kv_pool import PageAllocator
from radixserve.engine.request import Request
from radixserve.engine.scheduler import Scheduler
from radixserve.sampling_params import SamplingParams
from tests.support.scheduling import step


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(pool_tokens: int = 4096, device_type: str = "cpu",
               **settings) -> tuple[Scheduler, FakeClock]:
    config = EngineConfig(show_progress=False, **settings)
    clock = FakeClock()
    allocator = PageAllocator(pool_tokens // config.page_size, config.page_size)
    cache = make_prefix_cache(config.prefix_cache, config.page_size, allocator.release, clock=clock)
    return Scheduler(config, allocator, cache, clock, device_type=device_type), clock


def _request(rid: str, tokens: list[int], clock: FakeClock, max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, tokens, params, arrival_time=clock())


def _check_balance(scheduler: Scheduler) -> None:
    stats = scheduler.cache.stats()
    total = (scheduler.allocator.free_slots + stats.evictable_tokens + stats.protected_tokens
             + stats.pinned_tokens + scheduler.private_slots())
    assert total == scheduler.allocator.num_slots


def _drain(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        step(scheduler)
        _check_balance(scheduler)


def test_lpm_admits_longest_cached_prefix_first():
    scheduler, clock = _scheduler(schedule_policy="lpm", max_num_seqs=1)
    rng = random.Random(0)
    warm = [rng.randrange(100, 9000) for _ in range(200)]
    scheduler.add(_request("seed", warm + [1], clock))
    _drain(scheduler)
    cold = _request("cold", [rng.randrange(100, 9000) for _ in range(50)], clock)
    hot = _request("hot", warm + [2, 3], clock)
    scheduler.add(cold)
    scheduler.add(hot)
    assert step(scheduler)[0] is hot  # arrived later, but 200 cached tokens
    _drain(scheduler)


def test_lpm_ages_cold_requests_so_they_are_not_starved():
    scheduler, clock = _scheduler(schedule_policy="lpm", max_num_seqs=1, lpm_max_wait_s=2.0)
    rng = random.Random(1)
    warm = [rng.randrange(100, 9000) for _ in range(200)]
    scheduler.add(_request("seed", warm + [1], clock))
    _drain(scheduler)
    cold = _request("cold", [rng.randrange(100, 9000) for _ in range(50)], clock)
    scheduler.add(cold)
    clock.now += 2.5  # the cold request has now waited past the limit
    scheduler.add(_request("hot", warm + [2, 3], clock))
    assert step(scheduler)[0] is cold
    _drain(scheduler)


def test_fcfs_keeps_arrival_order():
    scheduler, clock = _scheduler(schedule_policy="fcfs", max_num_seqs=1)
    warm = list(range(300, 500))
    scheduler.add(_request("seed", warm + [1], clock))
    _drain(scheduler)
    first = _request("cold", list(range(600, 650)), clock)
    scheduler.add(first)
    scheduler.add(_request("hot", warm + [2], clock))
    assert step(scheduler)[0] is first
    _drain(scheduler)


def test_shared_uncached_prefix_is_computed_once():
    scheduler, clock = _scheduler(max_num_batched_tokens=4096)
    prefix = list(range(1000, 2000))
    requests = [_request(f"r{i}", prefix + [5000 + i] * 3, clock) for i in range(16)]
    for r in requests:
        scheduler.add(r)
    first = step(scheduler)
    assert first == [requests[0]]  # the others wait for its prefill...
    second = step(scheduler)
    assert set(second) == set(requests[1:])  # ...then hit it
    assert all(r.num_cached_tokens == 1000 for r in requests[1:])
    _drain(scheduler)


@pytest.mark.parametrize(("device_type", "settings", "waits"), [
    ("cpu", {}, True),  # a 12-token header is worth a step on a CPU
    ("cuda", {}, False),  # not on a GPU
    ("cpu", {"dedup_min_tokens": 13}, False),  # an explicit setting wins
    ("cuda", {"dedup_min_tokens": 12}, True),
])
def test_short_shared_header_waits_by_device(device_type: str, settings: dict,
                                             waits: bool) -> None:
    scheduler, clock = _scheduler(device_type=device_type, **settings)
    header = list(range(1000, 1012))
    requests = [_request(f"r{i}", header + list(range(2000 + 50 * i, 2040 + 50 * i)), clock)
                for i in range(8)]
    for r in requests:
        scheduler.add(r)
    first = step(scheduler)
    if waits:
        assert first == [requests[0]]
        assert set(step(scheduler)) == set(requests[1:])
        assert [r.num_cached_tokens for r in requests] == [0] + [12] * 7
    else:
        assert first == requests
        assert [r.num_cached_tokens for r in requests] == [0] * 8
    _drain(scheduler)
    _check_balance(scheduler)


def test_dedup_min_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="dedup_min_tokens"):
        EngineConfig(show_progress=False, dedup_min_tokens=0)


def test_preemption_releases_and_requeues_without_leaks():
    # Room for two growing requests, three admitted: decode growth must preempt one.
    scheduler, clock = _scheduler(pool_tokens=64, page_size=4, max_num_batched_tokens=64)
    requests = [_request(f"r{i}", list(range(100 * i, 100 * i + 10)), clock, max_tokens=12)
                for i in range(3)]
    for r in requests:
        scheduler.add(r)
    _drain(scheduler)
    assert all(r.finished and len(r.output_token_ids) == 12 for r in requests)
    assert scheduler.counters.preemptions > 0
    stats = scheduler.cache.stats()
    assert stats.protected_tokens == 0 and scheduler.private_slots() == 0
    assert scheduler.allocator.free_slots + stats.evictable_tokens == scheduler.allocator.num_slots


def _with_a_pin() -> tuple[Scheduler, FakeClock]:
    """A 256-token pool whose first 100 tokens, tokens 1000-1099, are pinned for 300 s."""
    scheduler, clock = _scheduler(pool_tokens=256, max_num_batched_tokens=512)
    pinned = _request("pinned", list(range(1000, 1100)), clock)
    pinned.pins = [(100, 300.0)]
    scheduler.add(pinned)
    _drain(scheduler)
    assert scheduler.cache.stats().pinned_tokens >= 100
    return scheduler, clock


def test_pins_protect_a_prefix_until_expiry():
    scheduler, clock = _with_a_pin()
    # Unrelated traffic that needs the whole rest of the pool evicts everything unpinned.
    for i in range(3):
        scheduler.add(_request(f"other{i}", list(range(5000 + 200 * i, 5000 + 200 * i + 140)), clock))
        _drain(scheduler)
    probe = scheduler.cache.match_prefix(None, list(range(1000, 1100)))
    assert probe.length == 100
    clock.now += 301  # past the TTL: the pin stops protecting
    assert scheduler.cache.stats().pinned_tokens == 0
    scheduler.add(_request("late", list(range(7000, 7200)), clock))  # needs the pinned pages
    _drain(scheduler)
    assert scheduler.cache.match_prefix(None, list(range(1000, 1100))).length < 100


def test_pins_give_way_to_a_request_nothing_else_can_make_room_for():
    scheduler, clock = _with_a_pin()
    # A 200-token prompt fits the pool, not the 156 tokens beside the pin; nothing runs that
    # could free more: it starts now, not once the pin's 300 s are over.
    big = _request("big", list(range(7000, 7200)), clock)
    running = _request("running", list(range(9000, 9010)), clock, max_tokens=3)
    scheduler.add(running)
    step(scheduler)
    scheduler.add(big)
    step(scheduler)  # something runs: the pin holds, and the prompt waits for it to finish
    assert big.num_computed == 0 and scheduler.cache.stats().pinned_tokens >= 100
    for _ in range(20):  # (the clock stands still: waiting out the pin would never end)
        step(scheduler)
    assert big.status.name == "FINISHED" and not scheduler.has_work()
    assert scheduler.cache.match_prefix(None, list(range(1000, 1100))).length < 100
    _check_balance(scheduler)


def _steps_until_first_token(scheduler: Scheduler, request: Request, limit: int = 100) -> int:
    for steps in range(1, limit + 1):
        step(scheduler)
        if request.output_token_ids:
            return steps
    raise AssertionError(f"{request.request_id} had no token after {limit} steps")


@pytest.mark.parametrize(("short_prefill_tokens", "most_steps"), [(256, 1), (0, None)])
def test_a_short_request_is_not_queued_behind_a_long_prefill(short_prefill_tokens: int,
                                                            most_steps: int | None) -> None:
    scheduler, clock = _scheduler(pool_tokens=16384, max_num_batched_tokens=512,
                                  short_prefill_tokens=short_prefill_tokens)
    long = _request("long", list(range(1000, 5000)), clock)
    scheduler.add(long)
    step(scheduler)  # the long prompt's first chunk: 3,488 tokens (7 steps) still to go
    short = _request("short", list(range(6000, 6030)), clock)
    scheduler.add(short)
    before = long.num_computed
    steps = _steps_until_first_token(scheduler, short)
    if most_steps is None:  # arrival order: after the whole long prompt
        assert steps >= 7
        assert long.output_token_ids
    else:
        assert steps <= most_steps
        assert long.num_computed - before >= 512 // 2  # the long prompt kept moving
    _drain(scheduler)
    _check_balance(scheduler)


def test_a_long_prefill_keeps_half_the_budget_under_a_stream_of_short_ones() -> None:
    scheduler, clock = _scheduler(pool_tokens=65536, max_num_batched_tokens=512,
                                  max_num_seqs=256)
    long = _request("long", list(range(1000, 5000)), clock, max_tokens=1)
    scheduler.add(long)
    shorts = steps = 0
    while not long.finished and steps < 100:
        for _ in range(3):  # 600 short tokens a step: more than the short lane's half
            scheduler.add(_request(f"s{shorts}", list(range(10000 + 200 * shorts,
                                                            10200 + 200 * shorts)), clock))
            shorts += 1
        step(scheduler)
        steps += 1
    assert long.finished
    assert steps <= -(-4000 // 256) + 1  # at least half of every step's 512 tokens


def test_a_cached_long_prompt_counts_as_short() -> None:
    """What the pool holds is not prefilled: a long prompt with a short uncached tail (a
    conversation's next turn) takes the short lane."""
    scheduler, clock = _scheduler(pool_tokens=16384, max_num_batched_tokens=512)
    history = list(range(20000, 21500))
    scheduler.add(_request("turn1", history + [1], clock))
    _drain(scheduler)
    long = _request("long", list(range(1000, 5000)), clock)
    scheduler.add(long)
    step(scheduler)
    turn2 = _request("turn2", history + list(range(30000, 30100)), clock)
    scheduler.add(turn2)
    assert _steps_until_first_token(scheduler, turn2) == 1
    assert turn2.num_cached_tokens == 1500
    _drain(scheduler)
    _check_balance(scheduler)


def test_short_prefill_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="short_prefill_tokens"):
        EngineConfig(short_prefill_tokens=-1, show_progress=False)


def test_short_prompts_alone_still_fill_the_step() -> None:
    """The short lane orders the work; it never leaves budget unused."""
    scheduler, clock = _scheduler(pool_tokens=16384, max_num_batched_tokens=2048)
    for i in range(16):
        scheduler.add(_request(f"r{i}", list(range(1000 + 300 * i, 1200 + 300 * i)), clock))
    totals = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        totals.append(sum(c.num_tokens for c in plan.prefills))
        scheduler.advance(plan)
        for request in [*plan.decodes, *[c.request for c in plan.prefills if c.completes_prompt]]:
            request.append_output(7)
            if len(request.output_token_ids) >= request.params.max_tokens:
                scheduler.finish(request, "length")
    assert totals[0] == 2048
    assert sum(totals) == 16 * 200
    assert len([t for t in totals if t]) == 2  # 3,200 prompt tokens in two steps
