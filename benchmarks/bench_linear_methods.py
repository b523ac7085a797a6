"""Every projection of the real model, run by each linear method this machine offers.

For each (dtype, matmul_backend, quantization) setting the engine accepts here, all the
model's projections and its LM head run in model order, so each matrix comes from memory as in
a real step. Per row count: milliseconds for one pass, and the weight bytes streamed per
second. Settings this machine refuses are listed with the reason, not timed.

    .venv/bin/python benchmarks/bench_linear_methods.py --rows 1 8 16 64 512 --out results/linear_methods.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import torch
from timing import best_ms

from radixserve import LLM
from radixserve.kernels.cpu import describe
from radixserve.layers.linear import Linear

# (dtype, matmul_backend, quantization)
SETTINGS = [
    ("float32", "torch", "none"),
    ("float32", "auto", "none"),  # skinny-float where bfloat16 dot products are missing
    ("float32", "torch", "auto"),
    ("bfloat16", "torch", "none"),
    ("bfloat16", "auto", "none"),
    ("bfloat16", "widen", "none"),
    ("bfloat16", "kernel", "none"),
]


def weight_bytes(layer: Linear) -> int:
    if layer.packed is not None:
        return layer.packed.nbytes
    held = layer.weight if layer.panels is None else layer.panels
    return held.numel() * held.element_size()


def measure(model_path: str | None, dtype: str, backend: str, quantization: str,
            row_counts: list[int], repeat: int) -> dict:
    llm = LLM(model_path, dtype=dtype, matmul_backend=backend, quantization=quantization,
              kv_cache_tokens=256, show_progress=False)
    model = llm.engine.model
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj,
               layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    linears.append(model.lm_head)
    total = sum(weight_bytes(m) for m in linears)
    result = {"method": model.linear_method.describe(), "weight_mb": total / 1e6, "rows": {}}
    for rows in row_counts:
        inputs = {k: torch.randn(rows, k).to(getattr(torch, dtype))
                  for k in {lin.in_features for lin in linears}}

        def one_pass(inputs: dict = inputs, linears: list = linears) -> None:
            for lin in linears:
                lin(inputs[lin.in_features])

        with torch.inference_mode():
            ms = best_ms(one_pass, repeat if rows <= 64 else 1, warmup=1)
        result["rows"][rows] = {"ms": ms, "gbs": total / ms / 1e6}
    del llm, model
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 512])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(f"CPU: {describe()}, {torch.get_num_threads()} threads", flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": platform.processor() or platform.machine(), "cpu_flags": describe(),
              "threads": torch.get_num_threads(), "settings": []}
    for dtype, backend, quantization in SETTINGS:
        name = f"{dtype}, matmul_backend={backend}, quantization={quantization}"
        try:
            result = measure(args.model, dtype, backend, quantization, args.rows, args.repeat)
        except ValueError as refused:
            print(f"{name}: not here ({refused})", flush=True)
            report["settings"].append({"setting": name, "refused": str(refused)})
            continue
        report["settings"].append({"setting": name, **result})
        cells = " | ".join(f"{r} rows {v['ms']:.1f} ms ({v['gbs']:.0f} GB/s)"
                           for r, v in result["rows"].items())
        print(f"{name} [{result['method']}, {result['weight_mb']:.0f} MB]: {cells}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
