"""Prefix-cache data-structure speed: match and insert of a 2,000-token key into a cache holding
over 100k tokens, and eviction of 10k leaves, in microseconds per operation, per mode and page
size. No model, no KV tensors: only the slot bookkeeping the scheduler pays for on every step.

    .venv/bin/python benchmarks/bench_cache_ops.py --out results/cache_ops.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from radixserve.cache import PrefixCache, make_prefix_cache
from radixserve.engine.kv_pool import PageAllocator

KEY_TOKENS = 2_000
VOCAB = 49_152


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _fresh(mode: str, page_size: int, pool_tokens: int) -> tuple[PrefixCache, PageAllocator]:
    pool = PageAllocator(pool_tokens // page_size, page_size)
    return make_prefix_cache(mode, page_size, pool.release), pool


def _put(cache: PrefixCache, pool: PageAllocator, tokens: list[int]) -> None:
    slots = pool.allocate(len(tokens) // cache.page_size)
    result = cache.insert(None, tokens, slots)
    duplicates = [s for s, c in zip(slots, result.slots, strict=True) if s != c]
    if duplicates:
        pool.release(duplicates)


def _per_op_us(op: Callable[[int], object], count: int) -> dict[str, float]:
    times = []
    for i in range(count):
        start = time.perf_counter()
        op(i)
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return {
        "median_us": statistics.median(times),
        "p90_us": times[int(0.9 * (len(times) - 1))],
        "mean_us": statistics.fmean(times),
    }


def bench_match_insert(mode: str, page_size: int, args: argparse.Namespace) -> dict[str, object]:
    """A cache of conversations: 10 system prompts of 500 tokens, 10 users each at 2,000 tokens
    (155k cached tokens). Match a cached conversation; insert new ones sharing a system prompt."""
    rng = random.Random(0)
    cache, pool = _fresh(mode, page_size, 160_000 + 2 * args.repeat * KEY_TOKENS)
    systems = [_tokens(rng, 500) for _ in range(10)]
    conversations = [s + _tokens(rng, KEY_TOKENS - 500) for s in systems for _ in range(10)]
    for conversation in conversations:
        _put(cache, pool, conversation)
    cached = cache.stats().cached_tokens

    hit = _per_op_us(lambda i: cache.match_prefix(None, conversations[i % 100]), args.repeat)
    # Diverges mid-conversation: in the radix tree the first of these splits an edge.
    partial_keys = [c[:1_234] + _tokens(rng, KEY_TOKENS - 1_234) for c in conversations]
    partial = _per_op_us(lambda i: cache.match_prefix(None, partial_keys[i % 100]), args.repeat)
    new_keys = [systems[i % 10] + _tokens(rng, KEY_TOKENS - 500) for i in range(args.repeat)]
    new_slots = [pool.allocate(KEY_TOKENS // page_size) for _ in new_keys]
    insert = _per_op_us(lambda i: cache.insert(None, new_keys[i], new_slots[i]), args.repeat)
    return {
        "cached_tokens_before": cached,
        "match_full_hit": hit,
        "match_partial_hit": partial,
        "insert_new_2000": insert,
    }


def bench_evict(mode: str, page_size: int, args: argparse.Namespace) -> dict[str, object]:
    """1,000 shared 3-page prefixes with 10 one-page leaves each (10k leaves, >= 100k tokens)."""
    rng = random.Random(1)
    leaf = max(page_size, 5)  # token-granular trees get 5-token leaves
    prefix_len = 48 if page_size > 1 else 50
    total = 1_000 * (prefix_len + 10 * leaf)

    def build() -> tuple[PrefixCache, PageAllocator]:
        cache, pool = _fresh(mode, page_size, total + 4_096)
        rng.seed(1)
        for group in range(1_000):
            prefix = [group] + _tokens(rng, prefix_len - 1)
            for tail in range(10):
                _put(cache, pool, prefix + [VOCAB + tail] * leaf)
        return cache, pool

    cache, _ = build()
    cached = cache.stats().cached_tokens
    start = time.perf_counter()
    freed = sum(cache.evict(leaf) for _ in range(10_000))
    one_by_one = (time.perf_counter() - start) * 1e6 / 10_000
    cache, _ = build()
    start = time.perf_counter()
    batch_freed = cache.evict(10_000 * leaf)
    batched = (time.perf_counter() - start) * 1e6 / 10_000
    return {
        "cached_tokens_before": cached,
        "leaf_tokens": leaf,
        "evict_one_leaf_per_call_us": one_by_one,
        "evict_10k_leaves_one_call_us_per_leaf": batched,
        "tokens_freed": freed,
        "tokens_freed_one_call": batch_freed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/cache_ops.json")
    parser.add_argument("--repeat", type=int, default=200, help="operations timed per figure")
    args = parser.parse_args()

    configs = [("radix", 1), ("radix", 16), ("hash", 16)]
    report: dict[str, object] = {
        "machine": {"python": platform.python_version(), "processor": platform.processor()},
        "key_tokens": KEY_TOKENS,
        "results": {},
    }
    print(
        f"{'mode':<10}{'page':>5}{'match hit':>12}{'match part':>12}{'insert':>10}{'evict/leaf':>12}"
    )
    for mode, page_size in configs:
        ops = bench_match_insert(mode, page_size, args)
        evict = bench_evict(mode, page_size, args)
        report["results"][f"{mode}_page{page_size}"] = {**ops, "evict": evict}
        print(
            f"{mode:<10}{page_size:>5}"
            f"{ops['match_full_hit']['median_us']:>10.0f}us"
            f"{ops['match_partial_hit']['median_us']:>10.0f}us"
            f"{ops['insert_new_2000']['median_us']:>8.0f}us"
            f"{evict['evict_one_leaf_per_call_us']:>10.1f}us"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
