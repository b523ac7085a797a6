"""Runs the engine's step loop in a thread beside an asyncio event loop.

The event loop never blocks on the model: requests and aborts travel to the engine thread
through a queue, and outputs come back through per-request asyncio queues. PyTorch releases
the GIL inside its kernels, so the HTTP server stays responsive while a step runs.

The engine thread also builds the engine, so that loading and stepping run their parallel
regions from the same thread. GNU OpenMP (PyTorch's) keeps a team of worker threads for each
thread that has run a parallel region; once a process holds more of those threads than it
has cores, every team's workers sleep at a barrier almost at once instead of spinning, and
each of the hundreds of parallel regions in a step then waits for a wake-up. A model loaded
on the main thread and stepped on this one made batch-1 decode through the server markedly
slower (benchmarks/bench_http.py --concurrency 1 measures it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.background_prefill import BackgroundPrefill, PrefillJob
from radixserve.engine.engine import LLMEngine
from radixserve.engine.heartbeat import FaultInjector, Heartbeat
from radixserve.engine.limits import EngineLimits
from radixserve.engine.structured_output import GrammarCompiler
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)


class AsyncEngine:
    """Thread-safe front of an `LLMEngine`: `generate` streams, `abort` cancels."""

    def __init__(self, build: Callable[[], LLMEngine], background_prefill: bool = False) -> None:
        """Runs `build()` on the engine thread and waits for it; its exception, if any, is
        raised here and leaves no thread behind. `background_prefill`: accept idle-time
        prefills (`prefill_in_background`; radix cache only)."""
        self._background_wanted = background_prefill
        self.background: BackgroundPrefill | None = None
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self.heartbeat = Heartbeat()
        self._faults = FaultInjector.from_env()
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built),
                                        name="radixserve-engine", daemon=True)
        self._thread.start()
        try:
            built.result()
        except BaseException:
            self._stop.set()  # interrupted while loading: the thread closes what it built
            if built.done() and built.exception() is not None:  # the build failed: it ended
                self._thread.join()
            raise

    # ----- called from the event loop -----

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        namespace: Hashable = None,
        *,
        replayable: bool = False,
        affinity: str | None = None,
        **options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Streams cumulative outputs until finished. Leaving the iterator early aborts it.

        Raises ValueError (bad prompt or params) before the first output. `replayable` (the
        caller keeps only the final output) matters to fronts whose engines can die apart
        from the caller (`replicas.front`); a local engine fails with its caller. `affinity`
        (which engine holds the prefix) matters to fronts of several; here there is one.
        """
        stream = _Stream(asyncio.get_running_loop())
        added: concurrent.futures.Future[str] = concurrent.futures.Future()

        def add() -> None:
            if not added.set_running_or_notify_cancel():  # the caller gave up while queued
                return
            try:
                self._streams[request_id] = stream
                if self.background is not None:
                    self.background.yield_now()
                self.engine.add_request(prompt, params, request_id, namespace, **options)
                added.set_result(request_id)
            except BaseException as exc:  # handed to the caller, never kills the thread
                self._streams.pop(request_id, None)
                added.set_exception(exc)

        finished = False
        try:
            await self._call(add, added)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    @property
    def background_prefill(self) -> bool:
        """Whether `prefill_in_background` does anything (the engine was built with it)."""
        return self.background is not None

    def prefill_in_background(self, token_ids: list[int], namespace: Hashable = None,
                              affinity: str | None = None) -> None:
        """Caches `token_ids`' KV when the engine is next idle, at the lowest priority
        (`engine.background_prefill`); a no-op when background prefill is off. (`affinity`
        names an engine among several: here there is one.)"""
        background = self.background
        if background is not None:
            job = PrefillJob(tuple(token_ids), namespace)
            self._inbox.put(lambda: background.submit(job))

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps; returns its result."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def call() -> None:
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(self.engine))
            except BaseException as exc:
                done.set_exception(exc)

        return await self._call(call, done)

    async def flush(self) -> None:
        """Returns once the engine thread has applied every add and abort queued so far (its
        inbox runs in order)."""
        await self.run(lambda engine: None)

    def abort(self, request_id: str) -> None:
        """Ends the request within one engine step; safe from any thread, idempotent."""

        def drop() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._inbox.put(drop)

    # ----- the engine's fixed facts, for validation (`server.front.EngineFront`) -----

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.engine.tokenizer

    @property
    def grammars(self) -> GrammarCompiler:
        return self.engine.grammars

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    @property
    def clock(self) -> Callable[[], float]:
        """The engine's clock (TTL pins age on it; a test's clock control moves it)."""
        return self.engine.clock

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        self.engine.check_prompt(ids, params)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)  # wake the thread
        self._thread.join(timeout)

    async def _call(self, fn: Callable[[], None], result: concurrent.futures.Future[Any]) -> Any:
        if not self.alive:
            raise EngineDeadError("the engine has stopped")
        self._inbox.put(fn)
        return await asyncio.wrap_future(result)

    # ----- the engine thread -----

    def _run(self, build: Callable[[], LLMEngine], built: concurrent.futures.Future[LLMEngine]
             ) -> None:
        try:
            engine = build()
            if self._background_wanted:
                self.background = BackgroundPrefill(engine)
        except BaseException as exc:  # raised in the constructor's thread
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(engine)
        if self._stop.is_set():  # the caller stopped waiting before the build ended
            engine.close()
            return
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat.beat()
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self.background is not None:
                    self.background.start_if_idle()
                if self.engine.has_unfinished_requests():
                    self.heartbeat.step_begun()
                    self._faults.before_step()
                    outputs = self.engine.step()
                    self.heartbeat.step_ended()
                    if self.background is not None:
                        self.background.after_step(outputs)
                    self._dispatch(outputs)
        except BaseException as exc:  # pragma: no cover - a bug; fail every open stream
            logger.exception("engine loop died")
            for request_id in list(self._streams):
                self._send(request_id, EngineDeadError(str(exc)))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            item()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.request_id in self._streams:
                self._send(output.request_id, output, last=output.finished)

    def _send(self, request_id: str, item: RequestOutput | BaseException, last: bool = True) -> None:
        stream = self._streams[request_id]
        if last:
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop has closed: nobody is listening
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)
