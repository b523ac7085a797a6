"""Qwen3 (dense, 0.6B-32B): Llama-shaped layers with QK-norm (an RMSNorm of each q and k head
before RoPE) and no q/k/v biases. Its GGUF files keep HF's rotary layout (llama.cpp runs them
with NEOX-style RoPE), so nothing is unpermuted.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.config import ModelConfig
from radixserve.model.family import GGUFModel, ModelFamily, gguf_config, hf_config


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    return hf_config(raw, "qwen3", qk_norm=True)


def _from_gguf(gguf: GGUFModel) -> ModelConfig:
    return gguf_config(gguf, "qwen3", qk_norm=True)


FAMILY = ModelFamily(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    config_from_hf=_from_hf,
    config_from_gguf=_from_gguf,
    reasoning_parser="think",
    tool_call_parser="hermes",
)
