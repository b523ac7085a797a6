"""What structured output costs: output tokens/s of 1 and 16 concurrent requests with and
without a JSON schema (the same prompts, greedy, a fixed number of tokens), the grammar's
share of a step (its masks, measured on their own), and compile time cold and cached.

The constrained requests use a schema whose strings are long enough that no output ends
before max_tokens, so both runs decode the same number of tokens.

    .venv/bin/python benchmarks/bench_structured_output.py --out results/structured_output.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from radixserve import LLM
from radixserve.engine.sampler import sample
from radixserve.engine.sampling_rows import SampleRow
from radixserve.engine.structured_output import GrammarCompiler, fill_masks
from radixserve.kernels.cpu import describe
from radixserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 400, "maxLength": 800},
    "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "year", "tags"], "additionalProperties": False}


def _tokens_per_s(llm: LLM, users: int, tokens: int, spec: StructuredOutputsParams | None,
                  rounds: int) -> float:
    """The best output tokens/s over `rounds` runs of `users` concurrent requests."""
    prompts = [[{"role": "user", "content": f"Describe book number {i} as JSON."}]
               for i in range(users)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                            structured_outputs=spec)
    best = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        outs = llm.chat(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - started
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == users * tokens, "an output ended early: the comparison is off"
        best = max(best, produced / elapsed)
    return best


def _mask_ms(llm: LLM, spec: StructuredOutputsParams, users: int, steps: int) -> float:
    """Milliseconds to compute `users` masks, averaged over `steps` steps of a real output."""
    tokens = llm.tokenizer.encode('{"title":"' + "a long title " * 60, add_special_tokens=False)
    matchers = [llm.engine.grammars.matcher(spec) for _ in range(users)]
    total = 0.0
    for step in range(steps):
        started = time.perf_counter()
        fill_masks(matchers)
        total += time.perf_counter() - started
        for m in matchers:
            m.accept(tokens[step])
    return 1000 * total / steps


def _sampling_ms(llm: LLM, spec: StructuredOutputsParams, users: int) -> tuple[float, float]:
    """Milliseconds of one step's sampling for `users` rows, without and with grammar masks
    (the masks of a JSON output's opening, applied by the engine's mask op)."""
    vocab = llm.engine.model_config.vocab_size
    logits = torch.randn(users, vocab)
    matchers = [llm.engine.grammars.matcher(spec) for _ in range(users)]
    masks = fill_masks(matchers)
    op = llm.engine.runner._mask_op  # noqa: SLF001 - the op the engine samples with
    params = SamplingParams(temperature=1.0)
    free = [SampleRow(params, None) for _ in range(users)]
    masked = [SampleRow(params, None, allowed=masks[i]) for i in range(users)]
    figures = []
    for rows in (free, masked):
        for _ in range(5):
            sample(logits, rows, op)
        started = time.perf_counter()
        for _ in range(50):
            sample(logits, rows, op)
        figures.append(1000 * (time.perf_counter() - started) / 50)
    return figures[0], figures[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    llm = LLM(num_threads=args.num_threads, kv_cache_tokens=8192)
    spec = StructuredOutputsParams(json=SCHEMA)
    compiler = GrammarCompiler(llm.tokenizer)
    started = time.perf_counter()
    compiler.check(spec)  # cold: builds the tokenizer index too
    cold = time.perf_counter() - started
    other = StructuredOutputsParams(json={**SCHEMA, "title": "other"})
    started = time.perf_counter()
    compiler.check(other)  # a new schema, tokenizer ready
    new_schema = time.perf_counter() - started
    started = time.perf_counter()
    compiler.matcher(spec)
    cached = time.perf_counter() - started
    result: dict[str, object] = {
        "cpu": describe(), "tokens": args.tokens,
        "compile_cold_ms": 1000 * cold, "compile_new_schema_ms": 1000 * new_schema,
        "matcher_from_cache_ms": 1000 * cached}
    print(f"CPU {describe()}; compile: cold {1000 * cold:.1f} ms (with the tokenizer index), "
          f"a new schema {1000 * new_schema:.2f} ms, cached {1000 * cached:.3f} ms")
    _tokens_per_s(llm, 16, 8, spec, 1)  # warm-up: first-call costs out of the figures
    for users in (1, 16):
        free, constrained, costs = 0.0, 0.0, []
        for _ in range(args.rounds):  # pairs back to back: the cost is each pair's ratio
            a = _tokens_per_s(llm, users, args.tokens, None, 1)
            b = _tokens_per_s(llm, users, args.tokens, spec, 1)
            free, constrained = max(free, a), max(constrained, b)
            costs.append(1 - b / a)
        masks = _mask_ms(llm, spec, users, min(args.tokens, 60))
        cost = statistics.median(costs)
        plain_ms, masked_ms = _sampling_ms(llm, spec, users)
        result[f"users_{users}"] = {"free_tok_s": free, "schema_tok_s": constrained,
                                    "cost": cost, "costs": costs, "mask_ms_per_step": masks,
                                    "sampling_ms": plain_ms, "sampling_masked_ms": masked_ms}
        print(f"{users:2d} users: {free:7.1f} tok/s free, {constrained:7.1f} with a schema "
              f"(best of {args.rounds}); cost {100 * cost:+.1f}% (median of the pairs: "
              f"{', '.join(f'{100 * c:+.1f}' for c in costs)}); masks {masks:.3f} ms per step "
              f"({masks / users:.3f} ms per token); sampling {plain_ms:.2f} ms a step, "
              f"{masked_ms:.2f} with the masks applied")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
