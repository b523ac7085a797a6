"""Reads a model from disk: an HF directory (config.json, *.safetensors, tokenizer.json) or a
GGUF file (parsed by `gguf_file`). Both end as HF-named weights: float32 tensors, or GGUF blocks
(`QuantizedWeight`) for the matrices the engine runs quantized: the file's own blocks, or float
matrices quantized as they are read (`quantize_to`, see radixserve/model/quantize.py).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from radixserve.layers.quantized_weight import REPACKED_TYPES, QuantizedWeight
from radixserve.model.config import ModelConfig
from radixserve.model.families import gguf_family, hf_family
from radixserve.model.family import GGUFModel, Weights
from radixserve.model.gguf_file import GGUFFile, GGUFTensor, dequantize
from radixserve.model.quantize import quantize, repack
from radixserve.model.tokenizer import ChatTokenizer, load_gguf_tokenizer, load_hf_tokenizer

# GGUF tensor-type names we dequantize (gguf_file can decode more; these are tested).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K",
              "Q5_K", "Q6_K", "MXFP4")
FLOAT_TYPES = ("F32", "F16", "BF16")

@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights  # HF names; float32 or kept blocks
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
    family = hf_family(raw.get("model_type", ""))
    config = family.config_from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (.bin files are not supported)")
    weights: Weights = {}
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        names = [(f, name) for f in handles for name in f.keys()
                 # A tied head is the embedding table: a saved copy is not read (or quantized).
                 if not (config.tie_word_embeddings and name == "lm_head.weight")]
        for f, name in tqdm(names, desc="Loading weights", unit="tensor", disable=not progress):
            tensor = f.get_tensor(name)
            if not tensor.is_floating_point():  # packed blocks (gpt-oss's MXFP4): as stored
                weights[name] = tensor
                continue
            matrix = tensor.dim() == 2 and tensor.shape[1] % 32 == 0
            weights[name] = (_quantized(tensor, quantize_to) if quantize_to and matrix
                             else tensor.float())
    if family.hf_fixup is not None:
        config = family.hf_fixup(config, weights)
    return LoadedModel(config, weights, load_hf_tokenizer(path), str(path))


def _quantized(weight: torch.Tensor, type_name: str) -> QuantizedWeight:
    rows, cols = weight.shape
    return QuantizedWeight(type_name, rows, cols, quantize(weight, type_name))


def _load_gguf(path: Path, progress: bool, keep: frozenset[str],
               quantize_to: str | None) -> LoadedModel:
    gguf_file = GGUFFile.open(path)
    meta = gguf_file.metadata
    family = gguf_family(meta.get("general.architecture"))
    tokenizer = load_gguf_tokenizer(meta, family.chat_template)
    config = family.config_from_gguf(GGUFModel(meta, frozenset(gguf_file.tensors)))
    weights: Weights = {}
    tensors = gguf_file.tensors.values()
    for tensor in tqdm(tensors, desc="Loading weights", unit="tensor", disable=not progress):
        weights[family.hf_name(tensor.name)] = _gguf_weight(tensor, keep, quantize_to)
    if family.gguf_fixup is not None:
        config = family.gguf_fixup(config, weights)
    return LoadedModel(config, weights, tokenizer, str(path))


def _gguf_weight(tensor: GGUFTensor, keep: frozenset[str],
                 quantize_to: str | None) -> torch.Tensor | QuantizedWeight:
    """The file's blocks (a format in `keep`), a float matrix quantized to `quantize_to`, or
    float32. Quantized matrices are never requantized: their blocks carry the file's own
    rounding, and decoding a Q4 tensor to store it as Q8_0 gains nothing."""
    # Matrices, and a mixture-of-experts layer's stacked experts [experts, rows, cols], kept
    # as blocks of experts * rows.
    matrix = len(tensor.dims) in (2, 3)
    if matrix and tensor.type_name in keep:
        return _blocks(tensor)
    if (matrix and quantize_to and tensor.type_name in FLOAT_TYPES
            and tensor.dims[0] % 32 == 0):
        return _quantized(_float_view(tensor).reshape(-1, tensor.dims[0]), quantize_to)
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
    *outer, cols = tensor.shape  # [rows, cols], or stacked experts [experts, rows, cols]
    rows = math.prod(outer)
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
        try:  # the tokenizer alone reads the files of any architecture
            template = gguf_family(meta.get("general.architecture")).chat_template
        except ValueError:
            template = None
        return load_gguf_tokenizer({k: v for k, v in meta.items() if k.startswith("tokenizer.")},
                                   template)
    if path.is_dir():
        return load_hf_tokenizer(path)
    raise FileNotFoundError(f"no .gguf file or HF model directory at {str(path)!r}")
