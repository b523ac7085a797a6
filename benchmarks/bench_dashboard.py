"""What the cache dashboard costs the server: GET /v1/cache/stats at 1k / 10k / 100k radix-tree
nodes, and the engine's step time while the endpoint is polled once a second versus not.

1. Endpoint cost: a tree of N nodes shaped like real traffic (tenants, each with a few shared
   system prompts and many conversations of several turns under them, a fraction of them hit
   again), and a "wide" one (one prefix with N children), is built directly on a RadixCache
   and swapped into a real engine; the endpoint is called in-process (ASGI, no sockets). Reports the whole call and the part that runs on the
   engine thread (the tree summary and the snapshot), which is what could delay a step.
2. Polling overhead: the same chat workload (shared system prompt, concurrent requests) runs
   on the default model with the endpoint polled every second and without, alternating; with
   the tree pre-filled to --poll-tree-nodes nodes. Reports the engine's time per step (step to
   step, so work done between steps counts) and the median ratio polled / not polled.

    .venv/bin/python benchmarks/bench_dashboard.py --out results/bench_dashboard.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from radixserve.cache import RadixCache
from radixserve.config import EngineConfig
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import LLMEngine
from radixserve.engine.kv_pool import PageAllocator
from radixserve.server.app import create_app
from radixserve.server.observability.metrics import take_snapshot
from radixserve.server.observability.stats_routes import TREE_NODES_SHOWN, TREE_NODES_VISITED

VOCAB = 49_152


def fill_tree(cache: RadixCache, nodes: int, model: str, pool: PageAllocator | None,
              seed: int = 0) -> None:
    """Tenants x system prompts x conversations of up to 3 turns, until the tree has `nodes`
    nodes; slots from `pool` (an engine's, so that it can evict them) or fakes without one."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(100, 400))] for _ in range(60)]
    while cache.stats().nodes < nodes:
        tenant = rng.randrange(20)
        namespace = (model, f"tenant-{tenant}")
        tokens = list(systems[tenant * 3 + rng.randrange(3)])
        for _ in range(rng.randrange(1, 4)):  # a conversation's turns extend its prefix
            tokens += [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 6))]
            slots = pool.allocate(len(tokens)) if pool is not None else [0] * len(tokens)
            result = cache.insert(namespace, tokens, slots)
            if pool is not None:  # the caller frees what the cache already held
                pool.release([s for s, c in zip(slots, result.slots, strict=True) if s != c])
            if rng.random() < 0.3:  # this prefix is hit again by a later request
                cache.record_use(result.handle)


def fill_wide(cache: RadixCache, nodes: int, model: str) -> None:
    """The worst shape for the summary: one shared prefix with `nodes` children."""
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(300)]
    for i in range(nodes):
        tokens = [*shared, rng.randrange(VOCAB), i]
        result = cache.insert((model, None), tokens, [0] * len(tokens))
        if i % 3 == 0:
            cache.record_use(result.handle)


def median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_endpoint(engine: LLMEngine, aengine: AsyncEngine, sizes: list[int],
                   repeat: int) -> list[dict[str, Any]]:
    app = create_app(aengine)
    real_cache = engine.cache
    rows = []
    for size, shape in [*((size, "traffic") for size in sizes), (max(sizes), "wide")]:
        cache = RadixCache(1, release=lambda slots: None)
        if shape == "traffic":
            fill_tree(cache, size, engine.config.model or "", None)
        else:
            fill_wide(cache, size, engine.config.model or "")
        engine.cache = cache  # only read by the snapshot and the summary: nothing generates
        row = {"shape": shape, **endpoint_row(app, engine, cache, repeat)}
        print(f"  {row['tree_nodes']:>7} nodes ({shape}): endpoint {row['endpoint_ms']:6.2f} ms, "
              f"of which engine thread {row['engine_thread_ms']:5.2f} ms", flush=True)
        rows.append(row)
    engine.cache = real_cache
    return rows


def endpoint_row(app: Any, engine: LLMEngine, cache: RadixCache, repeat: int) -> dict[str, Any]:
    def summary() -> None:  # what the endpoint runs on the engine thread
        cache.top_prefixes(TREE_NODES_SHOWN, TREE_NODES_VISITED)
        take_snapshot(engine)

    async def calls() -> float:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                response = await http.get("/v1/cache/stats")
                times.append((time.perf_counter() - start) * 1e3)
                response.raise_for_status()
            body = response.json()
            assert body["tree"]["nodes"] == cache.stats().nodes and body["tree"]["shown"]
            return statistics.median(times)

    return {"tree_nodes": cache.stats().nodes, "engine_thread_ms": median_ms(summary, repeat),
            "endpoint_ms": asyncio.run(calls())}


async def one_run(app: Any, engine: LLMEngine, args: argparse.Namespace, run: int,
                  poll: bool) -> dict[str, float]:
    """The workload once (the system prompt cached since the warm-up, new questions: the same
    work every run); the engine's time per step, step start to step start."""
    starts: list[float] = []
    step = engine.step

    def timed_step() -> Any:
        starts.append(time.perf_counter())
        return step()

    engine.step = timed_step  # type: ignore[method-assign]
    # Engine-thread time in calls run between steps (the pool sampler's snapshots, and the
    # endpoint's summary when polled): the direct cost of the stats, without the noise.
    aengine, between = app.state.radixserve.aengine, [0.0]
    run_on_engine = aengine.run

    async def timed_run(fn: Any) -> Any:
        def timed(engine: LLMEngine) -> Any:
            start = time.perf_counter()
            try:
                return fn(engine)
            finally:
                between[0] += time.perf_counter() - start
        return await run_on_engine(timed)

    aengine.run = timed_run
    rng = random.Random(0)
    system = " ".join(f"rule{rng.randrange(10_000)}" for _ in range(150))
    transport = httpx.ASGITransport(app=app)
    polls = 0
    async with httpx.AsyncClient(transport=transport, base_url="http://bench",
                                 timeout=600) as http:
        async def request(i: int) -> None:
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": args.max_tokens,
                    "ignore_eos": True, "temperature": 0,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Run {run}, question {i}."}]}
            (await http.post("/v1/chat/completions", json=body)).raise_for_status()

        async def poller() -> None:
            nonlocal polls
            while True:
                (await http.get("/v1/cache/stats")).raise_for_status()
                polls += 1
                await asyncio.sleep(1.0)

        limit = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> None:
            async with limit:
                await request(i)

        poll_task = asyncio.create_task(poller()) if poll else None
        start = time.perf_counter()
        await asyncio.gather(*(limited(i) for i in range(args.num_requests)))
        wall = time.perf_counter() - start
        if poll_task is not None:
            poll_task.cancel()
    engine.step = step  # type: ignore[method-assign]
    del aengine.run  # back to the class's method
    periods = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    return {"step_ms": statistics.median(periods) * 1e3, "mean_step_ms": statistics.fmean(
        periods) * 1e3, "steps": len(starts), "wall_s": wall, "polls": polls,
        "between_steps_ms_per_s": between[0] / wall * 1e3}


def bench_polling(engine: LLMEngine, aengine: AsyncEngine,
                  args: argparse.Namespace) -> dict[str, Any]:
    fill_tree(engine.cache, args.poll_tree_nodes, engine.config.model or "",  # type: ignore[arg-type]
              engine.pool.allocator, seed=1)
    app = create_app(aengine)
    runs: list[dict[str, Any]] = []

    async def all_runs() -> None:
        async with app.router.lifespan_context(app):  # the pool sampler runs in both arms
            await one_run(app, engine, args, 0, poll=False)  # warm-up
            for pair in range(args.pairs):
                order = (False, True) if pair % 2 == 0 else (True, False)
                for poll in order:
                    result = await one_run(app, engine, args, len(runs) + 1, poll)
                    runs.append({"pair": pair, "polled": poll, **result})
                    print(f"  pair {pair} {'polled    ' if poll else 'not polled'}: "
                          f"{result['mean_step_ms']:6.2f} ms/step (median "
                          f"{result['step_ms']:6.2f}), {result['steps']} steps, "
                          f"{result['wall_s']:5.1f} s, {result['polls']} polls, engine "
                          f"thread between steps {result['between_steps_ms_per_s']:.2f} ms/s",
                          flush=True)

    asyncio.run(all_runs())
    ratios = []
    for pair in range(args.pairs):
        polled, plain = (next(r for r in runs if r["pair"] == pair and r["polled"] is p)
                         for p in (True, False))
        ratios.append(polled["mean_step_ms"] / plain["mean_step_ms"])
    ratio = statistics.median(ratios)
    direct = [statistics.median(r["between_steps_ms_per_s"] for r in runs if r["polled"] is p)
              for p in (True, False)]
    print(f"  tree {engine.cache.stats().nodes} nodes; step time polled / not polled: median "
          f"ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%) over {args.pairs} pairs; engine "
          f"thread taken by the polls: {direct[0] - direct[1]:.2f} ms/s "
          f"({(direct[0] - direct[1]) / 10:.3f}% of its time)", flush=True)
    return {"tree_nodes": engine.cache.stats().nodes, "runs": runs, "ratios": ratios,
            "median_ratio": ratio, "poll_engine_ms_per_s": direct[0] - direct[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--poll-tree-nodes", type=int, default=10_000)
    parser.add_argument("--kv-cache-tokens", type=int, default=98_304)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    aengine = AsyncEngine(lambda: LLMEngine(EngineConfig(
        kv_cache_tokens=args.kv_cache_tokens, show_progress=False, num_threads=args.num_threads)))
    engine = aengine.engine
    try:
        print("GET /v1/cache/stats, median of", args.repeat, "calls:", flush=True)
        endpoint = bench_endpoint(engine, aengine, [int(s) for s in args.sizes.split(",")],
                                  args.repeat)
        print(f"engine step time, {args.num_requests} requests x {args.max_tokens} tokens at "
              f"concurrency {args.concurrency}, stats polled every 1 s vs not:", flush=True)
        polling = bench_polling(engine, aengine, args)
    finally:
        aengine.shutdown()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                        "endpoint": endpoint, "polling": polling,
                                        "args": {k: str(v) for k, v in vars(args).items()}},
                                       indent=2))


if __name__ == "__main__":
    main()
