"""What the prefix cache buys, measured on the engine in one run (all ratios side by side).

Scenarios (issue 3): warm vs cold TTFT under a shared 2,000-token system prompt; 16 concurrent
users on one system prompt; a prefix-heavy and a unique workload, radix vs off; multi-turn
and branching-agent reuse, radix vs hash vs off; the engine step's share spent in bookkeeping.

    .venv/bin/python benchmarks/bench_prefix_cache.py --out results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from pathlib import Path

from radixserve import LLM, SamplingParams
from radixserve.engine.engine import LLMEngine


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_closed_loop(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                    concurrency: int) -> dict[str, float]:
    """Keeps `concurrency` requests in flight until all prompts are served."""
    queue = deque(enumerate(prompts))
    inflight: set[str] = set()
    latencies, ttfts, cached, prompt_tokens, out_tokens = [], [], 0, 0, 0
    start = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < concurrency:
            i, prompt = queue.popleft()
            inflight.add(engine.add_request(prompt, params, request_id=f"r{i}"))
        for output in engine.step():
            if output.finished:
                inflight.discard(output.request_id)
                m = output.metrics
                latencies.append(m.finished_time - m.arrival_time)
                ttfts.append(m.first_token_time - m.arrival_time)
                cached += output.num_cached_tokens
                prompt_tokens += len(output.prompt_token_ids)
                out_tokens += len(output.outputs[0].token_ids)
    total = time.perf_counter() - start
    return {
        "total_s": total,
        "output_tokens_per_s": out_tokens / total,
        "p50_latency_s": _percentile(latencies, 50),
        "p99_latency_s": _percentile(latencies, 99),
        "mean_ttft_s": statistics.mean(ttfts),
        "hit_rate": cached / prompt_tokens,
    }


def warm_vs_cold(llm: LLM, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    system = _tokens(rng, args.system_tokens)
    params = SamplingParams(max_tokens=1, temperature=0)
    ttfts = []
    for _ in range(args.questions):
        out = llm.generate({"prompt_token_ids": system + _tokens(rng, 20)}, params, use_tqdm=False)
        m = out[0].metrics
        ttfts.append(m.first_token_time - m.arrival_time)
    cold, warm = ttfts[0], statistics.median(ttfts[1:])
    return {"cold_ttft_s": cold, "warm_ttft_median_s": warm, "warm_over_cold": warm / cold}


def shared_system_users(llm: LLM, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    system = _tokens(rng, args.system_tokens)
    prompts = [system + _tokens(rng, 20) for _ in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    return run_closed_loop(llm.engine, prompts, params, concurrency=16)


def prefix_heavy(llm: LLM, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prefixes = [_tokens(rng, 1500) for _ in range(4)]
    prompts = [prefixes[i % 4] + _tokens(rng, 30) for i in range(64)]
    rng.shuffle(prompts)
    return run_closed_loop(llm.engine, prompts, SamplingParams(max_tokens=32, temperature=0,
                                                               ignore_eos=True), concurrency=8)


def unique(llm: LLM, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [_tokens(rng, 400) for _ in range(32)]
    return run_closed_loop(llm.engine, prompts, SamplingParams(max_tokens=32, temperature=0,
                                                               ignore_eos=True), concurrency=8)


def conversations(llm: LLM, seed: int) -> dict[str, float]:
    """Multi-turn chats and branching agent histories; returns the fraction of tokens hit."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    hit = total = 0
    for _ in range(4):  # multi-turn: each turn resends the history plus the real reply
        history = _tokens(rng, 300)
        for _ in range(4):
            history = history + _tokens(rng, 37)
            out = llm.generate({"prompt_token_ids": history}, params, use_tqdm=False)[0]
            hit, total = hit + out.num_cached_tokens, total + len(history)
            history = history + out.outputs[0].token_ids
    for _ in range(4):  # agent: one trunk, branches that diverge at odd offsets
        trunk = _tokens(rng, 500 + rng.randrange(16))
        for _ in range(4):
            branch = trunk + _tokens(rng, 45)
            out = llm.generate({"prompt_token_ids": branch}, params, use_tqdm=False)[0]
            hit, total = hit + out.num_cached_tokens, total + len(branch)
            trunk = branch[: len(trunk) + rng.randrange(5, 40)]
    return {"hit_rate": hit / total, "hit_tokens": hit, "prompt_tokens": total}


def bookkeeping_share(llm: LLM, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    system = _tokens(rng, 500)
    prompts = [system + _tokens(rng, 30) for _ in range(64)]
    engine = llm.engine
    engine.bookkeeping_seconds = engine.model_seconds = 0.0
    run_closed_loop(engine, prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                    concurrency=64)
    total = engine.bookkeeping_seconds + engine.model_seconds
    return {"bookkeeping_s": engine.bookkeeping_seconds, "model_s": engine.model_seconds,
            "bookkeeping_share": engine.bookkeeping_seconds / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--kv-cache-tokens", type=int, default=40000)
    parser.add_argument("--out", default="results/prefix_cache.json")
    args = parser.parse_args()
    common = dict(kv_cache_tokens=args.kv_cache_tokens, show_progress=False, max_num_seqs=64)
    report: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M")}
    radix = LLM(args.model, prefix_cache="radix", **common)
    off = LLM(args.model, prefix_cache="off", **common)
    report["warm_vs_cold"] = warm_vs_cold(radix, random.Random(1), args)
    print("warm vs cold", report["warm_vs_cold"], flush=True)
    report["users16_radix"] = shared_system_users(radix, random.Random(2), args)
    report["users16_off"] = shared_system_users(off, random.Random(2), args)
    print("16 users", report["users16_radix"], report["users16_off"], flush=True)
    # The two modes alternate, twice each, and the faster run of each counts: the machine's
    # noise then hits both sides alike.
    for name, workload in (("prefix_heavy", prefix_heavy), ("unique", unique)):
        runs: dict[str, list[dict[str, float]]] = {"radix": [], "off": []}
        for _ in range(2):
            for mode, llm in (("radix", radix), ("off", off)):
                llm.engine.cache.reset()
                runs[mode].append(workload(llm, 3))
        for mode in runs:
            report[f"{name}_{mode}"] = min(runs[mode], key=lambda r: r["total_s"])
        print(name, report[f"{name}_radix"], report[f"{name}_off"], flush=True)
    report["conversations_radix"] = conversations(radix, 5)
    report["conversations_off"] = conversations(off, 5)
    report["bookkeeping_radix"] = bookkeeping_share(radix, 6)
    print("bookkeeping", report["bookkeeping_radix"], flush=True)
    del off
    hashed = LLM(args.model, prefix_cache="hash", page_size=16, **common)
    report["conversations_hash16"] = conversations(hashed, 5)
    report["ratios"] = {
        "warm_over_cold_ttft": report["warm_vs_cold"]["warm_over_cold"],  # type: ignore[index]
        "prefix_heavy_speedup_radix_vs_off":
            report["prefix_heavy_off"]["total_s"] / report["prefix_heavy_radix"]["total_s"],  # type: ignore[index]
        "unique_overhead_radix_vs_off":
            report["unique_radix"]["total_s"] / report["unique_off"]["total_s"] - 1,  # type: ignore[index]
        "users16_throughput_radix_vs_off":
            report["users16_radix"]["output_tokens_per_s"] / report["users16_off"]["output_tokens_per_s"],  # type: ignore[index]
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
