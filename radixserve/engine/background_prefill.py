"""Prefills run only while the engine is idle, for KV that a later request will want (the next
turn of a conversation as the chat template will render it). They never delay a real request
by more than the step in progress: a request's arrival aborts the running one, keeping what it
computed; and what they cache is the first to be evicted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, replace

from radixserve.cache import RadixCache
from radixserve.engine.engine import LLMEngine
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ID_PREFIX = "background-prefill-"
# Waiting prefills kept; older ones are dropped (a newer turn's is worth more).
MAX_QUEUED = 16


@dataclass(frozen=True)
class PrefillJob:
    token_ids: tuple[int, ...]
    namespace: Hashable


@dataclass(frozen=True)
class _Running:
    request_id: str
    job: PrefillJob
    own_from: int  # where the job's own tokens start (real requests had cached the rest)


@dataclass
class BackgroundPrefillStats:
    """Cumulative: jobs started (resumptions too), finished, yielded to a real request, and
    the tokens finished jobs left in the cache (demoted); `pending`: jobs queued or running
    now (in snapshots)."""

    started: int = 0
    finished: int = 0
    yielded: int = 0
    tokens: int = 0
    pending: int = 0


class BackgroundPrefill:
    """Queue of idle-time prefills for one engine (radix cache only: it demotes what it
    cached). Every method runs on the engine thread."""

    def __init__(self, engine: LLMEngine) -> None:
        if not isinstance(engine.cache, RadixCache):
            raise ValueError("background prefill needs the radix prefix cache")
        self.engine = engine
        self.cache: RadixCache = engine.cache
        self.stats = BackgroundPrefillStats()
        # Jobs, each with where its own tokens start when it resumes after yielding.
        self._queue: deque[tuple[PrefillJob, int | None]] = deque(maxlen=MAX_QUEUED)
        self._running: _Running | None = None
        self._serial = 0

    def snapshot(self) -> BackgroundPrefillStats:
        return replace(self.stats, pending=len(self._queue) + (self._running is not None))

    def submit(self, job: PrefillJob) -> None:
        """Queues `job`; it runs the next time the engine has nothing else to do."""
        self._queue.append((job, None))

    def start_if_idle(self) -> bool:
        """Starts the next queued job when no request is in the engine; True if one started
        (the engine has work again)."""
        if self._running is not None or self.engine.has_unfinished_requests():
            return False
        while self._queue:
            job, own_from = self._queue.popleft()
            cached = self.cache.match_prefix((self.engine.config.model, job.namespace),
                                             job.token_ids).length
            if cached >= len(job.token_ids) - 1:  # nothing left to compute
                continue
            self._serial += 1
            request_id = f"{ID_PREFIX}{self._serial}"
            try:
                self.engine.add_request(list(job.token_ids), SamplingParams(max_tokens=0),
                                        request_id, job.namespace)
            except ValueError as exc:  # too long for this engine now: not worth an error
                logger.debug("background prefill skipped: %s", exc)
                continue
            self._running = _Running(request_id, job, cached if own_from is None else own_from)
            self.stats.started += 1
            return True
        return False

    def yield_now(self) -> None:
        """Called before a real request is added: the running job stops (its computed KV is
        cached, as for any aborted request), so the next step is the request's alone; it
        resumes from there at the next idle time."""
        if self._running is None:
            return
        running = self._running
        self.engine.abort_request(running.request_id)
        self.stats.yielded += 1
        self._end(finished=False)
        self._queue.appendleft((running.job, running.own_from))

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Notes the running job's end when this step finished it."""
        if self._running is None:
            return
        for output in outputs:
            if output.request_id == self._running.request_id and output.finished:
                self.stats.finished += 1
                self._end(finished=True)
                return

    def _end(self, finished: bool) -> None:
        assert self._running is not None
        running, self._running = self._running, None
        job = running.job
        demoted = self.cache.demote((self.engine.config.model, job.namespace), job.token_ids,
                                    keep=running.own_from)
        if finished:
            self.stats.tokens += demoted
