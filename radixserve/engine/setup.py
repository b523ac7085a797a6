"""Building an engine's parts from its config: device and dtype, the model with its linear
method, the KV pool's size and the attention backends. Logged once, at start-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from radixserve.config import EngineConfig
from radixserve.kernels import layer_ops
from radixserve.kernels.cpu import has_fast_bf16
from radixserve.layers.attention import AttentionEnv, StepAttention, choose_attention
from radixserve.layers.linear import choose_linear_method
from radixserve.layers.quantized import QuantizedLinear
from radixserve.layers.quantized_weight import EXECUTED_TYPES, REPACKED_TYPES
from radixserve.model.config import ModelConfig
from radixserve.model.decoder import DecoderModel
from radixserve.model.default_model import resolve_model_path
from radixserve.model.loader import load_model_files
from radixserve.model.quantize import QUANTIZE_TO
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.model.weights import build_model, weight_formats

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if has_fast_bf16() else torch.float32


@dataclass(frozen=True)
class EngineModel:
    path: str
    model: DecoderModel
    config: ModelConfig
    tokenizer: ChatTokenizer


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> EngineModel:
    """The model's weights in `dtype` on `device`, its projections run by the linear method
    the config asks for (a clear ValueError where that method cannot run here). Logs how long
    loading took and the bytes of weights held."""
    start = time.perf_counter()
    linear = choose_linear_method(config.matmul_backend, device, dtype)
    keep: tuple[str, ...] = ()
    quantize_to = QUANTIZE_TO.get(config.quantization)
    if config.quantization != "none":
        reason = QuantizedLinear.unavailable(device, dtype)
        if reason is None:
            linear, keep = QuantizedLinear(linear), (*EXECUTED_TYPES, *REPACKED_TYPES)
        elif quantize_to is not None:
            raise ValueError(f"quantization={config.quantization} needs {reason}")
        else:
            logger.info("quantization=auto: quantized GGUF weights are dequantized to %s; "
                        "running them as they are needs %s", dtype, reason)
    if quantize_to is not None:
        logger.info("quantization=%s: float matrices are quantized to %s at load; matrices "
                    "the file already holds quantized keep its blocks (requantizing them "
                    "would add error and save nothing)", config.quantization, quantize_to)
    path = resolve_model_path(config.model)
    files = load_model_files(path, progress=config.show_progress, keep_quantized=keep,
                             quantize_to=quantize_to)
    ops = layer_ops() if device.type == "cpu" else None  # None: PyTorch's norms and rotary
    max_context = min(config.max_model_len or files.config.max_position_embeddings,
                      files.config.max_position_embeddings)
    model = build_model(files.config, files.weights, linear, ops, dtype,
                        progress=config.show_progress,
                        max_context=max_context).to(device).eval()
    formats = weight_formats(model)
    logger.info("loaded %s in %.1f s: %.1f MB of weights held (%s)", path,
                time.perf_counter() - start, sum(formats.values()) / 1e6,
                ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in formats.items()))
    return EngineModel(str(path), model, files.config, files.tokenizer)


def kv_pool_pages(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """Pages of the KV pool: `kv_cache_tokens`, or what fits in `kv_cache_memory_gb`."""
    bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype.itemsize
    tokens = config.kv_cache_tokens or int(config.kv_cache_memory_gb * 2**30 // bytes_per_token)
    return max(1, tokens // config.page_size)


@dataclass(frozen=True)
class PoolShape:
    """The KV pool's pages, and the sliding-window layers' slot space where they have one
    (radixserve/engine/window_kv.py): its layers, pages and (largest) window."""

    pages: int
    window_layers: frozenset[int] = frozenset()
    window_pages: int = 0
    window: int = 0


def kv_pool_shape(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> PoolShape:
    """`kv_pool_pages`, or with `swa_memory="window"` on a model mixing windowed and full
    layers, the full-attention group's pages and the window group's (`swa_pool_ratio` of
    them, at least one request's window and a page), within `kv_cache_memory_gb` together."""
    windows = {i: model.layer_window(i) for i in range(model.num_layers)}
    local = frozenset(i for i, w in windows.items() if w is not None)
    if config.swa_memory == "full":
        return PoolShape(kv_pool_pages(config, model, dtype))
    if not local or len(local) == model.num_layers:
        # Asked for by name (the default is "full"), so it is refused rather than ignored.
        raise ValueError(
            f"swa_memory='window' needs a model that mixes sliding-window and full-attention "
            f"layers; {model.architecture} has "
            + ("no sliding-window layers" if not local
               else "no full-attention layer to name the cached tokens")
            + ": use swa_memory='full'")
    ratio = config.swa_pool_ratio
    layer_bytes = 2 * model.num_kv_heads * model.head_dim * dtype.itemsize
    full_layers = model.num_layers - len(local)
    tokens = config.kv_cache_tokens or int(config.kv_cache_memory_gb * 2**30
                                           // (layer_bytes * (full_layers + ratio * len(local))))
    pages = max(1, tokens // config.page_size)
    window = max(w for w in windows.values() if w is not None)
    # One request's window and a page to compute in (a chunk shrinks to the room there is).
    least = -(-window // config.page_size) + 2
    window_pages = max(int(pages * ratio), least)
    logger.info("swa_memory=window: %d full-attention layers keep %d tokens, %d windowed "
                "layers (window %d) %d", full_layers, pages * config.page_size, len(local),
                window, window_pages * config.page_size)
    return PoolShape(pages, local, window_pages, window)


def build_attention(config: EngineConfig, model: ModelConfig, num_slots: int,
                    device: torch.device, dtype: torch.dtype,
                    window_slots: int | None = None) -> StepAttention:
    """The step's attention backends; with `window_slots`, the same backends again for the
    sliding-window layers' own slot space of that size."""
    # Layers whose windows differ pass their own (DecoderModel.layer_attention).
    window = model.layer_window(0) if model.uniform_windows else None
    env = AttentionEnv(num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, window=window,
                       num_slots=num_slots, device=device, dtype=dtype)
    attention = choose_attention(env, config.attention_backend, config.prefill_attention_backend)
    if window_slots is None:
        return attention
    group = choose_attention(replace(env, num_slots=window_slots), config.attention_backend,
                             config.prefill_attention_backend)
    return replace(attention, window_group=group)
