"""The sampler's draw, side by side with the per-row torch.multinomial it replaced: the time
of one step's sampling for 1, 16 and 32 rows of the default model's 49k vocabulary at
temperature 1, and output tokens/s of 32 concurrent sampled requests end to end (the
engine with each draw in turn, in one process, rounds interleaved).

    .venv/bin/python benchmarks/bench_sampler.py --out results/sampler.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from radixserve import LLM
from radixserve.engine import sampler
from radixserve.engine.sampling_rows import SampleRow
from radixserve.kernels.cpu import describe
from radixserve.sampling_params import SamplingParams


def multinomial_draw(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """The previous draw: per row, softmax and torch.multinomial."""
    tokens = []
    for j, row in enumerate(rows):
        p = row.params
        filtered = sampler._filter_top_k_top_p(logits[j] / p.temperature, p.top_k, p.top_p)  # noqa: SLF001
        probs = torch.softmax(filtered, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=row.generator).item()))
    return tokens


DRAWS = {"multinomial": multinomial_draw, "inverse-cdf": sampler._draw}  # noqa: SLF001


def step_ms(draw_name: str, rows: int, vocab: int) -> float:
    logits = torch.randn(rows, vocab) * 3
    params = [SampleRow(SamplingParams(temperature=1.0), None) for _ in range(rows)]
    sampler._draw = DRAWS[draw_name]  # noqa: SLF001
    for _ in range(3):
        sampler.sample(logits, params)
    started = time.perf_counter()
    for _ in range(20):
        sampler.sample(logits, params)
    return 1000 * (time.perf_counter() - started) / 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    llm = LLM(num_threads=2, kv_cache_tokens=8192, show_progress=False)
    vocab = llm.engine.model_config.vocab_size
    result: dict[str, object] = {"cpu": describe(), "vocab": vocab}
    for rows in (1, 16, 32):
        figures = {name: step_ms(name, rows, vocab) for name in DRAWS}
        result[f"step_ms_{rows}_rows"] = figures
        print(f"{rows:2d} rows: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in figures.items()))
    prompts = [[{"role": "user", "content": f"Tell me a story about city number {i}."}]
               for i in range(32)]
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, ignore_eos=True)
    llm.chat(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in DRAWS}
    for _ in range(args.rounds):
        for name, draw in DRAWS.items():
            sampler._draw = draw  # noqa: SLF001
            started = time.perf_counter()
            outs = llm.chat(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(produced / (time.perf_counter() - started))
    ratios = [b / a for a, b in zip(rates["multinomial"], rates["inverse-cdf"], strict=True)]
    result["users_32_tok_s"] = rates
    result["users_32_ratio_median"] = statistics.median(ratios)
    print("32 users, temperature 1: " + ", ".join(
        f"{n} {max(v):.1f} tok/s" for n, v in rates.items())
        + f"; ratio per round {', '.join(f'{r:.2f}' for r in ratios)}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
