"""The two maintained grammar engines side by side on this CPU, on the default model's
tokenizer: llguidance (what radixserve uses) and xgrammar. Per engine: the tokenizer index
build, compiling a JSON schema, and the token mask per step while following a real JSON
output token by token (the mask is what a constrained decode step waits for).

xgrammar is not a dependency (it requires torch's Triton and transformers); to run its half:

    pip install --target /tmp/xg --no-deps xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xg .venv/bin/python benchmarks/bench_grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixserve.kernels.cpu import describe
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.model.tokenizer import ChatTokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
OUTPUT = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["red", '
          '"blue"], "address": {"city": "London", "zip": "W1"}}')


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, 1000 * (time.perf_counter() - started)


def llguidance_run(tok: ChatTokenizer, tokens: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.torch as lt

    ll, index_ms = _timed(lambda: llguidance.LLTokenizer(
        tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.stop_token_ids)))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher, compile_ms = _timed(lambda: llguidance.LLMatcher(ll, grammar, log_level=0))
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)
    steps = []
    for token in tokens:
        _, ms = _timed(lambda: lt.fill_next_token_bitmask(matcher, mask, 0))
        steps.append(ms)
        assert matcher.consume_token(token), "the output must follow the schema"
    return {"index_ms": index_ms, "compile_ms": compile_ms,
            "mask_ms_median": statistics.median(steps), "mask_ms_max": max(steps)}


def xgrammar_run(tok: ChatTokenizer, tokens: list[int]) -> dict[str, float]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    info, index_ms = _timed(lambda: xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.stop_token_ids)))
    compiler = xgr.GrammarCompiler(info)
    compiled, compile_ms = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for token in tokens:
        _, ms = _timed(lambda: matcher.fill_next_token_bitmask(mask))
        steps.append(ms)
        assert matcher.accept_token(token), "the output must follow the schema"
    return {"index_ms": index_ms, "compile_ms": compile_ms,
            "mask_ms_median": statistics.median(steps), "mask_ms_max": max(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(default_model_path())
    tokens = tok.encode(OUTPUT, add_special_tokens=False)
    results: dict[str, Any] = {"cpu": describe(), "output_tokens": len(tokens)}
    for name, run in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
        try:
            figures = run(tok, tokens)
        except ImportError as exc:
            print(f"{name}: not installed ({exc.name}); see the docstring")
            continue
        results[name] = figures
        print(f"{name:10s} index {figures['index_ms']:7.1f} ms, compile "
              f"{figures['compile_ms']:6.2f} ms, mask per token median "
              f"{figures['mask_ms_median']:.3f} ms (max {figures['mask_ms_max']:.3f})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
