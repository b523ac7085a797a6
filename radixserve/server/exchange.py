"""One generation request's life, the same on every route that generates (OpenAI chat and
completions, Anthropic messages): admission, the engine's outputs, the client leaving (499),
errors, and the streaming loop, which holds back text that may turn out to be a stop string.

What differs between the APIs (parsing the body, the response body, the stream's events) is an
`Exchange`, made by the route's `prepare` function; `handle` runs it.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.server.auth import presented_key
from radixserve.server.context import ServerContext, context_of
from radixserve.server.errors import APIError, bad_request
from radixserve.server.serving import Job
from radixserve.server.transport import SSE_HEADERS, read_body, until_disconnected

# A request's own deadline in seconds (`request_timeout`), after which it is aborted (504).
TIMEOUT_HEADER = "x-request-timeout"

# (job index, the job's cumulative output so far), as `EngineService.generate` yields them.
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that a stop string starts with."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


@dataclass(frozen=True)
class Delta:
    """What one output adds to one sample's stream."""

    job: int  # the job's index in its request
    sample: CompletionOutput
    text: str  # the new text, less any held back as the possible start of a stop string
    text_offset: int  # where `text` starts in the sample's text
    token_start: int  # the new tokens are sample.token_ids[token_start:token_end]
    token_end: int
    finishing: bool  # the sample has ended, and this is the first delta to say so


@dataclass
class StreamCursor:
    """How much of one sample's text and tokens a stream has sent."""

    stops: list[str]
    chars: int = 0
    tokens: int = 0
    done: bool = False

    def advance(self, job: int, sample: CompletionOutput) -> Delta:
        """What `sample` adds since the last call. Text that may be the start of a stop string
        is held back until it is known not to be one: a stop is cut from the output, and
        streamed text cannot be taken back."""
        end = len(sample.text)
        if sample.finish_reason is None and self.stops:
            end -= partial_stop_len(sample.text, self.stops)
        offset = self.chars
        text = sample.text[offset:end] if end > offset else ""
        self.chars = max(offset, end)
        start, self.tokens = self.tokens, len(sample.token_ids)
        finishing = sample.finish_reason is not None and not self.done
        self.done = self.done or finishing
        return Delta(job, sample, text, offset, start, self.tokens, finishing)


def check_sample(sample: CompletionOutput) -> None:
    """A sample the forward pass failed on is a 500, whatever it holds so far."""
    if sample.finish_reason == "error":
        raise APIError(500, "The model failed while generating this response; it has been "
                            "logged. Retry the request.", type="server_error")


class Exchange(ABC):
    """One request's API-specific half: its jobs, its response body and its stream's events.
    `handle` calls `start` once, after admission; then either `response_body` (and
    `response_headers`) or the stream methods, in order: `stream_headers`, `opening_events`,
    `observe_output` per output and `delta_event` per sample of it, then `closing_events`, or
    `error_events` instead."""

    # The stream's headers and first events wait for the engine's first output (its usage is
    # known then; an error before it is an HTTP error, not an event).
    waits_for_first_output = False

    def __init__(self, response_id: str, stream: bool, num_jobs: int = 1) -> None:
        self.response_id = response_id  # the response's id; the engine's request id too
        self.stream = stream
        self.num_jobs = num_jobs

    @abstractmethod
    def start(self) -> list[Job]:
        """The jobs to generate, `num_jobs` of them; called once the request is admitted."""

    @abstractmethod
    def response_body(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed response, from each job's final output."""

    def response_headers(self) -> dict[str, str]:
        return {}

    def stream_headers(self) -> dict[str, str]:
        return {}

    @abstractmethod
    def opening_events(self) -> list[bytes]:
        """What a stream sends before the first delta."""

    def observe_output(self, job: int, output: RequestOutput) -> None:
        """Sees each cumulative output of a stream before its samples' deltas (for what a
        route sends once per job, such as an echoed prompt's logprobs)."""
        return None

    @abstractmethod
    def delta_event(self, delta: Delta) -> bytes | None:
        """The event for one sample's progress; None when it adds nothing to send."""

    @abstractmethod
    def closing_events(self, finals: list[RequestOutput]) -> list[bytes]:
        """What a stream sends once every job has finished."""

    @abstractmethod
    def error_events(self, error: APIError) -> list[bytes]:
        """What a stream sends, and ends with, when generation fails after it started."""


Prepare = Callable[[ServerContext, Request, bytes], Awaitable[Exchange]]


async def handle(request: Request, prepare: Prepare, overloaded_status: int = 429) -> Response:
    """Serves one generation request. `prepare` parses and validates the raw body (raising
    APIError) and returns the request's `Exchange`; nothing reaches the engine before it has,
    and nothing is tokenized before admission (`overloaded_status`, 429 or Anthropic's 529,
    when the queue is past a bound; 503 while draining)."""
    received = time.monotonic()
    ctx = context_of(request)
    ctx.service.check_open()
    raw = await read_body(request, ctx.settings.max_request_bytes)
    timeout_s = request_timeout(request, ctx.settings.request_timeout_s)
    ticket = ctx.service.enter(tenant_key(request), len(raw), overloaded_status)
    try:
        exchange = await prepare(ctx, request, raw)
        jobs = exchange.start()
    except BaseException:
        ctx.service.admission.leave(ticket)
        raise
    ctx.service.admission.measured(
        ticket, sum(len(job.prompt_ids) * job.params.n for job in jobs), len(jobs))
    outputs = ctx.service.generate(jobs, exchange.response_id, received,
                                   replayable=not exchange.stream, ticket=ticket,
                                   timeout_s=timeout_s)
    if exchange.stream:
        return await _stream(request, exchange, jobs, outputs)
    connected, finals = await until_disconnected(request, _collect(outputs, len(jobs)))
    if not connected or finals is None:
        return Response(status_code=499)  # nobody is listening; the status is for the log
    for final in finals:
        for sample in final.outputs:
            check_sample(sample)
    return JSONResponse(exchange.response_body(finals), headers=exchange.response_headers())


def tenant_key(request: Request) -> str:
    """Whose share of the queue a request draws on: its API key, hashed (the raw secret is not
    kept); '' for requests without one."""
    key = presented_key(request)
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def request_timeout(request: Request, default_s: float | None) -> float | None:
    """The request's deadline in seconds: its `x-request-timeout` header, else the server's."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return default_s
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e9:
        raise bad_request(f"The {TIMEOUT_HEADER} header must be a positive number of seconds, "
                          f"not {value!r}.", param=TIMEOUT_HEADER)
    return seconds


async def _collect(outputs: Outputs, num_jobs: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_jobs
    async with aclosing(outputs):
        async for index, output in outputs:
            finals[index] = output
    return _all(finals)


def _all(finals: list[RequestOutput | None]) -> list[RequestOutput]:
    # Every job yields at least its finished output before generation ends without an error.
    assert all(final is not None for final in finals)
    return finals  # type: ignore[return-value]


async def _stream(request: Request, exchange: Exchange, jobs: list[Job],
                  outputs: Outputs) -> Response:
    first = None
    if exchange.waits_for_first_output:
        connected, first = await until_disconnected(request, anext(outputs))
        if not connected or first is None:
            await outputs.aclose()
            return Response(status_code=499)
    return StreamingResponse(_events(exchange, jobs, outputs, first),
                             media_type="text/event-stream",
                             headers={**SSE_HEADERS, **exchange.stream_headers()})


async def _events(exchange: Exchange, jobs: list[Job], outputs: Outputs,
                  first: tuple[int, RequestOutput] | None) -> AsyncIterator[bytes]:
    """The streaming loop. Leaving it early (the client is gone) closes `outputs`, which
    aborts the engine's work; a failure after the first event is an event in the API's shape."""
    cursors: dict[tuple[int, int], StreamCursor] = {}
    finals: list[RequestOutput | None] = [None] * len(jobs)
    try:
        async with aclosing(outputs):
            for event in exchange.opening_events():
                yield event
            item = first if first is not None else await anext(outputs, None)
            while item is not None:
                index, output = item
                finals[index] = output
                exchange.observe_output(index, output)
                for sample in output.outputs:
                    check_sample(sample)
                    key = (index, sample.index)
                    if key not in cursors:
                        cursors[key] = StreamCursor(list(jobs[index].params.stop or []))  # type: ignore[arg-type]
                    event = exchange.delta_event(cursors[key].advance(index, sample))
                    if event is not None:
                        yield event
                item = await anext(outputs, None)
    except APIError as error:
        for event in exchange.error_events(error):
            yield event
        return
    for event in exchange.closing_events(_all(finals)):
        yield event
