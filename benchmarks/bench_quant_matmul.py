"""The GGUF quantized matmul (gguf_linear) against F.linear on the dequantized weights.

Per format, weight shape (out x in) and row count: milliseconds per call, the packed weight
bytes streamed per second, integer GOP/s, and F.linear on the same weights dequantized to
float32 (and bfloat16 where the CPU has fast bfloat16). Up to 16 rows each call reads a
different copy of the weights, so they come from memory as in a decode step (a model's weights
are far larger than the caches); from 64 rows one copy, the product being compute-bound.

    .venv/bin/python benchmarks/bench_quant_matmul.py --out results/quant_matmul.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from timing import best_ms, cold_bytes

from radixserve.kernels import GGUFOps, gguf_ops, path_names
from radixserve.kernels.cpu import describe, has_fast_bf16

Q = gguf.GGMLQuantizationType
FORMATS = {"Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q8_0": Q.Q8_0, "Q4_K": Q.Q4_K, "Q6_K": Q.Q6_K}
SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (49152, 576)]  # (out, in)
COLD_BYTES = cold_bytes(128 << 20)  # copies of a weight add up to this, past the caches
COLD_MAX_ROWS = 16


def _blocks(n: int, k: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of an [n, k] weight: gguf-py's quantizer where it has one; random bytes with
    small fp16 scales for K-quants (the kernel's speed does not depend on the values)."""
    if kind not in (Q.Q4_K, Q.Q6_K):
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, kind)
    type_bytes = 144 if kind == Q.Q4_K else 210
    raw = rng.integers(0, 256, (n * k // 256, type_bytes), dtype=np.uint8)
    scales = np.full((raw.shape[0], 2), 1e-3, dtype=np.float16).view(np.uint8)
    if kind == Q.Q4_K:
        raw[:, :4] = scales  # d, dmin
    else:
        raw[:, 208:] = scales[:, :2]  # d
    return raw.reshape(n, -1)


def _copies(tensor: torch.Tensor, rows: int) -> list[torch.Tensor]:
    if rows > COLD_MAX_ROWS:
        return [tensor]
    count = math.ceil(COLD_BYTES / (tensor.numel() * tensor.element_size()))
    return [tensor] + [tensor.clone() for _ in range(count - 1)]


def _quantized(ops: GGUFOps, x: torch.Tensor, ggml_type: int, n: int,
               path: int) -> Callable[[torch.Tensor], object]:
    return lambda panels: ops.linear(x, panels, ggml_type, n, None, path)


def _dense(x: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda weight: F.linear(x, weight)


def _per_call_ms(call: Callable[[torch.Tensor], object], weights: list[torch.Tensor],
                 work: float) -> float:
    """Best milliseconds per call, cycling through the copies; `work` (multiply-adds of one
    call) sets how many calls a timing round takes."""
    repeat = max(1, int(4e8 / (work * len(weights))))

    def run() -> None:
        for w in weights:
            call(w)

    return best_ms(run, repeat, warmup=1) / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES],
                        help="OUTxIN weight shapes")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-path", type=int, default=None,
                        help="the kernel's path (an index of the kernel's gguf paths, at most this CPU's "
                             "best: 2 runs the AVX-512 VNNI path on a CPU with AMX); default: "
                             "this CPU's best")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = gguf_ops()
    assert ops is not None, "the C++ kernels did not build"
    path = ops.path() if args.max_path is None else args.max_path
    if not 0 <= path <= ops.path():
        parser.error(f"--max-path {path}: this CPU runs paths 0 to {ops.path()} "
                     f"({', '.join(path_names('gguf')[:ops.path() + 1])})")
    print(f"CPU: {describe()} | quantized path: {ops.path_name(path)} | threads: "
          f"{torch.get_num_threads()}")
    dtypes = [torch.float32] + ([torch.bfloat16] if has_fast_bf16() else [])
    rng = np.random.default_rng(0)
    results = []
    header = f"{'format':6} {'out x in':>11} {'M':>4} {'gguf ms':>9} {'GB/s':>6} {'GOP/s':>6}"
    header += "".join(f" {str(d)[6:] + ' ms':>10} {'vs':>6}" for d in dtypes)
    print(header)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        dense: dict[torch.dtype, torch.Tensor] = {}
        baselines: dict[int, dict[str, float]] = {}  # per row count, the same for every format
        for name in args.formats:
            kind = FORMATS[name]
            if k % (256 if kind in (Q.Q4_K, Q.Q6_K) else 32):
                print(f"{name:6} {shape:>11}: K is not a multiple of the format's block")
                continue
            raw = _blocks(n, k, kind, rng)
            panels = ops.pack(torch.from_numpy(raw), int(kind))
            if not dense:  # the float baselines' timings do not depend on the values
                weights = torch.from_numpy(gguf.quants.dequantize(raw, kind))
                dense = {d: weights.to(d) for d in dtypes}
            panel_bytes = panels.numel()
            for m in args.rows:
                x = torch.randn(m, k)
                with torch.inference_mode():
                    ms = _per_call_ms(_quantized(ops, x, int(kind), n, path), _copies(panels, m),
                                      m * n * k)
                    if m not in baselines:
                        baselines[m] = {
                            str(d)[6:]: _per_call_ms(_dense(x.to(d)), _copies(dense[d], m),
                                                     m * n * k)
                            for d in dtypes}
                baseline = baselines[m]
                row = {"format": name, "out": n, "in": k, "rows": m, "ms": ms,
                       "weight_gbs": panel_bytes / ms / 1e6, "gops": 2 * m * n * k / ms / 1e6,
                       "float_ms": baseline}
                results.append(row)
                line = (f"{name:6} {shape:>11} {m:4d} {ms:9.3f} {row['weight_gbs']:6.1f} "
                        f"{row['gops']:6.0f}")
                line += "".join(f" {b:10.3f} {b / ms:5.2f}x" for b in baseline.values())
                print(line, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": platform.processor() or platform.machine(), "cpu_flags": describe(),
              "path": ops.path_name(path), "threads": torch.get_num_threads(), "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
