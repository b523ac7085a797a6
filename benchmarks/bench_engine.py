"""Engine speed against HF transformers on the same weights, side by side in one run.

Prefill of one long prompt, decode at batch 1, and output tokens/s at several concurrencies,
for radixserve and HF in float32 and bfloat16, with the machine's own limits (memory
bandwidth, matmul GFLOP/s per dtype) measured in the same run. Prints a table, writes JSON.

    .venv/bin/python benchmarks/bench_engine.py --out results/engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from radixserve import LLM, SamplingParams
from radixserve.config import QUANTIZATIONS, EngineConfig
from radixserve.model.default_model import default_model_path


def _best(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _better(a: dict[str, object], b: dict[str, object]) -> dict[str, object]:
    """Per figure, the better of two runs: less time, more tokens per second."""
    throughput = {k: max(a["output_tokens_per_s"][k], b["output_tokens_per_s"][k])  # type: ignore[index]
                  for k in a["output_tokens_per_s"]}  # type: ignore[attr-defined]
    return {"prefill_s": min(a["prefill_s"], b["prefill_s"]),  # type: ignore[type-var]
            "decode_ms_per_token": min(a["decode_ms_per_token"], b["decode_ms_per_token"]),  # type: ignore[type-var]
            "output_tokens_per_s": throughput}


def machine_limits() -> dict[str, float]:
    """Memory bandwidth (copy) and matmul throughput per dtype at this model's shapes."""
    src = torch.empty(256 * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), 5)
    limits = {"memory_bandwidth_gbs": 2 * src.numel() * 4 / copy_s / 1e9}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(2048, 576, dtype=dtype)
        b = torch.randn(576, 1536, dtype=dtype)
        s = _best(lambda a=a, b=b: a @ b, 10)
        limits[f"matmul_gflops_{str(dtype)[6:]}"] = 2 * 2048 * 576 * 1536 / s / 1e9
    return limits


def _token_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 40000) for _ in range(length)] for _ in range(count)]


def bench_radixserve(model: str, dtype: str, args: argparse.Namespace) -> dict[str, object]:
    llm = LLM(model, dtype=dtype, prefix_cache="off", kv_cache_tokens=40000,
              max_num_batched_tokens=4096, max_num_seqs=64, show_progress=False,
              quantization=args.quantization)
    prompt = _token_prompts(1, args.prefill_tokens, 0)[0]
    one = SamplingParams(max_tokens=1, temperature=0)
    prefill_s = _best(lambda: llm.generate({"prompt_token_ids": prompt}, one, use_tqdm=False), 2)
    decode_params = SamplingParams(max_tokens=args.decode_tokens + 1, temperature=0, ignore_eos=True)

    def decode_run() -> float:
        out = llm.generate({"prompt_token_ids": prompt[:32]}, decode_params, use_tqdm=False)[0]
        m = out.metrics
        return (m.finished_time - m.first_token_time) / args.decode_tokens

    decode_run()
    decode_s = min(decode_run() for _ in range(2))
    throughput = {}
    for concurrency in args.concurrency:
        prompts = [{"prompt_token_ids": p} for p in _token_prompts(concurrency, 128, concurrency)]
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        seconds = _best(lambda p=prompts, s=params: llm.generate(p, s, use_tqdm=False), args.repeat)
        throughput[str(concurrency)] = concurrency * 128 / seconds
    return {"prefill_s": prefill_s, "decode_ms_per_token": decode_s * 1e3,
            "output_tokens_per_s": throughput}


def bench_hf(model_path: Path, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, object]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=dtype
    ).eval()
    prompt = torch.tensor(_token_prompts(1, args.prefill_tokens, 0))

    def prefill() -> None:
        with torch.inference_mode():
            model(prompt)

    prefill_s = _best(prefill, 2)
    short = prompt[:, :32]

    def decode() -> float:
        t = time.perf_counter()
        model.generate(short, attention_mask=torch.ones_like(short), do_sample=False,
                       max_new_tokens=args.decode_tokens + 1, min_new_tokens=args.decode_tokens + 1,
                       pad_token_id=0)
        return (time.perf_counter() - t) / (args.decode_tokens + 1)

    decode()
    decode_s = min(decode() for _ in range(2))
    throughput = {}
    for concurrency in args.hf_concurrency:
        ids = torch.tensor(_token_prompts(concurrency, 128, concurrency))

        def batched(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=128, min_new_tokens=128, pad_token_id=0)

        seconds = _best(batched, args.repeat)
        throughput[str(concurrency)] = concurrency * 128 / seconds
    return {"prefill_s": prefill_s, "decode_ms_per_token": decode_s * 1e3,
            "output_tokens_per_s": throughput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--hf-concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=EngineConfig.quantization,
                        help="radixserve's setting: auto runs GGUF blocks on our kernel, none "
                             "dequantizes (what HF runs)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed runs per throughput point after one untimed warm-up run, "
                             "both systems alike; the best counts")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds alternating radixserve and HF; the best of each figure counts")
    parser.add_argument("--out", default="results/engine.json")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    model_path = Path(args.model) if args.model else default_model_path()
    report: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "limits": machine_limits(),
        "quantization": args.quantization,
        "radixserve": {},
        "hf": {},
    }
    # Rounds alternate the two systems so that a slow spell of this shared machine falls on
    # both; each figure is the best over the rounds.
    for round_ in range(args.rounds):
        for dtype in args.dtypes:
            runs = [("radixserve", lambda d=dtype: bench_radixserve(str(model_path), d, args))]
            if not args.skip_hf:
                runs.append(("hf", lambda d=dtype: bench_hf(model_path, getattr(torch, d), args)))
            for system, bench in runs:
                result = bench()
                print(f"round {round_ + 1} {system} {dtype}: {result}", flush=True)
                best = report[system].get(dtype)  # type: ignore[attr-defined]
                report[system][dtype] = result if best is None else _better(best, result)  # type: ignore[index]
    report["rounds"] = args.rounds
    report["limits"] = {k: statistics.mean([v, machine_limits()[k]])
                        for k, v in report["limits"].items()}  # type: ignore[union-attr]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
