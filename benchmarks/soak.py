"""Soak: a server under mixed traffic at a multiple of its measured capacity for N minutes.

Three phases against one `radixserve serve` (started here, two API keys):
1. unloaded: the traffic mix one request at a time, for the TTFT a client gets from an idle
   server;
2. capacity: the mix closed-loop at --capacity-concurrency, for the completed requests per
   second the server sustains;
3. soak: open-loop (Poisson) arrivals at --load x that capacity for --minutes, tenant A sending
   --flood-share of them (the flooding key) and tenant B the rest.

The mix: growing multi-turn conversations (reset near the context limit), prompts sharing a long
system prompt, unique prompts, bad requests (400 expected), and streams the client drops after
a random delay. Reports 5xx count, hangs (no answer within --client-timeout), the 429 share,
refusal latency (p50/p99/max, whether every refusal carried retry-after, and how many were over
50 ms once this client's own stalls are taken out: its collector passes and event-loop lag are
recorded as they happen, and set beside each slow refusal), p50/p99 TTFT of
admitted requests against the unloaded figures (tenant B's too: the one not flooding), RSS over
time with its slope over the second half (beside the KV pool's high-water mark: pool pages
enter RSS as the cache first fills them, which a short soak still sees), and whether the KV
pool is back to idle at the end.

    python benchmarks/soak.py --minutes 3 --out results/soak.json
    python benchmarks/soak.py --minutes 60 --load 3 --server-flags="--max-queue-wait 5"
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from radixserve.bench.textgen import WordBank
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.testing.server import (
    ServerProcess,
    parse_metrics,
    read_metrics,
    start_server,
    wait_idle,
)

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("soak-tenant-a", "soak-tenant-b")


@dataclass
class Outcome:
    kind: str
    tenant: int
    status: int  # HTTP status; 0: transport error; -1: hung (client timeout); 499: dropped
    started: float
    ttft_s: float | None = None  # admitted requests: to the first content event
    latency_s: float = 0.0  # to the response headers (refusals) or the end
    retry_after: bool = False


@dataclass
class Conversation:
    turns: list[dict[str, str]] = field(default_factory=list)
    tokens: int = 0


class Traffic:
    """The request mix; conversations grow turn by turn up to about the context limit."""

    def __init__(self, bank: WordBank, rng: random.Random, context_tokens: int) -> None:
        self.bank = bank
        self.rng = rng
        self.context_tokens = context_tokens
        self.system = bank.text(rng, 600)  # the shared prefix
        self.conversations = [Conversation() for _ in range(8)]

    def request(self) -> tuple[str, dict[str, Any], Conversation | None]:
        r = self.rng.random()
        body: dict[str, Any] = {"model": MODEL, "temperature": 0.7, "stream": True,
                                "max_tokens": self.rng.randint(8, 48)}
        if r < 0.05:
            return "bad", {**body, "stream": False, "temperature": -1,
                           "messages": [{"role": "user", "content": "hi"}]}, None
        if r < 0.40:
            conversation = self.rng.choice(self.conversations)
            if conversation.tokens > self.context_tokens * 0.7:
                conversation.turns, conversation.tokens = [], 0
            question = self.bank.text(self.rng, self.rng.randint(20, 120))
            conversation.turns.append({"role": "user", "content": question})
            conversation.tokens += 150
            return "conversation", {**body, "messages": list(conversation.turns)}, conversation
        if r < 0.75:
            question = self.bank.text(self.rng, self.rng.randint(10, 60))
            return "shared", {**body, "messages": [{"role": "system", "content": self.system},
                                                   {"role": "user", "content": question}]}, None
        prompt = self.bank.text(self.rng, self.rng.randint(100, 800))
        return "unique", {**body, "messages": [{"role": "user", "content": prompt}]}, None


async def send(http: httpx.AsyncClient, kind: str, tenant: int, body: dict[str, Any],
               conversation: Conversation | None, drop_after_s: float | None,
               timeout_s: float) -> Outcome:
    started = time.monotonic()
    outcome = Outcome(kind, tenant, 0, started)
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", "/v1/chat/completions", json=body,
                                   headers=headers) as response:
                outcome.status = response.status_code
                outcome.retry_after = "retry-after" in response.headers
                if response.status_code != 200 or not body.get("stream"):
                    await response.aread()
                    outcome.latency_s = time.monotonic() - started
                    return outcome
                text = []
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    delta = (event.get("choices") or [{}])[0].get("delta", {})
                    if delta.get("content") and outcome.ttft_s is None:
                        outcome.ttft_s = time.monotonic() - started
                    text.append(delta.get("content") or "")
                    if drop_after_s is not None and time.monotonic() - started > drop_after_s:
                        outcome.status = 499
                        break
                if conversation is not None and outcome.status == 200:
                    conversation.turns.append({"role": "assistant", "content": "".join(text)})
    except TimeoutError:
        outcome.status = -1
    except httpx.HTTPError:
        outcome.status = 0
    outcome.latency_s = time.monotonic() - started
    return outcome


def _one(traffic: Traffic, rng: random.Random, tenant: int, http: httpx.AsyncClient,
         timeout_s: float) -> asyncio.Task[Outcome]:
    kind, body, conversation = traffic.request()
    drop = rng.uniform(0.05, 2.0) if kind != "bad" and rng.random() < 0.05 else None
    return asyncio.ensure_future(send(http, kind, tenant, body, conversation, drop, timeout_s))


async def unloaded(http: httpx.AsyncClient, traffic: Traffic, rng: random.Random,
                   seconds: float, timeout_s: float) -> list[Outcome]:
    outcomes, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        outcomes.append(await _one(traffic, rng, 1, http, timeout_s))
    return outcomes


async def capacity(http: httpx.AsyncClient, traffic: Traffic, rng: random.Random,
                   seconds: float, concurrency: int, timeout_s: float) -> float:
    done, end = 0, time.monotonic() + seconds
    started = time.monotonic()

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < end:
            outcome = await _one(traffic, rng, 1, http, timeout_s)
            done += outcome.status == 200
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - started)


async def soak(http: httpx.AsyncClient, traffic: Traffic, rng: random.Random, rate: float,
               seconds: float, flood_share: float, timeout_s: float, pid: int,
               rss: list[tuple[float, float]], pool_used: list[tuple[float, float]]
               ) -> list[Outcome]:
    tasks: list[asyncio.Task[Outcome]] = []
    start = time.monotonic()
    end = start + seconds
    process = psutil.Process(pid)
    next_sample = start
    while (now := time.monotonic()) < end:
        if now >= next_sample:
            # What survived until now is frozen out of the collector's full passes, which
            # would otherwise grow with the soak's own records and stall this client.
            gc.freeze()
            rss.append((now - start, process.memory_info().rss / 2**20))
            # KV pool pages are touched (enter RSS) as the cache first fills them: the pool's
            # high-water mark says how much of an RSS rise is that rather than a leak.
            metrics = parse_metrics((await http.get("/metrics")).text)
            used = metrics["kv_cache_capacity_tokens"] - metrics["kv_cache_tokens{state=free}"]
            pool_used.append((now - start, max(used, pool_used[-1][1] if pool_used else 0.0)))
            next_sample = now + 5.0
        tenant = 0 if rng.random() < flood_share else 1
        tasks.append(_one(traffic, rng, tenant, http, timeout_s))
        await asyncio.sleep(rng.expovariate(rate))
    outcomes = await asyncio.gather(*tasks)
    rss.append((time.monotonic() - start, process.memory_info().rss / 2**20))
    return list(outcomes)


class ClientPauses:
    """This client's own stalls, which land in every latency it measures: garbage-collector
    passes (a gc callback) and event-loop lag (a 5 ms ticker's lateness), each kept with when
    it happened so that a slow refusal can be set beside them."""

    def __init__(self) -> None:
        self.longest_gc_s = 0.0
        self._gc_started = 0.0
        self.stalls: list[tuple[float, float]] = []  # (start, end), monotonic, >= 5 ms

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.monotonic()
            return
        end = time.monotonic()
        self.longest_gc_s = max(self.longest_gc_s, end - self._gc_started)
        if end - self._gc_started >= 0.005:
            self.stalls.append((self._gc_started, end))

    async def watch_loop(self, tick_s: float = 0.005) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(tick_s)
            late = time.monotonic() - before - tick_s
            if late >= 0.005:
                self.stalls.append((before + tick_s, before + tick_s + late))

    def stalled_during(self, start: float, end: float) -> float:
        """Seconds of [start, end] this client spent stalled (overlapping stalls, such as a
        collector pass and the loop lag it caused, counted once)."""
        spans = sorted((max(start, a), min(end, b)) for a, b in self.stalls if a < end and b > start)
        total, reach = 0.0, start
        for a, b in spans:
            total += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        return total

    @property
    def longest_stall_s(self) -> float:
        return max((b - a for a, b in self.stalls), default=0.0)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (MB per minute)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 60 * sum((t - mx) * (v - my) for t, v in points) / var if var else 0.0


def summarize(base: list[Outcome], outcomes: list[Outcome], rss: list[tuple[float, float]],
              capacity_rps: float, rate: float, pool: dict[str, float],
              pauses: ClientPauses) -> dict[str, Any]:
    admitted = [o for o in outcomes if o.ttft_s is not None]
    refused = [o for o in outcomes if o.status in (429, 503, 529)]
    half = rss[len(rss) // 2:]
    slope = _slope(half)
    span_min = (half[-1][0] - half[0][0]) / 60 if len(half) > 1 else 0.0
    growth = slope * span_min / half[0][1] * 100 if half and half[0][1] else 0.0
    ttft = [o.ttft_s for o in admitted if o.ttft_s is not None]
    ttft_b = [o.ttft_s for o in admitted if o.tenant == 1 and o.ttft_s is not None]
    base_ttft = [o.ttft_s for o in base if o.ttft_s is not None]
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
    return {
        "capacity_rps": capacity_rps, "offered_rps": rate, "requests": len(outcomes),
        "by_status": by_status,
        "5xx": sum(1 for o in outcomes if o.status >= 500 and o.status not in (503, 529)),
        "hangs": sum(1 for o in outcomes if o.status == -1),
        "transport_errors": sum(1 for o in outcomes if o.status == 0),
        "refused_share": len(refused) / max(len(outcomes), 1),
        "refused_share_tenant_b": (sum(1 for o in refused if o.tenant == 1)
                                   / max(sum(1 for o in outcomes if o.tenant == 1), 1)),
        "refusal_latency_s": {"p50": _pct([o.latency_s for o in refused], 0.5),
                              "p99": _pct([o.latency_s for o in refused], 0.99),
                              "max": max((o.latency_s for o in refused), default=None)},
        "refusals_over_50ms": sum(1 for o in refused if o.latency_s > 0.05),
        # A refusal's latency, less the time this client itself was stalled meanwhile (its
        # own collector or event loop), is what the server took.
        "refusals_over_50ms_less_client_stalls": sum(
            1 for o in refused
            if o.latency_s - pauses.stalled_during(o.started, o.started + o.latency_s) > 0.05),
        # When (seconds into the soak) the slowest refusals were sent, to set beside the
        # server's log and RSS series.
        "slowest_refusals": [{"at_s": o.started - outcomes[0].started, "latency_s": o.latency_s,
                              "client_stalled_s": pauses.stalled_during(
                                  o.started, o.started + o.latency_s)}
                             for o in sorted(refused, key=lambda o: -o.latency_s)[:10]],
        "refusals_without_retry_after": sum(1 for o in refused if not o.retry_after),
        "ttft_unloaded_s": {"p50": _pct(base_ttft, 0.5), "p99": _pct(base_ttft, 0.99)},
        "ttft_admitted_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
        "ttft_admitted_tenant_b_s": {"p50": _pct(ttft_b, 0.5), "p99": _pct(ttft_b, 0.99)},
        "rss_mb": {"first": rss[0][1] if rss else None, "last": rss[-1][1] if rss else None,
                   "second_half_slope_mb_per_min": slope,
                   "second_half_growth_pct": growth},
        "pool_at_end": pool,
    }


async def run(args: argparse.Namespace, proc: ServerProcess) -> dict[str, Any]:
    tokenizer = load_tokenizer(default_model_path())
    rng = random.Random(args.seed)
    traffic = Traffic(WordBank.from_tokenizer(tokenizer), rng, args.context_tokens)
    # The client's own pauses land in the latencies it measures: its set-up heap (the
    # tokenizer, imports) is frozen out of the collector's full passes, as the server's is, and
    # the longest pause it still took is reported beside the figures.
    gc.collect()
    gc.freeze()
    pauses = ClientPauses()
    gc.callbacks.append(pauses.on_gc)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=proc.base_url, timeout=args.client_timeout,
                                 limits=limits, trust_env=False) as http:
        while (await http.get("/health/ready")).status_code != 200:  # warm-up done
            await asyncio.sleep(0.5)
        print(f"unloaded: {args.unloaded_s:.0f} s one at a time", file=sys.stderr)
        base = await unloaded(http, traffic, rng, args.unloaded_s, args.client_timeout)
        print(f"capacity: {args.capacity_s:.0f} s at concurrency {args.capacity_concurrency}",
              file=sys.stderr)
        rps = await capacity(http, traffic, rng, args.capacity_s, args.capacity_concurrency,
                             args.client_timeout)
        rate = max(rps, 0.05) * args.load
        print(f"soak: {args.minutes:g} min at {rate:.2f} req/s ({args.load:g} x {rps:.2f})",
              file=sys.stderr)
        rss: list[tuple[float, float]] = []
        pool_used: list[tuple[float, float]] = []
        watcher = asyncio.ensure_future(pauses.watch_loop())
        outcomes = await soak(http, traffic, rng, rate, args.minutes * 60, args.flood_share,
                              args.client_timeout, proc.process.pid, rss, pool_used)
        watcher.cancel()
    metrics = wait_idle(proc.base_url, timeout_s=120)
    pool = {k: v for k, v in read_metrics(proc.base_url).items() if k.startswith("kv_cache_tokens")}
    summary = summarize(base, outcomes, rss, rps, rate, pool, pauses)
    summary["pool_idle"] = (metrics["kv_cache_tokens{state=private}"] == 0
                            and metrics["kv_cache_tokens{state=protected}"] == 0)
    summary["client_gc_longest_pause_s"] = pauses.longest_gc_s
    summary["client_longest_stall_s"] = pauses.longest_stall_s
    summary["rss_series_mb"] = rss
    summary["pool_high_water_tokens"] = {"first": pool_used[0][1] if pool_used else None,
                                         "second_half_start": (pool_used[len(pool_used) // 2][1]
                                                               if pool_used else None),
                                         "last": pool_used[-1][1] if pool_used else None}
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--load", type=float, default=3.0, help="offered load / measured capacity")
    p.add_argument("--flood-share", type=float, default=0.8,
                   help="share of requests from tenant A (the flooding key)")
    p.add_argument("--unloaded-s", type=float, default=30.0)
    p.add_argument("--capacity-s", type=float, default=45.0)
    p.add_argument("--capacity-concurrency", type=int, default=4)
    p.add_argument("--client-timeout", type=float, default=120.0)
    p.add_argument("--context-tokens", type=int, default=2048,
                   help="conversations reset at 70%% of this")
    p.add_argument("--server-flags", default="--kv-cache-tokens 16384 --num-threads 2",
                   help="extra `radixserve serve` flags (the API keys are added)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    flags = [*shlex.split(args.server_flags), "--no-access-log", "--max-model-len",
             str(args.context_tokens), "--api-key", KEYS[0], "--api-key", KEYS[1]]
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(flags, Path(tmp) / "server.log")
        try:
            summary = asyncio.run(run(args, proc))
        finally:
            summary_status = proc.stop()
        summary["server_exit"] = summary_status
        summary["serious_errors"] = proc.serious_errors()
    summary["command"] = " ".join(sys.argv)
    printable = {k: v for k, v in summary.items() if k != "rss_series_mb"}
    print(json.dumps(printable, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
