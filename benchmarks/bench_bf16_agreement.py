"""How close bfloat16 output stays to float32: greedy token agreement and logit differences.

    .venv/bin/python benchmarks/bench_bf16_agreement.py --out results/bf16_agreement.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from radixserve import LLM, SamplingParams

LENGTHS = [5, 17, 64, 130, 257, 500, 777, 1000]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="results/bf16_agreement.json")
    args = parser.parse_args()
    engines = {d: LLM(args.model, dtype=d, kv_cache_tokens=8192, show_progress=False)
               for d in ("float32", "bfloat16")}
    text = ("The history of computing is a story of abstractions. Early machines were programmed "
            "with switches and cables; later came assembly, then high-level languages. ") * 60
    base = engines["float32"].tokenizer.encode(text)
    rng = random.Random(7)
    prompts = []
    for n in LENGTHS:
        start = rng.randrange(0, len(base) - n)
        prompts.append(base[start : start + n])
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    outputs = {d: [r.outputs[0].token_ids for r in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        for d, llm in engines.items()}
    rows = []
    for prompt, a, b in zip(prompts, outputs["float32"], outputs["bfloat16"], strict=True):
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        la = engines["float32"].engine.prompt_logits(prompt)
        lb = engines["bfloat16"].engine.prompt_logits(prompt)
        rows.append({"prompt_tokens": len(prompt), "identical_prefix_tokens": first_diff,
                     "same_first_token": a[0] == b[0],
                     "max_abs_logit_diff": float((la - lb).abs().max()),
                     "top1_same": int(la.argmax()) == int(lb.argmax())})
        print(rows[-1], flush=True)
    summary = {
        "prompts": len(rows),
        "fully_identical": sum(r["identical_prefix_tokens"] == args.tokens for r in rows),
        "mean_identical_prefix": sum(r["identical_prefix_tokens"] for r in rows) / len(rows),
        "top1_agreement": sum(r["top1_same"] for r in rows) / len(rows),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()
