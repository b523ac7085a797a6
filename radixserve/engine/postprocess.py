"""Every state change a step makes, in one place: computed tokens and cache publishing (the
scheduler's books), prompt log-probabilities, sampled tokens, text and stop conditions,
finishes, first-token times; then the step's outputs, one per request group that progressed.
A verified draft gives its tokens one by one to the same stop checks, so stops, max_tokens,
logprobs and streaming see only accepted tokens; its rejected KV is given back before a
finish publishes anything. Tokens a grammar forces after a sampled one pass the same checks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixserve.engine.detokenizer import Detokenizer, Stop
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.runner import StepResult, VerifiedRow
from radixserve.engine.scheduler import Scheduler, SchedulerOutput
from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


class Postprocessor:
    def __init__(self, scheduler: Scheduler, detokenizer: Detokenizer,
                 clock: Callable[[], float], jump_forward: bool = True) -> None:
        self.scheduler = scheduler
        self.speculation = scheduler.speculation
        self.detokenizer = detokenizer
        self.clock = clock
        self.jump_forward = jump_forward

    def apply(self, plan: SchedulerOutput, result: StepResult) -> list[Request]:
        """Applies a step that ran; returns the requests that got a token, or that completed
        their prompt with max_tokens 0 (scoring it: they end without sampling)."""
        scored = [c.request for c in plan.prefills if c.completes_prompt
                  and c.request.params.max_tokens == 0 and not c.request.finished]
        self.scheduler.advance(plan)
        for request, entries in result.prompt_logprobs:
            assert request.prompt_logprobs is not None
            request.prompt_logprobs.extend(entries)
        now = self.clock()
        for request in scored:
            request.metrics.finished_time = now
            self.scheduler.finish(request, "length")
        samples = result.samples
        for request, token, logprob in zip(result.sampled, samples.token_ids, samples.logprobs,
                                           strict=True):
            stop = self._take(request, token, logprob, now)
            if stop is not None:
                self._finish(request, stop, now)
        for row in result.verified:
            self._verified(row, now)
        return result.sampled + [row.request for row in result.verified] + scored

    def _verified(self, row: VerifiedRow, now: float) -> None:
        request = row.request
        if self.speculation is not None:
            self.speculation.verified(request, len(row.draft), len(row.tokens) - 1)
        stop = None
        for token, logprob in zip(row.tokens, row.logprobs, strict=True):
            stop = self._append(request, token, logprob, now)
            if stop is not None:
                break
        self.scheduler.settle(request)  # before any forced tokens: they have no K/V
        if stop is None:
            stop = self._jump_forward(request, now)
        if stop is not None:
            self._finish(request, stop, now)

    def _take(self, request: Request, token: int, logprob: TokenLogprob | None,
              now: float) -> Stop | None:
        """Appends one sampled token, then the tokens its grammar forces after it (jump
        forward); returns why the request must stop, if it must."""
        stop = self._append(request, token, logprob, now)
        return stop if stop is not None else self._jump_forward(request, now)

    def _jump_forward(self, request: Request, now: float) -> Stop | None:
        """Takes the tokens the request's grammar forces after its newest token. They need no
        sampling: the next step computes them with that token as one chunk, instead of one
        decode step each. (Not with logprobs: a forced token has no sampled distribution.)"""
        if not self.jump_forward or request.matcher is None or request.params.logprobs is not None:
            return None
        stop, taken = None, 0
        for forced_token in request.matcher.forced_tokens():
            stop = self._append(request, forced_token, None, now)
            taken += 1
            if stop is not None:
                break
        if taken:
            request.jump_pending = 1 + taken  # (a finish computes them too: Scheduler)
        return stop

    def _append(self, request: Request, token: int, logprob: TokenLogprob | None,
                now: float) -> Stop | None:
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.append_output(token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        stop = self.detokenizer.update(request)
        if stop is None and request.matcher is not None and _grammar_done(request, token):
            stop = Stop("stop")
        return stop

    def _finish(self, request: Request, stop: Stop, now: float) -> None:
        request.stop_reason = stop.stop_reason
        request.metrics.finished_time = now
        self.scheduler.finish(request, stop.reason)


def _grammar_done(request: Request, token: int) -> bool:
    """Follows `token` in the request's grammar; True when the output is complete. A token the
    grammar refuses cannot be sampled (the mask removed it), short of a bug: the output then
    ends rather than run on unconstrained."""
    matcher = request.matcher
    assert matcher is not None
    if not matcher.accept(token):
        logger.error("request %s: sampled token %d outside its grammar (%s); ending it",
                     request.request_id, token, matcher.error)
        return True
    return matcher.finished


def make_output(group_id: str, group: list[Request]) -> RequestOutput:
    """The user-facing result of one request group (n samples of one prompt), so far."""
    first = group[0]
    # Samples finish their prompts at different steps; any complete copy will do.
    scored = next((r for r in group if r.prompt_logprobs is not None
                   and not r.needs_prompt_logprobs), first)
    completions = [
        CompletionOutput(
            index=r.sample_index,
            text=r.output_text,
            token_ids=list(r.output_token_ids),
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
            logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
        )
        for r in group
    ]
    return RequestOutput(
        request_id=group_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=all(r.status is RequestStatus.FINISHED for r in group),
        num_cached_tokens=first.num_cached_tokens or 0,
        metrics=first.metrics,
        prompt_logprobs=(list(scored.prompt_logprobs) if scored.prompt_logprobs is not None
                         else None),
    )
