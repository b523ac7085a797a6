"""What the disk KV tier buys and costs, measured on the engine in one run (issue 14).

Scenarios: a working set four times the pool, tier vs none; TTFT after a restart, with the
tier's files in the page cache and read from disk; the tier's load speed vs prefill; the
writer's overhead on unique prompts (tier on and off alternated); the index rebuild at start
for 100k blocks. Every tier directory is a fresh temporary one, removed afterwards. "From
disk" means after a drop of the page cache: as root, the whole machine's (drop_caches), else
the tier files' own pages (fadvise); the report says which, and how much stayed resident.

    .venv/bin/python benchmarks/bench_kv_tier.py --out results/kv_tier.json
    .venv/bin/python benchmarks/bench_kv_tier.py --quick --out /tmp/kv_tier_quick.json
    .venv/bin/python benchmarks/bench_kv_tier.py --only restart load_speed
    .venv/bin/python benchmarks/bench_kv_tier.py --only writer_overhead --pairs 7
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import mmap
import os
import random
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from timing import cpu_summary

from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.kv_tier.blocks import ModelFingerprint, chain_keys
from radixserve.kv_tier.entry import EntryHeader, write_entry
from radixserve.kv_tier.store import TierStore
from radixserve.sequences import namespace_bytes

SCENARIOS = ("working_set", "restart", "load_speed", "writer_overhead", "index_rebuild")


@dataclass(frozen=True)
class Sizes:
    """Every scenario's size; QUICK shrinks them all for a smoke run."""

    prefix_tokens: int = 2000
    question_tokens: int = 30
    prefixes: int = 16  # the working set, cycled
    pool_prefixes: int = 4  # how many the pool holds
    requests: int = 128
    concurrency: int = 4
    output_tokens: int = 32
    loads: int = 3  # load-speed repeats, each from the page cache and from disk
    unique_prompts: int = 32
    unique_tokens: int = 1000
    unique_output_tokens: int = 16
    pairs: int = 3  # writer overhead: (off, on) runs
    index_blocks: int = 100_000


QUICK = Sizes(prefix_tokens=320, prefixes=6, pool_prefixes=2, requests=12, concurrency=2,
              output_tokens=8, loads=1, unique_prompts=6, unique_tokens=200,
              unique_output_tokens=4, pairs=3, index_blocks=5_000)


@dataclass(frozen=True)
class Served:
    """One finished request, as RequestMetrics tell it."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


# ----- helpers -----


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _pool_tokens(s: Sizes) -> int:
    """A pool that holds `pool_prefixes` whole requests, plus the question and output of each
    request in flight (the decode room of the concurrency)."""
    request = s.prefix_tokens + s.question_tokens + s.output_tokens
    return s.pool_prefixes * request + s.concurrency * (s.question_tokens + s.output_tokens)


def _engine(args: argparse.Namespace, kv_cache_tokens: int, tier_dir: str | None,
            warm_up_tokens: int) -> LLMEngine:
    """An engine whose first steps are behind it: they pay one-time costs (allocations, kernel
    set-up) that are no part of either side of a comparison. An unrelated prompt of the
    scenario's length takes them, computed and then hit; then it leaves the pool."""
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype="float32", num_threads=args.threads,
        kv_cache_tokens=kv_cache_tokens, kv_offload_dir=tier_dir,
        kv_offload_block_tokens=args.block_tokens, kv_offload_queue_mb=args.queue_mb,
        kv_offload_gb=args.tier_gb, show_progress=False))
    rng = random.Random("warm-up")  # no scenario's seed: Random(-1) would equal Random(1)
    warm_up = _tokens(rng, warm_up_tokens)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for _ in range(2):
        _serve(engine, [warm_up + _tokens(rng, 8)], params, 1)
    _flush_seconds(engine)
    engine.cache.reset()
    return engine


def _serve(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
           concurrency: int) -> tuple[float, list[Served]]:
    """Keeps `concurrency` requests in flight until all prompts are served; the total time."""
    queue = deque(enumerate(prompts))
    inflight: set[str] = set()
    served: list[Served] = []
    start = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < concurrency:
            i, prompt = queue.popleft()
            inflight.add(engine.add_request(prompt, params, request_id=f"r{i}"))
        for output in engine.step():
            if output.finished:
                inflight.discard(output.request_id)
                m = output.metrics
                assert m is not None and m.first_token_time is not None
                served.append(Served(m.first_token_time - m.arrival_time,
                                     len(output.prompt_token_ids), output.num_cached_tokens))
    return time.perf_counter() - start, served


def _tier_counters(engine: LLMEngine) -> dict[str, float]:
    """The tier's cumulative figures (zeros without a tier), for deltas around a run."""
    figures = {"tier_hit_tokens": float(engine.scheduler.counters.kv_tier_hits)}
    if engine.offload is not None:
        c = engine.offload.store.stats().counters
        figures.update(bytes_written=c.bytes_written, bytes_read=c.bytes_read,
                       dropped_writes=c.dropped_writes, load_count=c.load_count,
                       load_seconds=c.load_seconds, errors=sum(c.errors.values()))
    return figures


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0) for key, value in after.items()}


def _flush_seconds(engine: LLMEngine) -> float:
    """Waits for the tier's queued writes; how long that took (0 without a tier)."""
    started = time.perf_counter()
    if engine.offload is not None:
        engine.offload.store.flush()
    return time.perf_counter() - started


def _summary(total_s: float, served: list[Served], tier: dict[str, float]) -> dict[str, float]:
    ttfts = [r.ttft_s for r in served]
    return {
        "total_s": total_s,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "hit_rate": sum(r.cached_tokens for r in served) / sum(r.prompt_tokens for r in served),
        **tier,
    }


def _tier_files(tier_dir: str) -> list[str]:
    return glob.glob(os.path.join(tier_dir, "**", "*.kv"), recursive=True)


def _drop_all_caches() -> bool:
    """Empties the OS page cache (and its directory caches) through drop_caches, where this
    process may (root, a writable /proc); whether it did."""
    os.sync()  # dirty pages cannot be dropped
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def _drop_page_cache(paths: list[str]) -> str:
    """Evicts the files from the OS page cache: all of it where this process may, else each
    file's pages by fadvise. Returns how."""
    if _drop_all_caches():
        return "drop_caches"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def _resident_fraction(paths: list[str]) -> float | None:
    """The fraction of the files' pages in the OS page cache (mincore); None where it cannot
    be asked. Says whether a drop took, and whether a load then read the disk."""
    libc = ctypes.CDLL(None, use_errno=True)
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        pages = -(-size // mmap.PAGESIZE)
        if not pages:
            continue
        vec = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            view = ctypes.c_char.from_buffer(mm)  # a private mapping: touching nothing reads
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vec)
            del view  # the mapping cannot close while exported
        if rc != 0:
            return None
        resident += sum(v & 1 for v in vec)
        total += pages
    return resident / total if total else None


def _verdict(value: float, target: float, at_least: bool) -> str:
    met = value >= target if at_least else value <= target
    return "met" if met else "NOT met"


def _temp_dir(args: argparse.Namespace, name: str) -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix=f"bench-kv-tier-{name}-", dir=args.tmp_dir)


# ----- the scenarios -----


def working_set(args: argparse.Namespace, s: Sizes) -> dict[str, Any]:
    """16 prefixes cycled through a pool that holds 4: without the tier every one misses."""
    rng = random.Random(args.seed)
    prefixes = [_tokens(rng, s.prefix_tokens) for _ in range(s.prefixes)]
    prompts = [prefixes[i % s.prefixes] + _tokens(rng, s.question_tokens)
               for i in range(s.requests)]
    params = SamplingParams(max_tokens=s.output_tokens, temperature=0, ignore_eos=True)
    pool = _pool_tokens(s)
    print(f"working set: {s.prefixes} prefixes of {s.prefix_tokens} tokens cycled by "
          f"{s.requests} requests (+{s.question_tokens}-token question, {s.output_tokens} out), "
          f"concurrency {s.concurrency}; pool {pool} tokens = {s.pool_prefixes} x "
          f"({s.prefix_tokens}+{s.question_tokens}+{s.output_tokens}) + {s.concurrency} x "
          f"({s.question_tokens}+{s.output_tokens})", flush=True)
    report: dict[str, Any] = {"pool_tokens": pool}
    for mode in ("without", "with"):
        with _temp_dir(args, "ws") as tier_dir:
            engine = _engine(args, pool, tier_dir if mode == "with" else None, len(prompts[0]))
            before = _tier_counters(engine)
            total, served = _serve(engine, prompts, params, s.concurrency)
            tier = _delta(_tier_counters(engine), before)
            report[mode] = {**_summary(total, served, tier), "flush_s": _flush_seconds(engine)}
            engine.close()
        r = report[mode]
        print(f"  {mode:>7} tier: total {r['total_s']:.1f} s, TTFT p50 {r['ttft_p50_s']:.3f} s "
              f"p99 {r['ttft_p99_s']:.3f} s, hit rate {r['hit_rate']:.1%}, tier hit tokens "
              f"{r['tier_hit_tokens']:.0f}", flush=True)
    speedup = report["without"]["total_s"] / report["with"]["total_s"]
    ttft_pct = 100 * report["with"]["ttft_p50_s"] / report["without"]["ttft_p50_s"]
    report["speedup"] = speedup
    report["ttft_p50_pct_of_cold"] = ttft_pct
    print(f"  total time without/with {speedup:.2f}x (target >= 3x: "
          f"{_verdict(speedup, 3, True)}); TTFT p50 with = {ttft_pct:.1f}% of cold (target "
          f"<= 15%: {_verdict(ttft_pct, 15, False)})", flush=True)
    return report


def restart(args: argparse.Namespace, s: Sizes) -> dict[str, Any]:
    """Engine A computes a prefix and closes; engine B on the same directory serves it again,
    once with the tier's files in the page cache and once read from disk."""
    rng = random.Random(args.seed + 1)
    prefix = _tokens(rng, s.prefix_tokens)
    params = SamplingParams(max_tokens=1, temperature=0)
    pool = 2 * (s.prefix_tokens + s.question_tokens + 8)
    prompt_tokens = s.prefix_tokens + s.question_tokens
    report: dict[str, Any] = {}
    with _temp_dir(args, "restart") as tier_dir:
        engine = _engine(args, pool, tier_dir, prompt_tokens)
        warm_up_files = set(_tier_files(tier_dir))
        _, (cold,) = _serve(engine, [prefix + _tokens(rng, s.question_tokens)], params, 1)
        engine.close()
        files = sorted(set(_tier_files(tier_dir)) - warm_up_files)  # the prefix's blocks
        report.update(cold_ttft_s=cold.ttft_s, cold_cached_tokens=cold.cached_tokens)
        print(f"restart: {s.prefix_tokens}-token prefix; engine A (cold) TTFT "
              f"{cold.ttft_s:.3f} s", flush=True)
        for where in ("page_cache", "disk"):
            run: dict[str, Any] = {}
            if where == "disk":
                run["drop"] = _drop_page_cache(files)
            engine = _engine(args, pool, tier_dir, prompt_tokens)
            run["resident_before"] = _resident_fraction(files)
            before = _tier_counters(engine)
            _, (hit,) = _serve(engine, [prefix + _tokens(rng, s.question_tokens)], params, 1)
            run.update(_delta(_tier_counters(engine), before), ttft_s=hit.ttft_s,
                       ttft_pct_of_cold=100 * hit.ttft_s / cold.ttft_s)
            engine.close()
            report[where] = run
            dropped = f", drop by {run['drop']}" if where == "disk" else ""
            resident = run["resident_before"]
            print(f"  engine B, files from the {where.replace('_', ' ')}{dropped} (resident "
                  f"{'?' if resident is None else f'{resident:.0%}'}): TTFT {hit.ttft_s:.3f} s "
                  f"= {run['ttft_pct_of_cold']:.1f}% of cold (target <= 15%: "
                  f"{_verdict(run['ttft_pct_of_cold'], 15, False)}), tier hit tokens "
                  f"{run['tier_hit_tokens']:.0f}, load {run['load_seconds']:.3f} s",
                  flush=True)
    return report


def load_speed(args: argparse.Namespace, s: Sizes) -> dict[str, Any]:
    """The time the tier takes to load a prefix (kv_tier_load_seconds: read, check, copy into
    the pool) against the time to prefill it, from the page cache and from disk."""
    rng = random.Random(args.seed + 2)
    prefix = _tokens(rng, s.prefix_tokens)
    params = SamplingParams(max_tokens=1, temperature=0)
    runs: dict[str, list[dict[str, float]]] = {"page_cache": [], "disk": []}
    with _temp_dir(args, "load") as tier_dir:
        prompt_tokens = s.prefix_tokens + s.question_tokens
        engine = _engine(args, 2 * (prompt_tokens + 8), tier_dir, prompt_tokens)
        _, (cold,) = _serve(engine, [prefix + _tokens(rng, s.question_tokens)], params, 1)
        _flush_seconds(engine)
        drop = "none"
        for _ in range(s.loads):
            for where in runs:
                if where == "disk":
                    drop = _drop_page_cache(_tier_files(tier_dir))
                engine.cache.reset()  # the prefix leaves the pool: the tier must serve it
                before = _tier_counters(engine)
                _, (hit,) = _serve(engine, [prefix + _tokens(rng, s.question_tokens)], params, 1)
                run = _delta(_tier_counters(engine), before)
                runs[where].append({**run, "ttft_s": hit.ttft_s})
        engine.close()
    report: dict[str, Any] = {"prefill_s": cold.ttft_s, "cold_cached_tokens": cold.cached_tokens,
                              "drop": drop, "runs": runs}
    print(f"load speed: prefill of {s.prefix_tokens}+{s.question_tokens} tokens (cold TTFT) "
          f"{cold.ttft_s:.3f} s", flush=True)
    for where, found in runs.items():
        load_s = statistics.median(r["load_seconds"] / max(r["load_count"], 1) for r in found)
        bytes_read = statistics.median(r["bytes_read"] for r in found)
        report[where] = {"load_s": load_s, "bytes_read": bytes_read,
                         "gb_per_s": bytes_read / load_s / 1e9 if load_s else None,
                         "load_pct_of_prefill": 100 * load_s / cold.ttft_s,
                         "ttft_s": statistics.median(r["ttft_s"] for r in found)}
        r = report[where]
        how = f" (drop by {drop})" if where == "disk" else ""
        print(f"  from the {where.replace('_', ' ')}{how}: load {load_s:.3f} s for "
              f"{bytes_read / 1e6:.1f} MB = {r['gb_per_s'] or 0:.2f} GB/s, "
              f"{r['load_pct_of_prefill']:.1f}% of prefill; TTFT {r['ttft_s']:.3f} s "
              f"(median of {len(found)})", flush=True)
    return report


def writer_overhead(args: argparse.Namespace, s: Sizes) -> dict[str, Any]:
    """Unique prompts (nothing to hit), tier off vs on, alternated so the machine's swings
    hit both sides: the cost of copying out and writing every block."""
    params = SamplingParams(max_tokens=s.unique_output_tokens, temperature=0, ignore_eos=True)
    pool = 2 * s.concurrency * (s.unique_tokens + s.unique_output_tokens)
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with _temp_dir(args, "writer") as tier_dir:
        engines = {mode: _engine(args, pool, tier_dir if mode == "on" else None, s.unique_tokens)
                   for mode in ("off", "on")}
        for pair in range(s.pairs):
            rng = random.Random(args.seed + 100 + pair)  # fresh prompts: no hit from a pair before
            prompts = [_tokens(rng, s.unique_tokens) for _ in range(s.unique_prompts)]
            for mode, engine in engines.items():
                engine.cache.reset()
                before = _tier_counters(engine)
                total, served = _serve(engine, prompts, params, s.concurrency)
                flush = _flush_seconds(engine)  # outside the total: no spill into the next run
                run = _summary(total, served, _delta(_tier_counters(engine), before))
                runs[mode].append({**run, "flush_s": flush})
            print(f"  pair {pair + 1}: off {runs['off'][-1]['total_s']:.2f} s, on "
                  f"{runs['on'][-1]['total_s']:.2f} s", flush=True)
        for engine in engines.values():
            engine.close()
    ratios = [on["total_s"] / off["total_s"] for off, on in zip(runs["off"], runs["on"],
                                                                 strict=True)]
    median = statistics.median(ratios)
    last_on = runs["on"][-1]
    print(f"writer overhead: {s.unique_prompts} unique {s.unique_tokens}-token prompts, "
          f"concurrency {s.concurrency}, {s.unique_output_tokens} out: on/off total time "
          f"{' '.join(f'{r:.3f}' for r in ratios)}, median {median:.3f} (target <= 1.03: "
          f"{_verdict(median, 1.03, False)}); per on run {last_on['bytes_written'] / 1e6:.0f} "
          f"MB written, {last_on['dropped_writes']:.0f} writes dropped, flush after "
          f"{last_on['flush_s']:.2f} s", flush=True)
    return {"pool_tokens": pool, "runs": runs, "ratios": ratios, "median_ratio": median}


def index_rebuild(args: argparse.Namespace, s: Sizes) -> dict[str, Any]:
    """A fresh TierStore's scan of a directory of `index_blocks` small entries."""
    shape = (1, 2, 1, 4, 8)
    fingerprint = ModelFingerprint(weights="synthetic", dtype="float32", quantization="none",
                                   projections="none", attention="none", num_layers=1,
                                   num_kv_heads=1, head_dim=8, page_size=1, block_tokens=4)
    payload = memoryview(torch.zeros(shape).view(torch.uint8).numpy()).cast("B")
    tokens = _tokens(random.Random(args.seed + 3), s.index_blocks * 4)
    namespace = namespace_bytes(None)
    keys = chain_keys(fingerprint.digest, namespace, tokens, 4)
    report: dict[str, Any] = {"blocks": s.index_blocks}
    with _temp_dir(args, "index") as root:
        empty_store = TierStore(root, fingerprint, capacity_bytes=10**12, queue_bytes=1 << 20)
        started = time.perf_counter()
        # Written straight into the store's layout: the writer thread would take longer.
        made: set[str] = set()
        for j, key in enumerate(keys):
            path = empty_store.path(key)
            if (folder := os.path.dirname(path)) not in made:
                os.makedirs(folder, exist_ok=True)
                made.add(folder)
            header = EntryHeader(key=key.hex(), parent=(keys[j - 1] if j else fingerprint.digest)
                                 .hex(), fingerprint=fingerprint.name, namespace=namespace.decode(),
                                 start=4 * j, tokens=tuple(tokens[4 * j : 4 * j + 4]),
                                 dtype="float32", shape=shape, created=time.time())
            write_entry(path, header, payload)
        report["write_s"] = time.perf_counter() - started
        empty_store.close()
        scans = {"warm": TierStore(root, fingerprint, 10**12, 1 << 20)}
        report["dropped_caches"] = _drop_all_caches()
        if report["dropped_caches"]:  # the directory's metadata itself left memory
            scans["after_drop"] = TierStore(root, fingerprint, 10**12, 1 << 20)
        for name, store in scans.items():
            store.close()
            report[name] = {"scan_s": store.scan_seconds, "entries": store.stats().entries,
                            "us_per_block": store.scan_seconds / s.index_blocks * 1e6}
        removing = time.perf_counter()
    report["remove_s"] = time.perf_counter() - removing
    print(f"index rebuild: {s.index_blocks} blocks written in {report['write_s']:.1f} s; "
          + "; ".join(f"scan ({name}) {report[name]['scan_s']:.3f} s = "
                      f"{report[name]['us_per_block']:.1f} us/block, "
                      f"{report[name]['entries']} entries" for name in scans), flush=True)
    return report


# ----- the command -----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--block-tokens", type=int, default=64, help="kv_offload_block_tokens")
    parser.add_argument("--queue-mb", type=float, default=512.0, help="kv_offload_queue_mb")
    parser.add_argument("--tier-gb", type=float, default=10.0, help="kv_offload_gb")
    parser.add_argument("--tmp-dir", default="/tmp", help="where the tier directories go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="every scenario shrunk (smoke run)")
    parser.add_argument("--pairs", type=int, default=None,
                        help=f"writer overhead: alternated (off, on) runs (default {Sizes.pairs}); "
                             "the machine's drift between runs is wider than the effect")
    parser.add_argument("--out", default="results/kv_tier.json")
    args = parser.parse_args()
    sizes = QUICK if args.quick else Sizes()
    if args.pairs is not None:
        if args.pairs < 1:
            parser.error("--pairs must be at least 1")
        sizes = replace(sizes, pairs=args.pairs)
    cpu = cpu_summary()
    settings = {"model": args.model or "default (SmolLM2-135M-Instruct Q4_1)",
                "dtype": "float32", "threads": args.threads, "block_tokens": args.block_tokens,
                "queue_mb": args.queue_mb, "tier_gb": args.tier_gb, "tmp_dir": args.tmp_dir,
                "quick": args.quick}
    date = time.strftime("%Y-%m-%d %H:%M")
    print(f"bench_kv_tier {date}; CPU {cpu['kind']} ({' '.join(cpu['flags'])}), {cpu['cores']} "
          f"cores; " + ", ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
    report: dict[str, Any] = {"date": date, "cpu": cpu, "settings": settings,
                              "sizes": asdict(sizes)}
    scenarios = {"working_set": working_set, "restart": restart, "load_speed": load_speed,
                 "writer_overhead": writer_overhead, "index_rebuild": index_rebuild}
    for name in SCENARIOS:
        if name in args.only:
            report[name] = scenarios[name](args, sizes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
