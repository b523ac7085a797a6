"""The prefix cache through HTTP, as a client sees it: chat requests sharing one system prompt,
streamed with the official `openai` SDK, against `radixserve serve` with each cache mode.

For every mode (a fresh server each) and concurrency level, N requests share a system prompt of
exactly --system-tokens tokens (a new one per level, so each level starts cold) followed by a
unique question; outputs are --max-tokens long (EOS ignored). Reports TTFT, time per output
token and end-to-end latency (p50, p99), output tokens/s and the cache hit rate, modes side by
side, and writes JSON.

    python benchmarks/bench_http.py --out results/bench_http.json
    python benchmarks/bench_http.py --concurrency 1,4 --num-requests 8 --system-tokens 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openai

from radixserve.bench.textgen import WordBank
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.testing.server import read_metrics, start_server


@dataclass
class Sample:
    ttft: float
    e2e: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def one_request(client: openai.AsyncOpenAI, model: str, system: str, question: str,
                      max_tokens: int) -> Sample:
    start = time.perf_counter()
    ttft = None
    usage = None
    stream = await client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - start
    if usage is None or ttft is None:
        raise RuntimeError("the stream had no content or no usage")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Sample(ttft, e2e, usage.completion_tokens, usage.prompt_tokens, cached or 0)


async def run_level(base_url: str, model: str, system: str, questions: list[str],
                    concurrency: int, max_tokens: int) -> tuple[list[Sample], float]:
    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0,
                                  timeout=3600) as client:
        async def bounded(question: str) -> Sample:
            async with gate:
                return await one_request(client, model, system, question, max_tokens)

        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(q) for q in questions))
        return list(samples), time.perf_counter() - start


def summarise(mode: str, concurrency: int, samples: list[Sample], wall: float,
              server_delta: dict[str, float]) -> dict[str, Any]:
    tpots = [s.tpot for s in samples if s.tpot is not None]
    queries = server_delta.get("prefix_cache_queries_total", 0.0)
    return {
        "mode": mode,
        "concurrency": concurrency,
        "num_requests": len(samples),
        "ttft_ms": {"p50": 1e3 * percentile([s.ttft for s in samples], 50),
                    "p99": 1e3 * percentile([s.ttft for s in samples], 99)},
        "tpot_ms": {"p50": 1e3 * percentile(tpots, 50), "p99": 1e3 * percentile(tpots, 99)},
        "e2e_s": {"p50": percentile([s.e2e for s in samples], 50),
                  "p99": percentile([s.e2e for s in samples], 99)},
        "output_tokens_per_s": sum(s.completion_tokens for s in samples) / wall,
        # As clients see it (usage), and as the server counted it (/metrics); they agree.
        "cache_hit_rate": sum(s.cached_tokens for s in samples)
        / max(1, sum(s.prompt_tokens for s in samples)),
        "server_cache_hit_rate": server_delta.get("prefix_cache_hits_total", 0.0) / queries
        if queries else 0.0,
        "wall_s": wall,
        "samples": [asdict(s) for s in samples],
    }


def bench_mode(mode: str, args: argparse.Namespace, bank: WordBank, log_dir: Path) -> list[dict[str, Any]]:
    # Admission off: a closed loop at a fixed concurrency measures speed, not refusals
    # (benchmarks/soak.py measures those); --serve-arg flags come later and win.
    serve_args = ["--prefix-cache", mode, "--no-access-log", "--max-queue-wait", "0",
                  "--max-queued-tokens", str(2**30), *args.serve_arg]
    if args.model:
        serve_args += ["--model", args.model, "--served-model-name", "bench"]
    if args.kv_cache_tokens:
        serve_args += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    server = start_server(serve_args, log_dir / f"server-{mode}.log")
    model = "bench" if args.model else "SmolLM2-135M-Instruct"
    results = []
    try:
        for level in args.concurrency:
            rng = random.Random(f"{args.seed}-{level}")
            system = bank.text(rng, args.system_tokens)
            # Distinct first words: the questions share nothing past the system prompt.
            count = args.num_requests or max(8, 2 * level)
            questions = bank.distinct_texts(rng, count, args.question_tokens)
            before = read_metrics(server.base_url)
            samples, wall = asyncio.run(run_level(server.base_url, model, system, questions,
                                                  level, args.max_tokens))
            after = read_metrics(server.base_url)
            delta = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_total")}
            results.append(summarise(mode, level, samples, wall, delta))
            print(f"  {mode} c={level}: {len(samples)} requests in {wall:.1f} s", flush=True)
    finally:
        server.stop()
    return results


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'conc':>4} {'mode':<6} {'reqs':>4} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
            f"{'p99':>7} {'E2E p50':>8} {'p99':>7} {'out tok/s':>9} {'cache hit':>9}")
    lines = [head, "-" * len(head)]
    for r in sorted(results, key=lambda r: (r["concurrency"], r["mode"] != "radix", r["mode"])):
        lines.append(
            f"{r['concurrency']:>4} {r['mode']:<6} {r['num_requests']:>4} "
            f"{r['ttft_ms']['p50']:>7.0f}ms {r['ttft_ms']['p99']:>6.0f}ms "
            f"{r['tpot_ms']['p50']:>7.1f}ms {r['tpot_ms']['p99']:>5.1f}ms "
            f"{r['e2e_s']['p50']:>7.2f}s {r['e2e_s']['p99']:>6.2f}s "
            f"{r['output_tokens_per_s']:>9.1f} {100 * r['cache_hit_rate']:>8.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", default="radix,off", help="prefix-cache modes, one server each")
    p.add_argument("--concurrency", default="1,4,16,64", help="concurrency levels")
    p.add_argument("--num-requests", type=int, default=0,
                   help="requests per level (0: max(8, 2 x concurrency))")
    p.add_argument("--system-tokens", type=int, default=2000, help="shared system prompt length")
    p.add_argument("--question-tokens", type=int, default=32, help="unique question length")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--model", help="served model (.gguf or HF dir); default: radixserve's")
    p.add_argument("--kv-cache-tokens", type=int, help="KV pool of each server, in tokens")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every `radixserve serve` (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    bank = WordBank.from_tokenizer(load_tokenizer(args.model or default_model_path()))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_http-") as tmp:
        for mode in modes:
            print(f"{mode}: starting a server", flush=True)
            results += bench_mode(mode, args, bank, Path(tmp))
    print()
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
