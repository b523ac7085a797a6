"""Sliding-window memory with the prefix cache: the two figures issue 40 asks for.

1. Pool capacity at 8k-token contexts on a Gemma-3-shaped model (Gemma 3 1B: 26 layers, every
   6th global, window 512, 1 KV head, head_dim 256, bfloat16), keeping every layer's KV (what
   the engine does today: the real `kv_pool_pages`) against a sliding-window group that holds
   only the window (+ one prefill chunk while prefilling) of its local layers: the design's
   arithmetic on the real `PageAllocator`, and the engine's own swa_memory=window pools
   (`kv_pool_shape`) filled by its `WindowKV` with decoding requests, per `--swa-pool-ratio`.
2. What a hit costs when the window's KV at an old branch point was freed, measured on a small
   random-weight model (odd layers windowed): a branch inside a cached prompt with everything
   kept (today), with the window kept only at chunk ends (a match shortened to the last one:
   at most one chunk recomputed), and with the window kept only at the prompt's end (llama.cpp's
   default SWA cache: the branch recomputes from 0). Recomputing only the last window instead
   is not exact: a local layer's K/V at a position depends, through the local layers below it,
   on up to layers x window positions back, so the engine never does it.

    .venv/bin/python benchmarks/bench_swa_memory.py --out results/swa_memory.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.kv_pool import OutOfSlots, PageAllocator
from radixserve.engine.request import Request
from radixserve.engine.setup import kv_pool_pages, kv_pool_shape
from radixserve.engine.window_kv import WindowKV
from radixserve.layers.attention import LayerAttention
from radixserve.model.config import ModelConfig


@dataclass(frozen=True)
class Shape:
    layers: int
    global_every: int  # every n-th layer attends globally
    window: int
    kv_heads: int
    head_dim: int

    @property
    def global_layers(self) -> int:
        return self.layers // self.global_every

    @property
    def local_layers(self) -> int:
        return self.layers - self.global_layers

    def layer_token_bytes(self, dtype: torch.dtype) -> int:
        return 2 * self.kv_heads * self.head_dim * dtype.itemsize


GEMMA3_1B = Shape(layers=26, global_every=6, window=512, kv_heads=1, head_dim=256)


def capacity(shape: Shape, memory_gb: float, context: int, chunk: int) -> dict[str, float]:
    """Concurrent `context`-token requests a pool of `memory_gb` holds, full KV against a
    window group (steady decode: window slots per local layer; mid-prefill: window + chunk)."""
    dtype = torch.bfloat16
    # The pool's size depends only on the attention shape: the family name is any one known.
    model = ModelConfig(architecture="llama", vocab_size=262144, hidden_size=1152,
                        intermediate_size=6912, num_layers=shape.layers, num_heads=4,
                        num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                        tie_word_embeddings=True)
    config = EngineConfig(kv_cache_memory_gb=memory_gb, page_size=1)
    full_tokens = PageAllocator(kv_pool_pages(config, model, dtype), 1).num_slots
    per_layer = shape.layer_token_bytes(dtype)
    budget = int(memory_gb * 2**30)
    result: dict[str, float] = {"full_kv_pool_tokens": full_tokens,
                                "full_kv_contexts": full_tokens // context}
    for phase, local in (("decode", shape.window), ("prefill", shape.window + chunk)):
        # Split the budget between the groups in the proportion one request uses them.
        need_global = shape.global_layers * context * per_layer
        need_local = shape.local_layers * local * per_layer
        share = need_global / (need_global + need_local)
        global_pool = PageAllocator(int(budget * share) // (shape.global_layers * per_layer), 1)
        local_pool = PageAllocator(int(budget * (1 - share)) // (shape.local_layers * per_layer),
                                   1)
        admitted = 0
        try:
            while True:
                global_pool.allocate(context)
                local_pool.allocate(local)
                admitted += 1
        except OutOfSlots:
            pass
        result[f"window_group_{phase}_contexts"] = admitted
        result[f"window_group_{phase}_context_tokens"] = admitted * context
    result["gain_decode"] = result["window_group_decode_contexts"] / result["full_kv_contexts"]
    result["gain_prefill"] = result["window_group_prefill_contexts"] / result["full_kv_contexts"]
    return result


def engine_capacity(shape: Shape, memory_gb: float, context: int, ratio: float,
                    page_size: int = 16) -> dict[str, float]:
    """Concurrent `context`-token requests decoding at once in the engine's own pools: the
    sizes `kv_pool_shape` gives with swa_memory=window at `swa_pool_ratio` `ratio`, filled by
    the real `WindowKV` (each request's full slots from the full group's allocator, its window
    held and one more token reserved, as the scheduler does before a decode step)."""
    dtype = torch.bfloat16
    layer_types = tuple("full_attention" if (i + 1) % shape.global_every == 0
                        else "sliding_attention" for i in range(shape.layers))
    model = ModelConfig(architecture="gemma3", vocab_size=262144, hidden_size=1152,
                        intermediate_size=6912, num_layers=shape.layers, num_heads=4,
                        num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                        tie_word_embeddings=True, sliding_window=shape.window,
                        layer_types=layer_types)  # type: ignore[arg-type]
    config = EngineConfig(kv_cache_memory_gb=memory_gb, page_size=page_size,
                          swa_memory="window", swa_pool_ratio=ratio)
    pool = kv_pool_shape(config, model, dtype)
    full = PageAllocator(pool.pages, page_size)
    window = WindowKV(PageAllocator(pool.window_pages, page_size), pool.pages, pool.window,
                      full.release)
    pages = -(-(context + 1) // page_size)
    running = 0
    while full.free_slots >= pages * page_size:
        request = Request(f"r{running}", [0] * context, SamplingParams(max_tokens=1))
        request.slots = full.allocate(pages)
        request.num_computed = context
        window.slide(request)
        if window.reserve(request, 1) < 1:
            break
        running += 1
    layer_bytes = shape.layer_token_bytes(dtype)
    used = (pool.pages * (shape.layers - len(pool.window_layers))
            + pool.window_pages * len(pool.window_layers)) * page_size * layer_bytes
    return {"swa_pool_ratio": ratio, "page_size": page_size,
            "full_group_tokens": pool.pages * page_size,
            "window_group_tokens": pool.window_pages * page_size,
            "pool_gib": round(used / 2**30, 3), "contexts": running}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def _small_model(directory: Path) -> str:
    import transformers

    from radixserve.model.default_model import resolve_model_path
    from radixserve.model.loader import load_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=1,
                                   vocab_size=49152, max_position_embeddings=16384,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)
    tokenizer = load_tokenizer(resolve_model_path(None))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token}))
    return str(directory)


def branch_hit_cost(prompt: int, window: int, chunk: int, repeat: int) -> dict[str, float]:
    """TTFT (ms, best of `repeat`) of a 16-token branch at the middle of a cached `prompt`."""
    rng = random.Random(0)
    base = _tokens(rng, prompt)
    at = prompt // 2
    checkpoint = at // chunk * chunk  # the last chunk end at or before the branch
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(_small_model(Path(folder)), dtype="float32", quantization="none",
                  show_progress=False, kv_cache_tokens=4 * prompt,
                  max_num_batched_tokens=chunk)
        llm.engine.model.stack = None  # per-layer windows run the Python layers
        for i, layer in enumerate(llm.engine.model.layers):
            layer.self_attn.layer_attention = LayerAttention(window=window) if i % 2 else None

        def ttft(cached: list[int]) -> float:
            best = float("inf")
            for _ in range(repeat):
                llm.engine.cache.reset()
                if cached:
                    llm.generate({"prompt_token_ids": cached}, one)
                question = base[:at] + _tokens(rng, 16)
                start = time.perf_counter()
                llm.generate({"prompt_token_ids": question}, one)
                best = min(best, time.perf_counter() - start)
            return best * 1e3

        return {
            "prompt_tokens": prompt, "branch_at": at, "window": window, "chunk": chunk,
            "kept_ms": ttft(base),  # every layer's KV kept: 16 tokens computed
            "chunk_checkpoint_ms": ttft(base[:checkpoint]),  # recompute at - checkpoint + 16
            "recomputed_tokens_chunk_checkpoint": at - checkpoint + 16,
            "prompt_end_only_ms": ttft([]),  # llama.cpp's default: at + 16 from scratch
            "recomputed_tokens_prompt_end_only": at + 16,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gb", type=float, default=4.0)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--prompt", type=int, default=6000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--swa-pool-ratio", type=float, nargs="+", default=[0.25, 0.07],
                        help="window group sizes to fill with the engine's WindowKV")
    parser.add_argument("--skip-model", action="store_true", help="only the capacity figure")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result: dict[str, object] = {
        "capacity_gemma3_1b": capacity(GEMMA3_1B, args.memory_gb, args.context, args.chunk),
        "engine_capacity_gemma3_1b": [engine_capacity(GEMMA3_1B, args.memory_gb, args.context,
                                                      ratio) for ratio in args.swa_pool_ratio]}
    print(json.dumps(result, indent=2))
    if not args.skip_model:
        result["branch_hit"] = branch_hit_cost(args.prompt, args.window, args.chunk,
                                               args.repeat)
        print(json.dumps(result["branch_hit"], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
