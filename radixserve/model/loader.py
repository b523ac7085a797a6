"""Reads a model from disk: an HF directory (config.json, *.safetensors, tokenizer.json) or a
GGUF file (parsed by `gguf_file`). Both end as HF-named weights: float32 tensors, or GGUF blocks
(`QuantizedWeight`) for the matrices the engine runs quantized: the file's own blocks, or float
matrices quantized as they are read (`quantize_to`, see radixserve/model/quantize.py).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from radixserve.layers.quantized_weight import REPACKED_TYPES, QuantizedWeight
from radixserve.model.config import ModelConfig
from radixserve.model.gguf_file import GGUFFile, GGUFTensor, dequantize
from radixserve.model.quantize import quantize, repack
from radixserve.model.tokenizer import ChatTokenizer, load_gguf_tokenizer, load_hf_tokenizer

# GGUF tensor-type names we dequantize (gguf_file can decode more; these are tested).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K",
              "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedWeight]  # HF names; float32 or kept blocks
    tokenizer: ChatTokenizer
    source: str  # what was loaded, for logs


def load_model_files(path: str | Path, progress: bool = True,
                     keep_quantized: Collection[str] = (),
                     quantize_to: str | None = None) -> LoadedModel:
    """Loads config, weights and tokenizer from an HF directory or a `.gguf` file. GGUF
    matrices in a format named in `keep_quantized` stay in the file's blocks
    (`QuantizedWeight`; formats in REPACKED_TYPES rewritten into an executed one); with
    `quantize_to` (Q8_0 or Q4_1), float matrices (projections, the embedding, an untied LM
    head) are quantized to it as they are read, where a row's length is a multiple of 32.
    Everything else is dequantized to float32."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; pass an HF model directory "
            "(config.json, *.safetensors, tokenizer.json) or a .gguf file"
        )
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, progress, frozenset(keep_quantized), quantize_to)
    if path.is_dir() and (path / "config.json").exists():
        return _load_hf_dir(path, progress, quantize_to)
    raise ValueError(
        f"{str(path)!r} is neither a .gguf file nor an HF model directory with config.json"
    )


def _load_hf_dir(path: Path, progress: bool, quantize_to: str | None) -> LoadedModel:
    from safetensors import safe_open

    raw = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (.bin files are not supported)")
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        names = [(f, name) for f in handles for name in f.keys()
                 # A tied head is the embedding table: a saved copy is not read (or quantized).
                 if not (config.tie_word_embeddings and name == "lm_head.weight")]
        for f, name in tqdm(names, desc="Loading weights", unit="tensor", disable=not progress):
            tensor = f.get_tensor(name)
            matrix = tensor.dim() == 2 and tensor.shape[1] % 32 == 0
            weights[name] = (_quantized(tensor, quantize_to) if quantize_to and matrix
                             else tensor.float())
    return LoadedModel(config, weights, load_hf_tokenizer(path), str(path))


def _quantized(weight: torch.Tensor, type_name: str) -> QuantizedWeight:
    rows, cols = weight.shape
    return QuantizedWeight(type_name, rows, cols, quantize(weight, type_name))


def _unpermute_qk(w: torch.Tensor | QuantizedWeight, n_head: int) -> torch.Tensor | QuantizedWeight:
    # llama.cpp's converter interleaves each head's rotary halves for its own RoPE kernel;
    # undo that so the weights match HF's rotate-half layout that our forward pass uses.
    if isinstance(w, QuantizedWeight):  # a pure row permutation, applied as the kernel packs
        return w.permute_rows(_unpermute_qk(torch.arange(w.rows), n_head))
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _load_gguf(path: Path, progress: bool, keep: frozenset[str],
               quantize_to: str | None) -> LoadedModel:
    gguf_file = GGUFFile.open(path)
    meta = gguf_file.metadata
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2, mistral)"
        )

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    tokenizer = load_gguf_tokenizer(meta)
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    names = set(gguf_file.tensors)
    scaling = None
    if key("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    config = ModelConfig(
        architecture="llama" if arch == "mistral" else arch,
        vocab_size=key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv") or heads,
        head_dim=key("attention.key_length") or hidden // heads,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=scaling,
    )
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    tensors = gguf_file.tensors.values()
    for tensor in tqdm(tensors, desc="Loading weights", unit="tensor", disable=not progress):
        weights[_hf_name(tensor.name)] = _gguf_weight(tensor, keep, quantize_to)
    if arch in ("llama", "mistral"):
        for i in range(config.num_layers):
            q = f"model.layers.{i}.self_attn.q_proj.weight"
            k = f"model.layers.{i}.self_attn.k_proj.weight"
            weights[q] = _unpermute_qk(weights[q], config.num_heads)
            weights[k] = _unpermute_qk(weights[k], config.num_kv_heads)
    if "rope_freqs.weight" in weights:
        # Llama 3.1+ GGUFs store the llama3 rope scaling as per-frequency divisors.
        factors = weights.pop("rope_freqs.weight")
        config = _with_rope_factors(config, factors)
    return LoadedModel(config, weights, tokenizer, str(path))


def _with_rope_factors(config: ModelConfig, factors: torch.Tensor) -> ModelConfig:
    from dataclasses import replace

    return replace(config, rope_scaling={"rope_type": "factors", "factors": factors.tolist()})


def _hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _GGUF_LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{suffix}"
    if base in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[base]}.{suffix}"
    return name


def _gguf_weight(tensor: GGUFTensor, keep: frozenset[str],
                 quantize_to: str | None) -> torch.Tensor | QuantizedWeight:
    """The file's blocks (a format in `keep`), a float matrix quantized to `quantize_to`, or
    float32. Quantized matrices are never requantized: their blocks carry the file's own
    rounding, and decoding a Q4 tensor to store it as Q8_0 gains nothing."""
    matrix = len(tensor.dims) == 2
    if matrix and tensor.type_name in keep:
        return _blocks(tensor)
    if (matrix and quantize_to and tensor.type_name in FLOAT_TYPES
            and tensor.dims[0] % 32 == 0):
        return _quantized(_float_view(tensor), quantize_to)
    return _dequantize(tensor)


def _float_view(tensor: GGUFTensor) -> torch.Tensor:
    """An F32/F16/BF16 tensor as a torch view of the map, in its own dtype (no copy)."""
    kind = {"F32": "<f4", "F16": "<f2", "BF16": "<i2"}[tensor.type_name]
    with warnings.catch_warnings():  # read-only map: torch warns, but nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(tensor.data.view(kind)).view(tensor.shape)
    return view.view(torch.bfloat16) if tensor.type_name == "BF16" else view


def _blocks(tensor: GGUFTensor) -> QuantizedWeight:
    """The tensor's blocks as a uint8 [rows, bytes per row] view of the map (no copy), or
    rewritten into an executed format (REPACKED_TYPES; see radixserve/model/quantize.py)."""
    rows, cols = tensor.shape
    if tensor.type_name in REPACKED_TYPES:
        type_name, rewritten = repack(tensor.type_name, tensor.data.reshape(rows, -1))
        return QuantizedWeight(type_name, rows, cols, rewritten)
    with warnings.catch_warnings():  # read-only map: torch warns, but nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(tensor.data).view(rows, -1)
    return QuantizedWeight(tensor.type_name, rows, cols, raw)


def _dequantize(tensor: GGUFTensor) -> torch.Tensor:
    kind = tensor.type_name
    if kind not in GGUF_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name} has type {kind}; supported: {', '.join(GGUF_TYPES)}"
        )
    return dequantize(tensor)


def load_tokenizer(path: str | Path) -> ChatTokenizer:
    """Only the tokenizer of a model (no weights read): for the linter and the benchmark."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        meta = GGUFFile.open(path).metadata
        return load_gguf_tokenizer({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    if path.is_dir():
        return load_hf_tokenizer(path)
    raise FileNotFoundError(f"no .gguf file or HF model directory at {str(path)!r}")
