"""The Llama family: Llama 2/3.x (with Llama 3.1's RoPE scaling), SmolLM2, Mistral (a sliding
window on every layer) and Qwen2/2.5 (q/k/v biases): pre-norm layers of plain attention and
a SwiGLU MLP, the shape the C++ decoder stack runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from radixserve.model.config import ModelConfig
from radixserve.model.family import (
    GGUFModel,
    ModelFamily,
    Weights,
    gguf_config,
    hf_config,
    unpermute_qk,
)


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type", "llama")
    return hf_config(
        raw, "llama",
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        # Qwen2's sliding window (use_sliding_window) stays off, as in its released models.
        sliding_window=raw.get("sliding_window") if model_type == "mistral" else None,
        layer_types=None,
    )


def _from_gguf(gguf: GGUFModel) -> ModelConfig:
    arch = gguf.architecture
    return gguf_config(gguf, "llama", architecture="llama" if arch == "mistral" else arch)


def _gguf_fixup(config: ModelConfig, weights: Weights) -> ModelConfig:
    if config.architecture == "llama":  # Qwen2's converter keeps HF's rotary layout
        config = unpermute_qk(config, weights)
    if "rope_freqs.weight" in weights:
        # Llama 3.1+ GGUFs store the llama3 rope scaling as per-frequency divisors.
        factors = weights.pop("rope_freqs.weight")
        config = replace(config, rope_scaling={"rope_type": "factors",
                                               "factors": factors.tolist()})
    return config


FAMILY = ModelFamily(
    name="llama",
    hf_model_types=("llama", "mistral", "qwen2"),
    gguf_architectures=("llama", "mistral", "qwen2"),
    config_from_hf=_from_hf,
    config_from_gguf=_from_gguf,
    gguf_fixup=_gguf_fixup,
)
