"""Writes a Qwen3-MoE-shaped GGUF (llama.cpp's `qwen3moe`) with seeded random weights and
SmolLM2's tokenizer, for the mixture-of-experts side of the benchmark against llama.cpp.

The defaults: hidden 2048, 12 layers, 16 query / 4 KV heads of 128, 32 experts of FFN 768 with
8 active per token, SmolLM2's 49,152-token vocabulary: 2.14B parameters, 0.68B of them read
per decoded token (0.58B without the LM head). (24 layers of top-8 experts at FFN 768, as
Qwen3-30B-A3B's layers are, would make 1.3B active: 12 layers keep the active share in
0.3-0.6B.) Quantize it with llama.cpp's llama-quantize, then run the side by side:

    .venv/bin/python benchmarks/make_moe_gguf.py --out /tmp/models/moe-2b-f16.gguf
    llama-quantize /tmp/models/moe-2b-f16.gguf /tmp/models/moe-2b-Q4_K_M.gguf Q4_K_M 2
    .venv/bin/python benchmarks/bench_vs_llama_cpp.py --llama-cpp-bin LLAMA_CPP/build/bin \
        --model /tmp/models/moe-2b-Q4_K_M.gguf --skip-server --rounds 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from make_llama_gguf import DTYPES, copy_tokenizer, random_matrix
from tqdm import tqdm

from radixserve.model.default_model import default_model_path

ARCH = "qwen3moe"


def tensor_shapes(args: argparse.Namespace, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor in llama.cpp's names and order; numpy shapes (rows = output features,
    experts first)."""
    hidden, heads, kv_heads, head_dim = args.hidden, args.heads, args.kv_heads, args.head_dim
    experts, ffn = args.experts, args.expert_ffn
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden),
                                          "output_norm.weight": (hidden,),
                                          "output.weight": (vocab, hidden)}
    for i in range(args.layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.attn_q_norm.weight": (head_dim,),
            f"blk.{i}.attn_k_norm.weight": (head_dim,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate_inp.weight": (experts, hidden),
            f"blk.{i}.ffn_gate_exps.weight": (experts, ffn, hidden),
            f"blk.{i}.ffn_up_exps.weight": (experts, ffn, hidden),
            f"blk.{i}.ffn_down_exps.weight": (experts, hidden, ffn),
        }
    return shapes


def float32_always(name: str, shape: tuple[int, ...]) -> bool:
    """Norms, and the router, which llama.cpp's converter and llama-quantize keep in F32."""
    return len(shape) == 1 or name.endswith("ffn_gate_inp.weight")


def active_parameters(shapes: dict[str, tuple[int, ...]], args: argparse.Namespace) -> int:
    """Parameters one decoded token reads: all but the embedding table, the experts' at
    top_k / experts."""
    total = 0
    for name, shape in shapes.items():
        if name == "token_embd.weight":
            continue
        count = int(np.prod(shape))
        total += count * args.top_k // args.experts if "_exps." in name else count
    return total


def write_model(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, ARCH)
    vocab = copy_tokenizer(writer, Path(args.tokenizer_from))
    dtype = DTYPES[args.dtype]
    writer.add_name(f"random qwen3moe {args.hidden}x{args.layers} {args.experts}e "
                    f"top{args.top_k} seed {args.seed}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if args.dtype == "F16"
                         else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(vocab)
    writer.add_context_length(args.context_length)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.expert_ffn * args.top_k)
    writer.add_expert_feed_forward_length(args.expert_ffn)
    writer.add_expert_count(args.experts)
    writer.add_expert_used_count(args.top_k)
    writer.add_block_count(args.layers)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)

    shapes = tensor_shapes(args, vocab)
    for name, shape in shapes.items():
        tensor_dtype = np.dtype(np.float32 if float32_always(name, shape) else dtype)
        writer.add_tensor_info(name, shape, tensor_dtype,
                               int(np.prod(shape)) * tensor_dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, shape) in enumerate(tqdm(shapes.items(), desc="Writing tensors")):
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        rng = np.random.default_rng([args.seed, index])
        matrix_dtype = np.float32 if float32_always(name, shape) else dtype
        rows = int(np.prod(shape[:-1]))
        writer.write_tensor_data(random_matrix((rows, shape[-1]), args.std, matrix_dtype,
                                               rng).reshape(shape))
    writer.close()
    total = sum(int(np.prod(s)) for s in shapes.values())
    print(f"wrote {out}: {total / 1e9:.3f}B parameters, "
          f"{active_parameters(shapes, args) / 1e9:.3f}B read per token, "
          f"{out.stat().st_size / 1e9:.2f} GB, vocabulary {vocab}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="path of the .gguf to write")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8, help="experts used per token")
    parser.add_argument("--expert-ffn", type=int, default=768, help="each expert's FFN size")
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--rope-theta", type=float, default=1000000.0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="F16",
                        help="type of the matrices; norms and the router are always F32")
    parser.add_argument("--std", type=float, default=0.02,
                        help="standard deviation of the weights; norms are 1.0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", default=None,
                        help="GGUF whose tokenizer.* keys to copy (default: the default model)")
    args = parser.parse_args()
    if args.tokenizer_from is None:
        args.tokenizer_from = str(default_model_path())
    if args.heads % args.kv_heads or not 1 <= args.top_k <= args.experts:
        parser.error("--heads must divide by --kv-heads, and --top-k lie in 1..--experts")
    write_model(args)


if __name__ == "__main__":
    main()
