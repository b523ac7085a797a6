"""The model's projections at decode batch sizes: the C++ skinny matmul against nn.Linear.

Every projection of every layer plus the LM head of the real model (bfloat16), in model order,
so each matrix comes from memory as in a decode step (the weights are far larger than the
caches). Per row count: milliseconds for one pass over all of them, and the weight bytes read
per second.

    .venv/bin/python benchmarks/bench_skinny_matmul.py --out results/skinny_matmul.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import best_ms

from radixserve import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16", kv_cache_tokens=256, show_progress=False)
    method = llm.engine.model.linear_method
    assert method.name == "kernel", "the skinny matmul needs AVX512-BF16 and a C++ compiler"
    kernel = method.op  # type: ignore[attr-defined]
    model = llm.engine.model
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj,
               layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    linears.append(model.lm_head)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    rows = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k).bfloat16() for k in {lin.in_features for lin in linears}}

        def onednn(inputs: dict = inputs) -> None:
            for lin in linears:
                F.linear(inputs[lin.in_features], lin.weight, lin.bias)

        def skinny(inputs: dict = inputs) -> None:
            for lin in linears:
                kernel(inputs[lin.in_features], lin.weight, lin.bias)

        with torch.inference_mode():
            a, b = best_ms(onednn, args.repeat), best_ms(skinny, args.repeat)
        row = {"rows": m, "onednn_ms": a, "kernel_ms": b, "speedup": a / b,
               "onednn_gbs": weight_bytes / a / 1e6, "kernel_gbs": weight_bytes / b / 1e6}
        rows.append(row)
        print(f"{m:3d} rows: nn.Linear {a:.2f} ms ({row['onednn_gbs']:.0f} GB/s) | kernel "
              f"{b:.2f} ms ({row['kernel_gbs']:.0f} GB/s) | {row['speedup']:.2f}x", flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "weight_mb": weight_bytes / 1e6, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
