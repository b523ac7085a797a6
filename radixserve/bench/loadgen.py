"""Sends a workload to one OpenAI-compatible server under bounded load and records each request.

Conversations start at Poisson/gamma arrival times (or all at once), at most `max_concurrency`
requests are in flight, a request that depends on another is sent when that one returns, and
the run ends when every request is done or at the time limit, whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from radixserve.bench.client import StreamOutcome, stream_request
from radixserve.bench.records import RequestRecord
from radixserve.bench.server_metrics import scrape
from radixserve.bench.workloads import Message, Workload

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class BenchError(RuntimeError):
    """The run could not start (server unreachable, warm-up failed)."""


@dataclass(frozen=True)
class LoadConfig:
    base_url: str  # the server's root; a trailing /v1 is accepted and dropped
    endpoint: str = "chat"  # chat | completions
    model: str | None = None  # None: the first model the server lists
    max_concurrency: int | None = None  # None: no cap
    request_rate: float = math.inf  # conversations started per second; inf: all at once
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more even
    seed: int = 0
    num_warmups: int = 1
    ready_timeout_s: float = 0.0  # keep retrying the first warm-up this long
    time_limit_s: float = 600.0
    request_timeout_s: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {list(ENDPOINTS)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("request_rate and burstiness must be > 0")

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class LoadResult:
    records: list[RequestRecord]  # one per request sent, by workload index
    sent: dict[int, list[Message] | str]  # what each sent request carried (messages or prompt)
    warmups: list[tuple[list[Message] | str, str, str | None]]  # prompt, reply, finish reason
    duration_s: float
    not_sent: int
    model: str
    started_at: str
    metrics_before: dict[str, float] | None
    metrics_after: dict[str, float] | None


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s) of `count` arrivals: gamma gaps of mean 1/rate, rescaled so the last one
    lands at exactly count/rate, which keeps the offered load the same across seeds."""
    if count == 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=count)
    times = np.cumsum(gaps)
    times *= (count / rate) / times[-1]
    return [float(t) for t in times]


def request_body(
    config: LoadConfig, model: str, prompt: list[Message] | str, max_tokens: int,
    cache_salt: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body["messages" if config.endpoint == "chat" else "prompt"] = prompt
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


async def _discover_model(client: httpx.AsyncClient, root: str) -> str:
    try:
        response = await client.get(root + "/v1/models", timeout=10.0)
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


async def _warm_up(
    client: httpx.AsyncClient, config: LoadConfig, model: str,
    render: Callable[[list[Message]], str],
) -> list[tuple[list[Message] | str, str, str | None]]:
    # Prompts unrelated to the workload, so warming up does not warm the prefix cache.
    url = config.root_url + ENDPOINTS[config.endpoint]
    deadline = time.perf_counter() + config.ready_timeout_s
    done: list[tuple[list[Message] | str, str, str | None]] = []
    for i in range(config.num_warmups):
        messages = [{"role": "user", "content": f"Warm-up number {i}. Count from one to five."}]
        prompt = messages if config.endpoint == "chat" else render(messages)
        body = request_body(config, model, prompt, 4, None)
        while True:
            outcome = await stream_request(client, url, body, config.endpoint == "chat",
                                           config.request_timeout_s)
            if outcome.success or i > 0 or time.perf_counter() >= deadline:
                break
            await asyncio.sleep(0.5)
        if not outcome.success and i == 0:
            raise BenchError(f"warm-up request to {url} failed: {outcome.error}")
        if outcome.success:
            done.append((prompt, outcome.text, outcome.finish_reason))
    return done


def _fill(record: RequestRecord, outcome: StreamOutcome) -> None:
    record.ttft = outcome.ttft
    record.latency = outcome.latency
    record.itl = outcome.itl
    record.success = outcome.success
    record.error = outcome.error
    record.prompt_tokens = outcome.prompt_tokens
    record.cached_tokens = outcome.cached_tokens
    record.finish_reason = outcome.finish_reason
    record.generated_text = outcome.text
    if outcome.completion_tokens is not None:
        record.output_tokens = outcome.completion_tokens
        record.output_tokens_source = "usage"


class _Run:
    """The measured part of one run: who is in flight, what came back, and the clock."""

    def __init__(self, workload: Workload, config: LoadConfig, client: httpx.AsyncClient,
                 model: str, render: Callable[[list[Message]], str]) -> None:
        self.workload, self.config, self.client = workload, config, client
        self.model, self.render = model, render
        self.url = config.root_url + ENDPOINTS[config.endpoint]
        self.chat = config.endpoint == "chat"
        self.records: dict[int, RequestRecord] = {}
        self.sent: dict[int, list[Message] | str] = {}
        self.replies: dict[int, str] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.crashed: list[BaseException] = []
        self.gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self.progress = tqdm(total=len(workload.requests), desc=workload.spec.name,
                             disable=not config.progress, unit="req")
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + config.time_limit_s

    def spawn(self, index: int) -> None:
        task = asyncio.create_task(self.send(index))
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self.crashed.append(error)  # a bug in the harness, not a failed request

    async def send(self, index: int) -> None:
        request = self.workload.requests[index]
        async with self.gate if self.gate is not None else contextlib.nullcontext():
            if time.perf_counter() >= self.deadline:
                return
            messages = self.workload.conversation(index, self.replies)
            prompt: list[Message] | str = messages if self.chat else self.render(messages)
            body = request_body(self.config, self.model, prompt, request.max_tokens,
                                request.cache_salt)
            record = RequestRecord(index=index, group=request.group, parent=request.parent,
                                   cache_salt=request.cache_salt)
            record.start = time.perf_counter() - self.t0
            self.records[index], self.sent[index] = record, prompt
            try:
                outcome = await stream_request(self.client, self.url, body, self.chat,
                                               self.config.request_timeout_s)
            except asyncio.CancelledError:
                record.latency = time.perf_counter() - self.t0 - record.start
                record.error = "cancelled at the time limit"
                raise
        _fill(record, outcome)
        self.progress.update(1)
        if outcome.success:
            self.replies[index] = outcome.text
            for child in self.workload.children.get(index, ()):
                self.spawn(child)

    async def arrive(self) -> None:
        roots = self.workload.roots
        config = self.config
        times = arrival_times(len(roots), config.request_rate, config.burstiness, config.seed)
        for index, at in zip(roots, times, strict=True):
            delay = self.t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() >= self.deadline:
                return
            self.spawn(index)

    async def run(self) -> float:
        """Sends everything; returns the run's duration in seconds."""
        arrivals = asyncio.create_task(self.arrive())
        while True:
            pending = set(self.tasks) | ({arrivals} if not arrivals.done() else set())
            if not pending:
                break
            remaining = self.deadline - time.perf_counter()
            if remaining <= 0:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
            await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        duration = time.perf_counter() - self.t0
        self.progress.close()
        if not arrivals.cancelled() and (error := arrivals.exception()) is not None:
            self.crashed.append(error)
        if self.crashed:
            raise self.crashed[0]
        return duration


async def run_load(
    workload: Workload,
    config: LoadConfig,
    render: Callable[[list[Message]], str],
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadResult:
    """Runs `workload` against the server. `render` turns messages into a prompt string for the
    completions endpoint (the model's chat template). `transport` is for tests."""
    root = config.root_url
    limits = httpx.Limits(max_connections=config.max_concurrency or 1000,
                          max_keepalive_connections=config.max_concurrency or 1000)
    # trust_env=False: no proxy from the environment may see or reroute benchmark traffic.
    async with httpx.AsyncClient(transport=transport, trust_env=False, limits=limits,
                                 headers=dict(config.headers)) as client:
        model = config.model or await _discover_model(client, root)
        warmups = await _warm_up(client, config, model, render) if config.num_warmups else []
        before = await scrape(client, root)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        run = _Run(workload, config, client, model, render)
        duration = await run.run()
        after = await scrape(client, root)

    return LoadResult(
        records=[run.records[i] for i in sorted(run.records)],
        sent=run.sent,
        warmups=warmups,
        duration_s=duration,
        not_sent=len(workload.requests) - len(run.records),
        model=model,
        started_at=started_at,
        metrics_before=before,
        metrics_after=after,
    )
