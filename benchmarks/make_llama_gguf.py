"""Writes a Llama-shaped GGUF with seeded random weights and SmolLM2's tokenizer.

The side-by-side benchmark against llama.cpp (issue 13) needs a real-size model whose speed,
not its text, is measured; the defaults are Llama 3.2 1B's shape with SmolLM2's 49,152-token
vocabulary (1.17B parameters, 2.4 GB as F16). Quantize it with llama.cpp's llama-quantize:

    .venv/bin/python benchmarks/make_llama_gguf.py --out /tmp/models/llama-1b-f16.gguf
    llama-quantize /tmp/models/llama-1b-f16.gguf /tmp/models/llama-1b-Q4_K_M.gguf Q4_K_M
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from radixserve.model.default_model import default_model_path

ROWS_PER_CHUNK_ELEMENTS = 1 << 22  # random numbers drawn at a time, in float32
DTYPES = {"F16": np.float16, "F32": np.float32}


def tensor_shapes(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                  tie_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model in llama.cpp's order and names; shapes are numpy's
    (rows = output features)."""
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden),
                                          "output_norm.weight": (hidden,)}
    if not tie_embeddings:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    return shapes


def random_matrix(shape: tuple[int, ...], std: float, dtype: type,
                  rng: np.random.Generator) -> np.ndarray:
    """Normal(0, std) in `dtype`, drawn a few million numbers at a time so that a large
    F16 tensor never exists in float32 as a whole."""
    out = np.empty(shape, dtype=dtype)
    rows_per_chunk = max(1, ROWS_PER_CHUNK_ELEMENTS // shape[1])
    for start in range(0, shape[0], rows_per_chunk):
        chunk = rng.standard_normal((min(rows_per_chunk, shape[0] - start), shape[1]),
                                    dtype=np.float32)
        out[start:start + len(chunk)] = chunk * std
    return out


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copies every tokenizer.* key (vocabulary, merges, special ids, chat template);
    returns the vocabulary size."""
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def write_model(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, "llama")
    vocab = copy_tokenizer(writer, Path(args.tokenizer_from))
    dtype = DTYPES[args.dtype]
    writer.add_name(f"random llama {args.hidden}x{args.layers} seed {args.seed}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if args.dtype == "F16"
                         else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(vocab)
    writer.add_context_length(args.context_length)
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(args.ffn)
    writer.add_block_count(args.layers)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_dimension_count(args.hidden // args.heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)

    shapes = tensor_shapes(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn,
                           vocab, args.tie_embeddings)
    for name, shape in shapes.items():
        # llama.cpp keeps 1-D tensors (norms) in F32 whatever the file type
        tensor_dtype = np.dtype(np.float32 if len(shape) == 1 else dtype)
        writer.add_tensor_info(name, shape, tensor_dtype,
                               int(np.prod(shape)) * tensor_dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, shape in enumerate(tqdm(shapes.values(), desc="Writing tensors")):
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        # one stream per tensor: its values do not depend on the other tensors' shapes
        rng = np.random.default_rng([args.seed, index])
        writer.write_tensor_data(random_matrix(shape, args.std, dtype, rng))
    writer.close()
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    print(f"wrote {out}: {n_params / 1e9:.3f}B parameters, "
          f"{out.stat().st_size / 1e9:.2f} GB, vocabulary {vocab}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the .gguf to write")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--rope-theta", type=float, default=100000.0,
                        help="rope frequency base (SmolLM2's; Llama 3 uses 500000)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="F16",
                        help="type of the 2-D tensors; norms are always F32")
    parser.add_argument("--std", type=float, default=0.02,
                        help="standard deviation of the weights; norms are 1.0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="no output.weight: the LM head reads token_embd")
    parser.add_argument("--tokenizer-from", default=None,
                        help="GGUF whose tokenizer.* keys to copy (default: the default model)")
    args = parser.parse_args()
    if args.tokenizer_from is None:
        args.tokenizer_from = str(default_model_path())
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must divide by --heads, and --heads by --kv-heads")
    write_model(args)


if __name__ == "__main__":
    main()
