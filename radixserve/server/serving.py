"""Between the routes and the engine: admission (429 when the queue is full, 503 while shutting
down), per-request streams that abort their engine work when the client leaves, the drain on
shutdown, and the per-request metrics (TTFT, inter-token latency, E2E, finish reasons).

Every generating route (OpenAI's, Anthropic's) submits through `EngineService.generate`, from
`exchange.handle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from radixserve.engine.async_engine import EngineDeadError
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.admission import (
    Admission,
    AdmissionCollector,
    AdmissionLimits,
    Overloaded,
    Ticket,
    retry_headers,
)
from radixserve.server.auth import CacheNamespace
from radixserve.server.errors import APIError, bad_request
from radixserve.server.front import EngineFront
from radixserve.server.observability.metrics import FrozenHeapCollector, ServerMetrics
from radixserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)


def shutting_down_error(retry_after_s: float) -> APIError:
    return APIError(503, "The server is shutting down; retry on another instance.",
                    code="shutting_down", headers=retry_headers(retry_after_s))


class UsageObserver(Protocol):
    """What the service tells a job's prompt-cache accounting (`accounting.JobAccount`): every
    output (which it may restate with its own usage figures), then the job's end, once."""

    def observe(self, output: RequestOutput) -> RequestOutput: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Job:
    """One prompt to generate from; an HTTP request may carry several (completions)."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: CacheNamespace = None
    # TTL pins: (token offset, TTL seconds), pinned by the engine; past the prompt, into the
    # output (`LLMEngine.add_request`).
    pins: tuple[tuple[int, float], ...] = ()
    # The route's own accounting; None: the service's `default_usage`, if any.
    usage: UsageObserver | None = None
    # What the server changed in the prompt before the engine saw it (a per-request preamble
    # taken out, a context edit), for the dashboard's misses.
    notes: tuple[str, ...] = ()
    # Which of the front's engines holds the prompt's prefix (`EngineFront.generate`).
    affinity: str | None = None


@dataclass(frozen=True)
class JobEnd:
    """A job as it ended, for the cache statistics (`EngineService.on_job_end`)."""

    request_id: str
    job: Job
    cached_tokens: int | None  # the engine's own figure; None: the job never produced output
    ttft_s: float | None  # None: no token was generated
    usage: UsageObserver | None  # the job's accounting, closed (billed) by now


# (job index, its next output | the error that ended it | None: its pump finished)
_Item = tuple[int, RequestOutput | BaseException | None]


class Lifecycle:
    """Draining state. `begin_shutdown` may be called from a signal handler."""

    def __init__(self) -> None:
        self.draining = False
        self.stalled = False  # an engine step is past the watchdog's stall limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: set[asyncio.Queue[_Item]] = set()
        self._drain: asyncio.Task[None] | None = None

    def attach(self) -> None:
        """Remembers the serving loop; called from it."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    @property
    def in_flight(self) -> int:
        """Requests generating now (each HTTP request counts once)."""
        return len(self._streams)

    def begin_shutdown(self, grace_s: float, on_drained: Callable[[], None] | None = None
                       ) -> None:
        """Refuses new requests now; aborts the ones still running after `grace_s`. Then
        `on_drained` (from the loop): once nothing is in flight, or shortly after the aborts."""
        self.draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._start_drain, grace_s, on_drained)
        elif on_drained is not None:
            on_drained()

    def _start_drain(self, grace_s: float, on_drained: Callable[[], None] | None) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drained(grace_s, on_drained))

    async def _drained(self, grace_s: float, on_drained: Callable[[], None] | None) -> None:
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            self._abort_all()
            # The aborted streams send their error events and close.
            settle = time.monotonic() + 5.0
            while self._streams and time.monotonic() < settle:
                await asyncio.sleep(0.05)
        if on_drained is not None:
            on_drained()

    def _abort_all(self) -> None:
        if self._streams:
            logger.warning("shutdown: aborting %d in-flight requests", len(self._streams))
        for stream in list(self._streams):
            stream.put_nowait((-1, ShuttingDown()))

    def register(self, stream: asyncio.Queue[_Item]) -> None:
        self._streams.add(stream)

    def unregister(self, stream: asyncio.Queue[_Item]) -> None:
        self._streams.discard(stream)


async def _next(stream: asyncio.Queue[_Item], deadline: float | None,
                timeout_s: float | None) -> _Item:
    """The stream's next item; 504 once `deadline` (monotonic) has passed."""
    if deadline is None:
        return await stream.get()
    try:
        return await asyncio.wait_for(stream.get(), max(deadline - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        raise deadline_error(timeout_s or 0.0) from None


def deadline_error(timeout_s: float) -> APIError:
    # Not retried by the SDKs: the client's own deadline has passed.
    return APIError(504, f"The request did not finish within its timeout ({timeout_s:g} s); it "
                         "was aborted.", code="request_timeout",
                    headers={"x-should-retry": "false"})


class ShuttingDown(Exception):
    """The drain period ended before this request did."""


class _JobTracker:
    """One job's progress as the metrics see it (per sample for n > 1)."""

    def __init__(self, metrics: ServerMetrics, job: Job, received_at: float) -> None:
        self.metrics = metrics
        self.job = job
        self.received_at = received_at
        n = job.params.n
        self.started = False
        self.ttft_s: float | None = None
        self.cached_tokens: int | None = None
        self.tokens = [0] * n
        self.last_token_at = [0.0] * n
        self.finished: list[str | None] = [None] * n

    def observe(self, output: RequestOutput, now: float) -> None:
        m = self.metrics
        self.cached_tokens = output.num_cached_tokens
        for sample in output.outputs:
            i = sample.index
            new = len(sample.token_ids) - self.tokens[i]
            if new > 0:
                if not self.started:
                    self.started = True
                    self.ttft_s = now - self.received_at
                    m.time_to_first_token.observe(self.ttft_s)
                    m.prompt_tokens.inc(len(self.job.prompt_ids) * self.job.params.n)
                elif self.tokens[i] > 0:
                    m.inter_token_latency.observe(now - self.last_token_at[i])
                self.tokens[i] += new
                self.last_token_at[i] = now
                m.generation_tokens.inc(new)
            if sample.finish_reason is not None and self.finished[i] is None:
                self.finished[i] = sample.finish_reason
                m.request_finished(sample.finish_reason)
        completed = output.finished and all(r in ("stop", "length") for r in self.finished)
        if completed and not self.started:
            # max_tokens 0 (scoring a prompt): the prompt was computed, nothing generated.
            self.started = True
            m.prompt_tokens.inc(len(self.job.prompt_ids) * self.job.params.n)
        if completed:
            m.e2e_request_latency.observe(now - self.received_at)

    def close(self) -> None:
        """Counts samples left unfinished (client gone, shutdown, error) as aborted."""
        for i, reason in enumerate(self.finished):
            if reason is None:
                self.finished[i] = "abort"
                self.metrics.request_finished("abort")


class EngineService:
    """Submits jobs to the engine on behalf of the routes."""

    def __init__(
        self, aengine: EngineFront, settings: ServerSettings, metrics: ServerMetrics,
        lifecycle: Lifecycle,
    ) -> None:
        self.aengine = aengine
        self.settings = settings
        self.metrics = metrics
        self.lifecycle = lifecycle
        # Accepted requests without a first token yet: the waiting queue as clients feel it.
        self.admission = Admission(AdmissionLimits.of(settings))
        metrics.registry.register(AdmissionCollector(self.admission, settings.model_name))
        metrics.registry.register(FrozenHeapCollector())
        self.last_output_at = 0.0  # monotonic time of the latest output to any client
        # Accounting for jobs that bring none (the OpenAI routes); set by the app.
        self.default_usage: Callable[[Job], UsageObserver] | None = None
        self.on_job_end: Callable[[JobEnd], None] | None = None  # set by the app: stats
        self._cleanups: set[asyncio.Task[None]] = set()

    def check_open(self) -> None:
        """Raises 503 while draining or when the engine has stopped."""
        if self.lifecycle.draining:
            self.metrics.request_rejected("shutting_down")
            raise shutting_down_error(self.settings.retry_after_s)
        if not self.aengine.alive:
            raise APIError(503, "The engine has stopped; this server cannot generate.",
                           code="engine_stopped")

    def enter(self, key: str, body_bytes: int, overloaded_status: int = 429) -> Ticket:
        """The request's place in the queue (`admission`), judged on its body's length; raises
        Overloaded (429, or `overloaded_status`) past a bound, 503 while draining."""
        self.check_open()
        try:
            return self.admission.enter(key, body_bytes, overloaded_status)
        except Overloaded:
            self.metrics.request_rejected("queue_full")
            raise

    async def generate(
        self, jobs: list[Job], request_id: str, received_at: float, replayable: bool = False,
        ticket: Ticket | None = None, timeout_s: float | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Streams (job index, cumulative output) until every job finishes.

        `ticket` (from `enter`) leaves the queue as the jobs start. `timeout_s`: the request's
        deadline from `received_at`, after which its jobs are aborted (504). `replayable`: the caller keeps only each job's final output (a
        front over replicas may then rerun a job whose replica died, see `EngineFront`). Closing the iterator early (client gone) aborts every job; engine
        errors surface as APIError (400 for a prompt the engine refuses, 503 if it stopped).
        """
        self.lifecycle.attach()
        stream: asyncio.Queue[_Item] = asyncio.Queue()
        trackers = [_JobTracker(self.metrics, job, received_at) for job in jobs]
        usage = [job.usage or (self.default_usage(job) if self.default_usage else None)
                 for job in jobs]
        ids = [request_id if len(jobs) == 1 else f"{request_id}-p{i}" for i in range(len(jobs))]
        pumps = [asyncio.create_task(self._pump(i, job, rid, stream, replayable))
                 for i, (job, rid) in enumerate(zip(jobs, ids, strict=True))]
        self.lifecycle.register(stream)
        queued = [True] * len(jobs)
        remaining = len(jobs)
        deadline = None if timeout_s is None else received_at + timeout_s
        try:
            while remaining:
                index, item = await _next(stream, deadline, timeout_s)
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise self._translate(item) from item
                else:
                    # Before the accounting, which may restate cached tokens as a vendor would.
                    trackers[index].observe(item, time.monotonic())
                    accounting = usage[index]
                    if accounting is not None:
                        item = accounting.observe(item)
                    if queued[index] and trackers[index].started:
                        queued[index] = False
                        if ticket is not None:
                            self.admission.job_started(ticket, len(jobs[index].prompt_ids),
                                                       item.num_cached_tokens or 0)
                    self.last_output_at = time.monotonic()
                    yield index, item
        finally:
            for pump in pumps:
                pump.cancel()
            self.lifecycle.unregister(stream)
            if ticket is not None:
                self.admission.leave(ticket)
            for tracker in trackers:
                tracker.close()
            for job_usage in usage:
                if job_usage is not None:
                    job_usage.close()
            if self.on_job_end is not None:
                for rid, tracker, job_usage in zip(ids, trackers, usage, strict=True):
                    self.on_job_end(JobEnd(rid, tracker.job, tracker.cached_tokens,
                                           tracker.ttft_s, job_usage))

    async def _pump(self, index: int, job: Job, request_id: str, stream: asyncio.Queue[_Item],
                    replayable: bool) -> None:
        options = {"pins": list(job.pins)} if job.pins else {}
        outputs = self.aengine.generate(job.prompt_ids, job.params, request_id,
                                        namespace=job.namespace, replayable=replayable,
                                        affinity=job.affinity, **options)
        first = asyncio.ensure_future(anext(outputs))
        finished = False
        try:
            # Shielded: AsyncEngine sets the result of its add future on the engine thread
            # without checking for cancellation, and that error kills the engine loop; so the
            # add is never cancelled midway (see `_abandon`).
            output = await asyncio.shield(first)
            while True:
                finished = output.finished
                stream.put_nowait((index, output))
                if finished:
                    break
                output = await anext(outputs)
            stream.put_nowait((index, None))
        except asyncio.CancelledError:
            if not first.done():
                cleanup = asyncio.create_task(self._abandon(first, outputs))
                self._cleanups.add(cleanup)
                cleanup.add_done_callback(self._cleanups.discard)
            raise
        except Exception as exc:  # handed to the consumer, which owns the HTTP response
            finished = True
            stream.put_nowait((index, exc))
        finally:
            if not finished:
                # The client is gone. The abort is queued behind the add, so it applies after.
                self.aengine.abort(request_id)

    async def _abandon(self, first: asyncio.Future[RequestOutput],
                       outputs: AsyncGenerator[RequestOutput, None]) -> None:
        """Ends a stream whose add was still queued when its client left."""
        # The engine thread runs its inbox in order: once this no-op has run, so have the
        # add and the abort queued before it, and cancelling can no longer hit the add.
        with contextlib.suppress(EngineDeadError):
            await self.aengine.flush()
        first.cancel()
        await asyncio.wait([first])
        if not first.cancelled():
            first.exception()  # mark it retrieved: the client it was for is gone
        await outputs.aclose()

    async def settle(self, timeout_s: float = 10.0) -> None:
        """Waits until the engine has applied every abort queued so far; called at shutdown,
        so that no output is dispatched to the event loop after it closes."""
        if self._cleanups:
            await asyncio.wait(list(self._cleanups), timeout=timeout_s)
        if self.aengine.alive:
            with contextlib.suppress(EngineDeadError, asyncio.TimeoutError):
                # The inbox runs in order: once this no-op has run, so have the aborts.
                await asyncio.wait_for(asyncio.shield(self.aengine.flush()), timeout_s)

    def _translate(self, exc: BaseException) -> APIError:
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ShuttingDown):
            return shutting_down_error(self.settings.retry_after_s)
        if isinstance(exc, ValueError):  # the engine refused the prompt or its parameters
            return bad_request(str(exc))
        if isinstance(exc, EngineDeadError):
            return APIError(503, "The engine has stopped; this server cannot generate.",
                            code="engine_stopped")
        logger.error("engine request failed", exc_info=exc)
        return APIError(500, "The engine failed while generating; it has been logged.",
                        type="server_error")
