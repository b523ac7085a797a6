"""Admission control's bounds without a server: per-key shares, the total bounds, the wait
bound on the measured drain rate, retry headers, and tickets that leave no residue."""

from __future__ import annotations

import pytest

from radixserve.server.admission import Admission, AdmissionLimits, DrainRate, Overloaded


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _refusal(admission: Admission, key: str, body_bytes: int = 400) -> Overloaded:
    with pytest.raises(Overloaded) as caught:
        admission.enter(key, body_bytes)
    return caught.value


def test_a_key_holds_at_most_its_share_and_others_still_get_in() -> None:
    admission = Admission(AdmissionLimits(max_queued_requests=4, max_queue_wait_s=0))
    flood = [admission.enter("a", 400) for _ in range(2)]
    refused = _refusal(admission, "a")
    assert refused.status == 429 and "API key's share" in refused.message
    others = [admission.enter("b", 400) for _ in range(2)]  # b still finds its half
    assert "requests waiting would be 5, over 4" in _refusal(admission, "c").message
    for ticket in flood + others:
        admission.leave(ticket)
    assert admission.total.requests == 0 and admission.total.tokens == 0


def test_requests_without_a_key_may_use_every_bound_whole() -> None:
    admission = Admission(AdmissionLimits(max_queued_requests=4, max_queue_wait_s=0))
    for _ in range(4):
        admission.enter("", 400)
    assert _refusal(admission, "").status == 429


def test_the_token_bound_counts_the_real_prompt_once_tokenized() -> None:
    admission = Admission(AdmissionLimits(max_queued_tokens=1000, max_queue_wait_s=0,
                                          key_share=1.0))
    ticket = admission.enter("a", 400)  # ~100 tokens by its length
    admission.measured(ticket, prompt_tokens=950, requests=1)
    assert admission.total.tokens == pytest.approx(950)
    assert "prompt tokens waiting" in _refusal(admission, "a").message
    admission.job_started(ticket, prompt_tokens=950, cached_tokens=0)
    assert admission.total.requests == 0
    admission.enter("a", 400)  # the queue has room again


def test_the_wait_bound_uses_the_drain_rate_and_expected_cache_hits() -> None:
    clock = Clock()
    admission = Admission(AdmissionLimits(max_queue_wait_s=2.0, key_share=1.0,
                                          prior_tokens_per_s=100.0), clock=clock)
    first = admission.enter("a", 800)  # 200 tokens: 2 s at 100 tokens/s; the first always fits
    refused = _refusal(admission, "a")
    assert "estimated queue wait would be 3.0 s, over 2.0 s" in refused.message
    # It fits once the queue has drained its own 200 tokens: 2 s at 100 tokens/s.
    assert refused.headers == {"retry-after": "2", "retry-after-ms": "2000"}
    # Every prompt so far came back 90% cached: queued prompts count a tenth as much.
    for _ in range(4):
        clock.now += 0.1
        admission.job_started(first, prompt_tokens=1000, cached_tokens=900)
    admission.leave(first)
    tickets = [admission.enter("a", 800) for _ in range(5)]  # 20 uncached tokens each
    assert admission.total.tokens == pytest.approx(100)
    for ticket in tickets:
        admission.leave(ticket)


def test_drain_rate_counts_busy_time_only() -> None:
    clock = Clock()
    rate = DrainRate(prior=50.0, clock=clock)
    rate.observe(1000)  # before any busy period: nothing to time it against
    assert rate.tokens_per_s == 50.0
    rate.busy()
    for _ in range(4):
        clock.now += 0.5
        rate.observe(100)
    rate.idle()
    clock.now += 100.0  # idle time does not dilute the rate
    rate.busy()
    clock.now += 0.5
    rate.observe(100)
    assert rate.tokens_per_s == pytest.approx(200.0)


def test_a_stalled_engine_lowers_the_drain_rate_while_it_stalls() -> None:
    clock = Clock()
    rate = DrainRate(prior=50.0, clock=clock)
    rate.busy()
    for _ in range(4):
        clock.now += 0.5
        rate.observe(100)
    assert rate.tokens_per_s == pytest.approx(200.0)
    clock.now += 8.0  # nothing started for 8 s with work waiting
    assert rate.tokens_per_s == pytest.approx(400 / 10.0)
    rate.observe(100)  # the stall ends: the long interval is one sample among the others
    assert rate.tokens_per_s == pytest.approx(500 / 10.0)


def test_anthropic_routes_refuse_with_529() -> None:
    admission = Admission(AdmissionLimits(max_queued_requests=1, max_queue_wait_s=0))
    admission.enter("a", 100)
    with pytest.raises(Overloaded) as caught:
        admission.enter("b", 100, status=529)
    assert caught.value.status == 529 and caught.value.type == "overloaded_error"
