"""Attention over the paged pool, the C++ kernel against the PyTorch paths, on the same batch
and pool; the kernel on this CPU's best vector path and on its portable C++ one.

Decode: requests whose contexts sit in the real engine's KV pool (default model, its pool and
runner), laid out as the prefix cache lays them out: a few shared prefixes, each request's
own suffix and output after them. For each shape: one layer's decode attention alone (the
kernel's single call vs the PyTorch path's gathers, bmm and softmax over the runner's decode
groups), and a whole decode step (the model forward over the batch) with either backend.
Prefill: one layer's causal attention over a prompt's chunk (kernel vs SDPA), and the whole
prompt's prefill through the model with either prefill backend.

    .venv/bin/python benchmarks/bench_decode_attention.py --out results/decode_attention.json

`--compare-path 3` also times the kernel's layer on a lower vector path (here the
AVX512-BF16 one, beside the AMX path), in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import time
from pathlib import Path

import torch
from timing import best_ms

from radixserve import LLM, SamplingParams
from radixserve.engine.request import Request
from radixserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from radixserve.kernels import attention_path, path_names
from radixserve.layers.attention import choose_backend

# (label, requests, distinct prefixes, prefix tokens, own tokens per request)
SHAPES = [
    ("prefix-heavy: 8 requests on 4 prefixes of 1,500", 8, 4, 1500, 60),
    ("16 users on one 2,000-token prompt", 16, 1, 2000, 60),
    ("32 unrelated chats of 600 tokens", 32, 32, 0, 600),
    ("batch 1, 2,000-token context", 1, 1, 2000, 30),
]


def _requests(
    llm: LLM, n: int, prefixes: int, prefix_len: int, own: int
) -> tuple[list[Request], list[list[int]]]:
    """Decode-ready requests holding slots of the engine's pool (K/V values are random), and
    every slot list allocated for them."""
    allocator = llm.engine.pool.allocator
    shared = [allocator.allocate(prefix_len) if prefix_len else [] for _ in range(prefixes)]
    allocated = list(shared)
    rng = random.Random(0)
    requests = []
    for i in range(n):
        length = prefix_len + own
        request = Request(f"r{i}", [rng.randrange(200, 40000) for _ in range(length)],
                          SamplingParams(max_tokens=1))
        allocated.append(allocator.allocate(own + 1))
        request.slots = shared[i % prefixes] + allocated[-1]
        request.num_computed = length - 1  # the newest prompt token is this step's decode
        requests.append(request)
    rng.shuffle(requests)  # the runner orders them itself
    return requests, allocated


def measure(llm: LLM, shape: tuple[str, int, int, int, int], repeat: int,
            compare_path: int | None = None) -> dict:
    label, n, prefixes, prefix_len, own = shape
    engine = llm.engine
    runner, model, pool = engine.runner, engine.model, engine.pool
    kernel_path = runner.attention
    assert kernel_path.decode.name == "kernel", "the C++ kernel did not build here"
    torch_path = dataclasses.replace(
        kernel_path, decode=choose_backend("decode", "torch", kernel_path.decode.env))
    requests, allocated = _requests(llm, n, prefixes, prefix_len, own)
    plan = SchedulerOutput(decodes=requests)
    env = kernel_path.decode.env
    plain = (env.scale, None)  # a layer's scale and sinks: the model's default
    cache = pool.layers[0]
    q = torch.randn(n, env.num_heads, env.head_dim, dtype=cache.k.dtype)
    kv = torch.randn(n, env.num_kv_heads, env.head_dim, dtype=cache.k.dtype)
    out = torch.empty_like(q)
    result: dict[str, object] = {"shape": label, "requests": n,
                                 "context_tokens": prefix_len + own}
    for name, attention in (("kernel", kernel_path), ("torch", torch_path)):
        runner.attention = attention
        try:
            # One layer's decode attention over a batch planned once (the torch path gathers
            # every context each call, as for a batch that changed since the last step).
            backend = attention.decode
            metadata = runner.build_batch(plan)[0].attention_plan.decode
            result[f"layer_{name}_ms"] = best_ms(
                lambda b=backend, m=metadata: b.forward(q, kv, kv, cache, m, out, *plain), repeat)
            if name == "kernel":
                top, backend.max_path = backend.max_path, 0
                result["layer_portable_ms"] = best_ms(
                    lambda b=backend, m=metadata: b.forward(q, kv, kv, cache, m, out, *plain),
                    max(1, repeat // 10))
                if compare_path is not None:
                    backend.max_path = compare_path
                    result["layer_compare_path_ms"] = best_ms(
                        lambda b=backend, m=metadata: b.forward(q, kv, kv, cache, m, out, *plain), repeat)
                backend.max_path = top
            result[f"step_{name}_ms"] = best_ms(
                lambda: model(runner.build_batch(plan)[0], pool.layers), max(1, repeat // 10))
        finally:
            runner.attention = kernel_path
    result["layer_speedup"] = result["layer_torch_ms"] / result["layer_kernel_ms"]
    result["step_speedup"] = result["step_torch_ms"] / result["step_kernel_ms"]
    for slots in allocated:
        if slots:
            pool.allocator.release(slots)
    return result


def measure_prefill(llm: LLM, tokens: int, repeat: int, compare_path: int | None = None) -> dict:
    """A `tokens`-long prompt prefilled in one chunk: one layer's attention (kernel vs SDPA)
    and the model's whole forward with either prefill backend."""
    engine = llm.engine
    runner, model, pool = engine.runner, engine.model, engine.pool
    kernel_path = runner.attention
    assert kernel_path.prefill.name == "kernel", "the C++ kernel did not build here"
    sdpa_path = dataclasses.replace(
        kernel_path, prefill=choose_backend("prefill", "sdpa", kernel_path.prefill.env))
    rng = random.Random(1)
    request = Request("p", [rng.randrange(200, 40000) for _ in range(tokens)],
                      SamplingParams(max_tokens=1))
    request.slots = pool.allocator.allocate(tokens)
    plan = SchedulerOutput(prefills=[ScheduledChunk(request, tokens)])
    env = kernel_path.prefill.env
    plain = (env.scale, None)  # a layer's scale and sinks: the model's default
    cache = pool.layers[0]
    q = torch.randn(tokens, env.num_heads, env.head_dim, dtype=cache.k.dtype)
    kv = torch.randn(tokens, env.num_kv_heads, env.head_dim, dtype=cache.k.dtype)
    out = torch.empty_like(q)
    result: dict[str, object] = {"shape": f"prefill of {tokens:,} tokens", "tokens": tokens}
    for name, attention in (("kernel", kernel_path), ("sdpa", sdpa_path)):
        runner.attention = attention
        try:
            backend = attention.prefill
            metadata = runner.build_batch(plan)[0].attention_plan.prefill
            result[f"layer_{name}_ms"] = best_ms(
                lambda b=backend, m=metadata: b.forward(q, kv, kv, cache, m, out, *plain), repeat)
            if name == "kernel" and compare_path is not None:
                top, backend.max_path = backend.max_path, compare_path
                result["layer_compare_path_ms"] = best_ms(
                    lambda b=backend, m=metadata: b.forward(q, kv, kv, cache, m, out, *plain), repeat)
                backend.max_path = top
            result[f"model_{name}_ms"] = best_ms(
                lambda: model(runner.build_batch(plan)[0], pool.layers), 1, warmup=1)
        finally:
            runner.attention = kernel_path
    result["layer_speedup"] = result["layer_sdpa_ms"] / result["layer_kernel_ms"]
    result["model_speedup"] = result["model_sdpa_ms"] / result["model_kernel_ms"]
    pool.allocator.release(request.slots)
    return result


def _cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    return " ".join(sorted(f for f in set(flags) if f.startswith("avx512") or f in ("avx2", "fma")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[500, 2000])
    parser.add_argument("--compare-path", type=int, default=None,
                        help="also time the kernel's layer capped at this path (an index of "
                             f"the attention paths: {', '.join(path_names('attention'))})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.compare_path is not None and not 0 <= args.compare_path <= attention_path():
        parser.error(f"--compare-path {args.compare_path} is not a path this CPU runs "
                     f"(0 to {attention_path()}: {', '.join(path_names('attention')[:attention_path() + 1])})")
    print(f"CPU flags: {_cpu_flags()}; kernel path: {path_names('attention')[attention_path()]}; "
          f"dtype {args.dtype}; {torch.get_num_threads()} threads")
    llm = LLM(args.model, dtype=args.dtype, kv_cache_tokens=80_000, show_progress=False)
    rows = []
    for shape in SHAPES:
        row = measure(llm, shape, args.repeat, args.compare_path)
        rows.append(row)
        print(f"{row['shape']:50s} layer: kernel {row['layer_kernel_ms']:.3f} ms "
              f"(portable {row['layer_portable_ms']:.3f}) vs torch "
              f"{row['layer_torch_ms']:.3f} ms ({row['layer_speedup']:.1f}x) | step: kernel "
              f"{row['step_kernel_ms']:.1f} ms vs torch {row['step_torch_ms']:.1f} ms "
              f"({row['step_speedup']:.2f}x)"
              + (f" | layer at path {args.compare_path}: {row['layer_compare_path_ms']:.3f} ms"
                 if args.compare_path is not None else ""), flush=True)
    for tokens in args.prefill_tokens:
        row = measure_prefill(llm, tokens, max(1, args.repeat // 25), args.compare_path)
        rows.append(row)
        print(f"{row['shape']:50s} layer: kernel {row['layer_kernel_ms']:.1f} ms vs sdpa "
              f"{row['layer_sdpa_ms']:.1f} ms ({row['layer_speedup']:.2f}x) | model: kernel "
              f"{row['model_kernel_ms']:.0f} ms vs sdpa {row['model_sdpa_ms']:.0f} ms "
              f"({row['model_speedup']:.2f}x)"
              + (f" | layer at path {args.compare_path}: {row['layer_compare_path_ms']:.1f} ms"
                 if args.compare_path is not None else ""), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "cpu_flags": _cpu_flags(),
        "kernel_path": path_names('attention')[attention_path()],
        "compare_path": None if args.compare_path is None else path_names('attention')[args.compare_path],
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
