"""SmolLM3: Llama-shaped layers where every fourth layer has no RoPE (NoPE: its attention
sees positions only through the causal mask). Its GGUF files come from llama.cpp's Llama
converter, so q and k are unpermuted as for Llama; llama.cpp fixes the rule at every fourth
layer, as the released models have it.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.config import ModelConfig
from radixserve.model.family import GGUFModel, ModelFamily, gguf_config, hf_config, unpermute_qk

NO_ROPE_INTERVAL = 4  # transformers' default and llama.cpp's fixed rule


def _rope_layers(layers: int, interval: int = NO_ROPE_INTERVAL) -> tuple[bool, ...]:
    return tuple((i + 1) % interval != 0 for i in range(layers))


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("mlp_bias"):
        raise ValueError("smollm3: MLP biases are not supported (the released models have none)")
    if raw.get("attention_bias"):
        raise ValueError("smollm3: attention biases are not supported (the released models "
                         "have none)")
    flags = raw.get("no_rope_layers")
    rope_layers = (tuple(bool(flag) for flag in flags) if flags is not None else
                   _rope_layers(raw["num_hidden_layers"],
                                raw.get("no_rope_layer_interval", NO_ROPE_INTERVAL)))
    return hf_config(raw, "smollm3", rope_layers=rope_layers)


def _from_gguf(gguf: GGUFModel) -> ModelConfig:
    return gguf_config(gguf, "smollm3", rope_layers=_rope_layers(gguf.key("block_count")))


FAMILY = ModelFamily(
    name="smollm3",
    hf_model_types=("smollm3",),
    gguf_architectures=("smollm3",),
    config_from_hf=_from_hf,
    config_from_gguf=_from_gguf,
    gguf_fixup=unpermute_qk,
    reasoning_parser="think",
)
