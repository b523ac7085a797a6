"""Our matmul kernels against oneDNN (nn.Linear) at decode and prefill row counts.

`--kernel bfloat16` (CPUs with AVX512-BF16): the skinny bfloat16 matmul on every projection
of every layer plus the LM head of the real model, in model order, so each matrix comes from
memory as in a decode step. Per row count: milliseconds for one pass, and the weight bytes
read per second.

`--kernel float` (CPUs with AVX2+FMA+F16C or AVX-512): the float32 kernel (radixserve/kernels/csrc/float_panels/)
on weights held as bfloat16 (a BF16 file; float16 runs alike) and as float32 (an F32 file,
GGUF blocks dequantized at load) against oneDNN float32, what `dtype=auto` runs on AVX2-only
CPUs. One shape at a time: the default model's (hidden 576, FFN 1536, LM head 49152x576) and a
1B Llama's (2048, 8192, 49152x2048); each cycles through enough copies of its weight to
overflow the last-level cache, so every call reads its weights from memory. Per shape and row
count: ms per matrix, GFLOP/s, GB/s of the weights as held, and the speedup over oneDNN.

    .venv/bin/python benchmarks/bench_skinny_matmul.py --kernel float --out results/skinny_float.json
    .venv/bin/python benchmarks/bench_skinny_matmul.py --kernel bfloat16 --out results/skinny_matmul.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import best_ms, cold_bytes

from radixserve import LLM
from radixserve.kernels import float_panel_ops
from radixserve.kernels.cpu import describe, has_fast_bf16

# (name, N, K): output x input features.
FLOAT_SHAPES = [
    ("SmolLM2 o_proj", 576, 576), ("SmolLM2 up", 1536, 576), ("SmolLM2 down", 576, 1536),
    ("SmolLM2 LM head", 49152, 576),
    ("1B o_proj", 2048, 2048), ("1B up", 8192, 2048), ("1B down", 2048, 8192),
    ("1B LM head", 49152, 2048),
]
STREAMED_BYTES = cold_bytes(256 << 20)  # of float32 copies per shape: past the caches


def ms_per_matrix(products: list[Callable[[], object]], repeat: int) -> float:
    """Milliseconds per product when all of them run in turn."""
    def one_pass() -> None:
        for product in products:
            product()

    with torch.inference_mode():
        return best_ms(one_pass, repeat, warmup=1) / len(products)


def bench_float(row_counts: list[int], repeat: int) -> list[dict]:
    ops = float_panel_ops()
    assert ops is not None and ops.path() > 0, "the float kernel needs AVX2+FMA+F16C or AVX-512"
    print(f"float kernel on the {ops.path_name()} path. Per matrix: ms, GFLOP/s, GB/s of the "
          "weights as held; x: speedup over oneDNN", flush=True)
    print(f"{'shape':<16} {'N x K':>11} {'M':>4} | {'oneDNN float32':^22} | "
          f"{'ours, bfloat16 weights':^22} {'x':>5} | {'ours, float32 weights':^22} {'x':>5}",
          flush=True)
    results = []
    for name, n, k in FLOAT_SHAPES:
        copies = max(1, STREAMED_BYTES // (4 * n * k))
        weights = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
        held = {dtype: [ops.pack(w, dtype) for w in weights]
                for dtype in (torch.bfloat16, torch.float32)}
        for m in row_counts:
            x = torch.randn(m, k)
            # label: (the products with x, one per copy of the weight; the bytes of a weight)
            contenders = {"onednn_f32": ([partial(F.linear, x, w) for w in weights], 4 * n * k)}
            for dtype, panels in held.items():
                contenders[f"ours_{str(dtype).removeprefix('torch.')}"] = (
                    [partial(ops.linear, x, p, n, None, ops.path()) for p in panels],
                    dtype.itemsize * n * k)
            result = {"shape": name, "n": n, "k": k, "rows": m}
            for label, (products, nbytes) in contenders.items():
                ms = ms_per_matrix(products, repeat if m <= 64 else 1)
                result[label] = {"ms": ms, "gflops": 2 * m * n * k / ms / 1e6,
                                 "gbs": nbytes / ms / 1e6}
            base = result["onednn_f32"]["ms"]
            cells = [f"{result[label]['ms']:8.3f} {result[label]['gflops']:6.1f} "
                     f"{result[label]['gbs']:6.1f}" for label in contenders]
            print(f"{name:<16} {f'{n}x{k}':>11} {m:>4} | {cells[0]} | {cells[1]} "
                  f"{base / result['ours_bfloat16']['ms']:5.2f} | {cells[2]} "
                  f"{base / result['ours_float32']['ms']:5.2f}", flush=True)
            results.append(result)
    return results


def bench_bfloat16(model: str | None, row_counts: list[int], repeat: int) -> list[dict]:
    llm = LLM(model, dtype="bfloat16", kv_cache_tokens=256, show_progress=False)
    method = llm.engine.model.linear_method
    assert method.name == "kernel", "the skinny matmul needs AVX512-BF16 and a C++ compiler"
    kernel = method.op  # type: ignore[attr-defined]
    model = llm.engine.model
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj,
               layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    linears.append(model.lm_head)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    results = []
    for m in row_counts:
        inputs = {k: torch.randn(m, k).bfloat16() for k in {lin.in_features for lin in linears}}

        def onednn(inputs: dict = inputs) -> None:
            for lin in linears:
                F.linear(inputs[lin.in_features], lin.weight, lin.bias)

        def skinny(inputs: dict = inputs) -> None:
            for lin in linears:
                kernel(inputs[lin.in_features], lin.weight, lin.bias)

        with torch.inference_mode():
            a, b = best_ms(onednn, repeat), best_ms(skinny, repeat)
        result = {"rows": m, "onednn_ms": a, "kernel_ms": b, "speedup": a / b,
                  "onednn_gbs": weight_bytes / a / 1e6, "kernel_gbs": weight_bytes / b / 1e6,
                  "weight_mb": weight_bytes / 1e6}
        results.append(result)
        print(f"{m:3d} rows: nn.Linear {a:.2f} ms ({result['onednn_gbs']:.0f} GB/s) | kernel "
              f"{b:.2f} ms ({result['kernel_gbs']:.0f} GB/s) | {result['speedup']:.2f}x",
              flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=["auto", "float", "bfloat16"], default="auto",
                        help="auto: bfloat16 where the CPU has AVX512-BF16, else float")
    parser.add_argument("--model", default=None, help="bfloat16 only: the model to run")
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="row counts (default: 1 4 16 64 512 for float, 1 4 8 16 bfloat16)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kernel = args.kernel if args.kernel != "auto" else (
        "bfloat16" if has_fast_bf16() else "float")
    print(f"CPU: {describe()}, {torch.get_num_threads()} threads", flush=True)
    if kernel == "float":
        results = bench_float(args.rows or [1, 4, 16, 64, 512], args.repeat)
    else:
        results = bench_bfloat16(args.model, args.rows or [1, 4, 8, 16], args.repeat)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "kernel": kernel,
              "machine": platform.processor() or platform.machine(), "cpu_flags": describe(),
              "threads": torch.get_num_threads(), "rows": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
