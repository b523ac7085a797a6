"""Routers for `radixserve serve --replicas`, side by side on one machine: the prefix router
against Serve's power of two choices, round-robin and Ray's own PrefixCacheAffinityRouter.

Shared workload: requests built from a few long prefixes (each repeated, in a shuffled
interleaved order) plus a distinct short question. The KV pool of each replica
(--kv-cache-tokens) holds only some of the prefixes, as a memory-bound replica would, so a
router that sends every prefix everywhere makes the replicas evict and recompute. Unique
workload: every prompt its own, nothing to share: what routing by prefix costs when it
cannot win. One server per router (fresh Ray cluster); both workloads run on it, in order,
after a warm-up of unrelated requests that reaches every replica and counts in no figure.
Per router and workload: total time, requests/s, cached-token share (from each response's
usage), TTFT p50/p99, the router's own ms per decision (/v1/replicas) and the requests each
replica took (/metrics deltas); then ratios vs pow2 against the issue's targets.

pow2 places requests at random, so what it happens to reuse varies from run to run; --rounds K
repeats the whole comparison K times (a fresh server per router and round, the routers' order
reversed every other round so drift over time weighs on each alike) and reports each round's
ratios and the figures pooled over all rounds (every request of every round counted once).

    .venv/bin/python benchmarks/bench_replicas.py
    .venv/bin/python benchmarks/bench_replicas.py --quick --out /tmp/bench_replicas_quick.json
    .venv/bin/python benchmarks/bench_replicas.py --routers prefix,pow2 --workloads shared
    .venv/bin/python benchmarks/bench_replicas.py --routers prefix,pow2 --rounds 3 --unique-requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from timing import cpu_summary

from radixserve.bench.client import StreamOutcome, stream_request
from radixserve.bench.textgen import WordBank
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.testing.server import ServerProcess, read_metrics, start_server

ROUTERS = ("prefix", "pow2", "round-robin", "ray-prefix")
WORKLOADS = ("shared", "unique")
WARM_UP_ROUNDS = 3  # pairs of warm-up requests sent until every replica has served one
SETTLE_TIMEOUT_S = 30.0  # /metrics trails the replicas by a routing-stats period (~1 s)


@dataclass(frozen=True)
class Sizes:
    """The workloads' sizes; QUICK shrinks them for a smoke run. Flags override either."""

    prefixes: int = 8
    prefix_tokens: int = 1500
    question_tokens: int = 30
    requests: int = 128
    unique_requests: int = 64
    max_tokens: int = 32
    concurrency: int = 8


QUICK = Sizes(prefixes=2, prefix_tokens=300, requests=16, unique_requests=8, max_tokens=8,
              concurrency=4)
QUICK_ROUTERS = "prefix,pow2"


@dataclass(frozen=True)
class Sample:
    """One finished request, as its stream told it."""

    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Prompts:
    """Every prompt of a run, built once so each router serves the same requests. Prefixes,
    warm-up and unique prompts all start with distinct words: they share no token."""

    warm_up: list[str]
    shared: list[str]
    unique: list[str]


def build_prompts(bank: WordBank, sizes: Sizes, seed: int) -> Prompts:
    rng = random.Random(seed)
    prompt_tokens = sizes.prefix_tokens + sizes.question_tokens
    count = sizes.prefixes + 2 * WARM_UP_ROUNDS + sizes.unique_requests
    firsts = iter(rng.sample(bank.words, count))

    def text(num_tokens: int) -> str:
        return next(firsts) + " " + bank.text(rng, num_tokens - 1)

    prefixes = [text(sizes.prefix_tokens) for _ in range(sizes.prefixes)]
    warm_up = [text(prompt_tokens) for _ in range(2 * WARM_UP_ROUNDS)]
    unique = [text(prompt_tokens) for _ in range(sizes.unique_requests)]
    # Each prefix equally often (up to one), in a shuffled, interleaved order.
    order = [i % sizes.prefixes for i in range(sizes.requests)]
    rng.shuffle(order)
    questions = bank.distinct_texts(rng, sizes.requests, sizes.question_tokens)
    shared = [prefixes[p] + " " + q for p, q in zip(order, questions, strict=True)]
    return Prompts(warm_up, shared, unique)


# ----- the client -----


async def _serve(base_url: str, model: str, prompts: list[str], sizes: Sizes,
                 concurrency: int) -> tuple[float, list[Sample]]:
    """Sends every prompt as a streamed /v1/completions, `concurrency` in flight; the wall
    time and one Sample per prompt, in order. Raises on any failed request."""
    gate = asyncio.Semaphore(concurrency)
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
        async def one(prompt: str) -> StreamOutcome:
            body = {"model": model, "prompt": prompt, "max_tokens": sizes.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with gate:
                return await stream_request(client, url, body, chat=False, timeout_s=3600)

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    errors = [o.error for o in outcomes if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(outcomes)} requests failed, e.g. {errors[0]}")
    samples = []
    for o in outcomes:
        assert o.ttft is not None and o.latency is not None and o.prompt_tokens is not None
        samples.append(Sample(o.ttft, o.latency, o.prompt_tokens, o.cached_tokens or 0,
                              o.completion_tokens or 0))
    return wall, samples


# ----- what the server says -----

_REPLICA_KEY = re.compile(r"^(\w+)\{replica=([^,}]+)\}$")


def per_replica(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """`name{replica=R}` samples as {R: {name: value}}."""
    found: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        match = _REPLICA_KEY.match(key)
        if match is not None:
            found.setdefault(match.group(2), {})[match.group(1)] = value
    return found


def _sum(metrics: dict[str, float], name: str) -> float:
    return sum(r.get(name, 0.0) for r in per_replica(metrics).values())


def settled_metrics(server: ServerProcess, queried_tokens: int) -> tuple[dict[str, float], bool]:
    """/metrics once the replicas' snapshots show `queried_tokens` prompt tokens looked up in
    all (every request served so far) and nothing running; whether they did in time."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        metrics = read_metrics(server.base_url, by_replica=True)
        busy = _sum(metrics, "num_requests_running") + _sum(metrics, "num_requests_waiting")
        if _sum(metrics, "prefix_cache_queries_total") >= queried_tokens and busy == 0:
            return metrics, True
        if time.monotonic() > deadline:
            return metrics, False
        time.sleep(0.25)


def router_figures(server: ServerProcess) -> dict[str, Any]:
    response = httpx.get(server.base_url + "/v1/replicas", timeout=30.0, trust_env=False)
    response.raise_for_status()
    return response.json()


def _router_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float | None]:
    """Requests routed, mean ms per decision and retries between two /v1/replicas reads; the
    mean is None where the router timed no decision (it does not count its own)."""
    a, b = after["router"], before["router"]
    routed = a["requests"] - b["requests"]
    ms = a["mean_ms"] * a["requests"] - b["mean_ms"] * b["requests"]
    return {"routed": routed, "mean_ms": ms / routed if routed else None,
            "retried": a["retried_requests"] - b["retried_requests"]}


# ----- one router -----


@dataclass
class Tally:
    """Prompt tokens served so far on one server: what its /metrics must come to show."""

    queried_tokens: int = 0

    def add(self, samples: list[Sample]) -> None:
        self.queried_tokens += sum(s.prompt_tokens for s in samples)


def _warm_up(server: ServerProcess, model: str, prompts: Prompts, sizes: Sizes,
             tally: Tally) -> dict[str, Any]:
    """Pairs of unrelated requests, sent together, until every replica has served one: each
    replica's first steps pay one-time costs (allocations, kernel set-up)."""
    replicas = len(router_figures(server)["replicas"])
    for round_ in range(WARM_UP_ROUNDS):
        pair = prompts.warm_up[2 * round_: 2 * round_ + 2]
        _, samples = asyncio.run(_serve(server.base_url, model, pair, sizes, 2))
        tally.add(samples)
        metrics, _ = settled_metrics(server, tally.queried_tokens)
        served = [r for r in per_replica(metrics).values()
                  if r.get("prefix_cache_queries_total", 0) > 0]
        if len(served) >= replicas:
            break
    return {"requests": 2 * (round_ + 1), "replicas_warmed": len(served), "replicas": replicas}


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _run_workload(server: ServerProcess, model: str, prompts: list[str], sizes: Sizes,
                  tally: Tally) -> dict[str, Any]:
    before_metrics, _ = settled_metrics(server, tally.queried_tokens)
    before_router = router_figures(server)
    wall, samples = asyncio.run(_serve(server.base_url, model, prompts, sizes,
                                       sizes.concurrency))
    tally.add(samples)
    after_metrics, settled = settled_metrics(server, tally.queried_tokens)
    router = _router_delta(router_figures(server), before_router)
    prompt_tokens = sum(s.prompt_tokens for s in samples)
    mean_prompt = prompt_tokens / len(samples)
    replicas = {}
    old = per_replica(before_metrics)
    for name, now in sorted(per_replica(after_metrics).items()):
        delta = {k: v - old.get(name, {}).get(k, 0.0) for k, v in now.items()
                 if k.endswith("_total")}
        queries = delta.get("prefix_cache_queries_total", 0.0)
        # Queries count a request's prompt tokens once, at admission: every prompt here has
        # (about) the same length, so tokens / mean length is the request count.
        replicas[name] = {"requests_est": round(queries / mean_prompt), "queried_tokens": queries,
                          "hit_tokens": delta.get("prefix_cache_hits_total", 0.0),
                          "computed_tokens": delta.get("prompt_tokens_computed_total", 0.0),
                          "evicted_tokens": delta.get("prefix_cache_evicted_tokens_total", 0.0),
                          "preemptions": delta.get("num_preemptions_total", 0.0)}
    queried = sum(r["queried_tokens"] for r in replicas.values())
    ttfts = [s.ttft_s for s in samples]
    return {
        "requests": len(samples),
        "total_s": wall,
        "requests_per_s": len(samples) / wall,
        "cached_share": sum(s.cached_tokens for s in samples) / prompt_tokens,
        "server_cached_share": sum(r["hit_tokens"] for r in replicas.values()) / queried
        if queried else None,
        "ttft_p50_ms": 1e3 * _percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * _percentile(ttfts, 99),
        "e2e_p50_s": _percentile([s.e2e_s for s in samples], 50),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(s.completion_tokens for s in samples),
        "router_ms_per_request": router["mean_ms"],
        "router_routed": router["routed"],
        "router_retried": router["retried"],
        "replicas": replicas,
        "metrics_settled": settled,
        "samples": [dataclasses.asdict(s) for s in samples],
    }


def bench_router(router: str, args: argparse.Namespace, sizes: Sizes, prompts: Prompts,
                 workloads: list[str], log_path: Path) -> dict[str, Any]:
    """One server with `router`: warm-up, then each workload in turn."""
    flags = ["--replicas", str(args.replicas), "--router", router, "--kv-cache-tokens",
             str(args.kv_cache_tokens), "--num-threads", str(args.num_threads),
             "--no-access-log", *args.serve_arg]
    if args.model:
        flags += ["--model", args.model]
    started = time.perf_counter()
    server = start_server(flags, log_path)
    report: dict[str, Any] = {"server_flags": flags, "log": str(log_path),
                              "startup_s": time.perf_counter() - started}
    print(f"{router}: server up in {report['startup_s']:.0f} s", flush=True)
    try:
        models = httpx.get(server.base_url + "/v1/models", timeout=30.0, trust_env=False)
        model = models.json()["data"][0]["id"]
        tally = Tally()
        report["warm_up"] = _warm_up(server, model, prompts, sizes, tally)
        for workload in workloads:
            runs = prompts.shared if workload == "shared" else prompts.unique
            if workload == "unique" and router not in args.unique_routers:
                continue
            result = _run_workload(server, model, runs, sizes, tally)
            report[workload] = result
            print(f"  {workload}: {result['requests']} requests in {result['total_s']:.1f} s, "
                  f"cached {result['cached_share']:.1%}, TTFT p99 "
                  f"{result['ttft_p99_ms']:.0f} ms", flush=True)
    finally:
        report["exit_status"] = server.stop()
        report["serious_log_lines"] = server.serious_errors()
    return report


# ----- rounds -----


def pooled(reports: list[dict[str, Any]], workload: str) -> dict[str, Any] | None:
    """One router's rounds of a workload as one run: times summed, shares and percentiles
    over every request of every round, the router's cost weighted by decisions."""
    runs = [r[workload] for r in reports if workload in r]
    if not runs:
        return None
    samples = [s for run in runs for s in run["samples"]]
    prompt_tokens = sum(s["prompt_tokens"] for s in samples)
    total = sum(run["total_s"] for run in runs)
    timed = [(run["router_ms_per_request"], run["router_routed"]) for run in runs
             if run["router_ms_per_request"] is not None]
    decisions = sum(n for _, n in timed)
    ttfts = [s["ttft_s"] for s in samples]
    return {
        "rounds": len(runs),
        "requests": len(samples),
        "total_s": total,
        "requests_per_s": len(samples) / total,
        "cached_share": sum(s["cached_tokens"] for s in samples) / prompt_tokens,
        "ttft_p50_ms": 1e3 * _percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * _percentile(ttfts, 99),
        "router_ms_per_request": (sum(ms * n for ms, n in timed) / decisions
                                  if decisions else None),
        # Replica names differ from server to server: one split per round.
        "splits": [[x["requests_est"] for x in run["replicas"].values()] for run in runs],
    }


def round_ratios(rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, dict[str, float]]]:
    """ratios() of each round on its own."""
    count = max((len(v) for v in rounds.values()), default=0)
    out = []
    for k in range(count):
        one = {router: {w: reports[k][w] for w in WORKLOADS if w in reports[k]}
               for router, reports in rounds.items() if k < len(reports)}
        out.append(ratios(one))
    return out


# ----- the report -----


def _verdict(value: float, target: float, at_least: bool) -> str:
    met = value >= target if at_least else value <= target
    return "met" if met else "NOT met"


def table(results: dict[str, dict[str, Any]], workloads: list[str]) -> str:
    head = (f"{'workload':<8} {'router':<11} {'reqs':>4} {'total s':>8} {'req/s':>6} "
            f"{'cached':>7} {'TTFT p50':>9} {'p99':>8} {'route ms':>8}  requests per replica")
    lines = [head, "-" * len(head)]
    for workload in workloads:
        for router, report in results.items():
            r = report.get(workload)
            if r is None:
                continue
            split = " ; ".join("/".join(str(n) for n in round_) for round_ in r["splits"])
            route_ms = r["router_ms_per_request"]
            route = "n/a" if route_ms is None else f"{route_ms:.3f}"
            lines.append(
                f"{workload:<8} {router:<11} {r['requests']:>4} {r['total_s']:>8.1f} "
                f"{r['requests_per_s']:>6.2f} {100 * r['cached_share']:>6.1f}% "
                f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>6.0f}ms "
                f"{route:>8}  {split}")
    return "\n".join(lines)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each router against pow2 on the same workload; the issue's targets for the prefix
    router are printed beside them."""
    base = results.get("pow2", {})
    out: dict[str, dict[str, float]] = {}
    for router, report in results.items():
        if router == "pow2":
            continue
        found: dict[str, float] = {}
        if "shared" in report and "shared" in base:
            mine, theirs = report["shared"], base["shared"]
            found["shared_cached_share_ratio"] = (
                mine["cached_share"] / theirs["cached_share"] if theirs["cached_share"]
                else float("inf"))
            found["shared_speedup"] = theirs["total_s"] / mine["total_s"]
        if "unique" in report and "unique" in base:
            found["unique_time_ratio"] = report["unique"]["total_s"] / base["unique"]["total_s"]
        if found:
            out[router] = found
    return out


def print_ratios(found: dict[str, dict[str, float]]) -> None:
    for router, r in found.items():
        parts = []
        targets = router == "prefix"
        if "shared_cached_share_ratio" in r:
            share, speed = r["shared_cached_share_ratio"], r["shared_speedup"]
            parts.append(f"cached share {share:.2f}x pow2's"
                         + (f" (target >= 1.8x: {_verdict(share, 1.8, True)})" if targets else ""))
            parts.append(f"{speed:.2f}x as fast"
                         + (f" (target >= 1.5x: {_verdict(speed, 1.5, True)})" if targets else ""))
        if "unique_time_ratio" in r:
            ratio = r["unique_time_ratio"]
            parts.append(f"unique prompts {ratio:.3f}x pow2's time"
                         + (f" (target <= 1.05: {_verdict(ratio, 1.05, False)})"
                            if targets else ""))
        print(f"{router} vs pow2: " + "; ".join(parts))


def _names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown)} (choose from "
                         f"{', '.join(allowed)})")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", default=None,
                   help=f"comma-separated, from {','.join(ROUTERS)} (default: all; --quick: "
                        f"{QUICK_ROUTERS})")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="shared,unique (default: both)")
    p.add_argument("--unique-routers", default="prefix,pow2",
                   help="routers that also run the unique workload (default prefix,pow2)")
    p.add_argument("--prefixes", type=int, help=f"distinct prefixes (default {Sizes.prefixes})")
    p.add_argument("--prefix-tokens", type=int,
                   help=f"tokens per prefix (default {Sizes.prefix_tokens})")
    p.add_argument("--question-tokens", type=int,
                   help=f"tokens per question (default {Sizes.question_tokens})")
    p.add_argument("--requests", type=int,
                   help=f"shared-workload requests (default {Sizes.requests})")
    p.add_argument("--unique-requests", type=int,
                   help=f"unique-workload requests (default {Sizes.unique_requests})")
    p.add_argument("--max-tokens", type=int,
                   help=f"output tokens per request, EOS ignored (default {Sizes.max_tokens})")
    p.add_argument("--concurrency", type=int,
                   help=f"requests in flight (default {Sizes.concurrency})")
    p.add_argument("--kv-cache-tokens", type=int, default=8192,
                   help="KV pool of each replica, in tokens (8192 holds about 5 of the 8 "
                        "default prefixes; default 8192)")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica (default 1)")
    p.add_argument("--model", help="served model (.gguf or HF dir); default: radixserve's")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every `radixserve serve` (repeatable)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the comparison this many times, pooled in the report (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated prompts (default 0)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK.prefixes} prefixes of {QUICK.prefix_tokens} tokens, "
                        f"{QUICK.requests} requests, routers {QUICK_ROUTERS}")
    p.add_argument("--log-dir", type=Path, default=Path("results/bench_replicas-logs"),
                   help="the servers' logs (default results/bench_replicas-logs)")
    p.add_argument("--out", type=Path, default=Path("results/bench_replicas.json"),
                   help="the JSON report (default results/bench_replicas.json)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    routers = _names(args.routers or (QUICK_ROUTERS if args.quick else ",".join(ROUTERS)),
                     ROUTERS, "--routers")
    workloads = _names(args.workloads, WORKLOADS, "--workloads")
    args.unique_routers = _names(args.unique_routers, ROUTERS, "--unique-routers")
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
                 if getattr(args, f.name) is not None}
    sizes = dataclasses.replace(QUICK if args.quick else Sizes(), **overrides)

    cpu = cpu_summary()
    date = time.strftime("%Y-%m-%d %H:%M")
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    settings = {"replicas": args.replicas, "kv_cache_tokens": args.kv_cache_tokens,
                "num_threads": args.num_threads, "model": args.model or "default",
                "serve_args": args.serve_arg, "routers": routers, "workloads": workloads,
                "unique_routers": args.unique_routers, "seed": args.seed, "quick": args.quick,
                "rounds": args.rounds}
    print(f"bench_replicas {date}; CPU {cpu['kind']} ({' '.join(cpu['flags'])}), "
          f"{cpu['cores']} cores; {args.replicas} replicas x {args.num_threads} thread(s), "
          f"KV pool {args.kv_cache_tokens} tokens each", flush=True)
    print(f"shared: {sizes.requests} requests over {sizes.prefixes} prefixes of "
          f"{sizes.prefix_tokens} tokens + {sizes.question_tokens}-token question; unique: "
          f"{sizes.unique_requests} prompts of {sizes.prefix_tokens + sizes.question_tokens} "
          f"tokens; {sizes.max_tokens} out, concurrency {sizes.concurrency}", flush=True)

    bank = WordBank.from_tokenizer(load_tokenizer(args.model or default_model_path()))
    prompts = build_prompts(bank, sizes, args.seed)
    rounds: dict[str, list[dict[str, Any]]] = {router: [] for router in routers}
    failures: dict[str, str] = {}
    for k in range(args.rounds):
        order = routers if k % 2 == 0 else routers[::-1]
        if args.rounds > 1:
            print(f"round {k + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        for router in order:
            name = f"{router}-{k + 1}" if args.rounds > 1 else router
            log_path = args.log_dir / f"server-{name}.log"
            try:
                report = bench_router(router, args, sizes, prompts, workloads, log_path)
            except Exception as exc:  # one router's failure is reported; the others still run
                failures[name] = f"{type(exc).__name__}: {exc}"
                print(f"{name}: FAILED ({failures[name].splitlines()[0]}); log in {log_path}",
                      flush=True)
                continue
            rounds[router].append(report)
            if report.get("serious_log_lines"):
                print(f"  {name}: serious lines in its log: {report['serious_log_lines'][:3]}")
            for workload in workloads:
                if not report.get(workload, {}).get("metrics_settled", True):
                    print(f"  {name}/{workload}: /metrics did not settle in "
                          f"{SETTLE_TIMEOUT_S:.0f} s; per-replica figures may be short")
    results: dict[str, dict[str, Any]] = {}
    for router, reports in rounds.items():
        found = {w: pooled(reports, w) for w in workloads}
        results[router] = {w: v for w, v in found.items() if v is not None}

    print()
    print(table(results, workloads))
    found = ratios(results)
    per_round = round_ratios(rounds) if args.rounds > 1 else []
    for k, one in enumerate(per_round):
        print()
        print(f"round {k + 1}:")
        print_ratios(one)
    print()
    if per_round:
        print(f"pooled over {args.rounds} rounds:")
    print_ratios(found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": date, "command": command, "cpu": cpu, "settings": settings,
        "sizes": dataclasses.asdict(sizes), "results": results, "ratios_vs_pow2": found,
        "ratios_per_round": per_round, "rounds": rounds, "failures": failures},
        indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
