"""Phi-3 and Phi-4-mini: fused q/k/v and gate/up projections (stored fused, read as they
are), partial rotary (Phi-4-mini turns 3/4 of each head), and LongRoPE: per-frequency short
and long factors with an attention factor on cos and sin (see radixserve/model/rope.py for
which factors an engine uses). GGUF files carry the factors as rope_factors_short/long
tensors and the fused gate/up as ffn_up.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from radixserve.model.config import ModelConfig
from radixserve.model.family import GGUFModel, ModelFamily, Weights, gguf_config, hf_config

LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers reads all three as LongRoPE


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    config = hf_config(raw, "phi3")
    scaling = config.rope_scaling
    if scaling is None:
        return config
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in LONGROPE_NAMES:
        raise ValueError(f"phi3: rope scaling {kind!r} is not supported (supported: longrope)")
    # The pretraining length: config.json's own field wins over the scaling's (as in
    # transformers); the growth over it gives the attention factor where none is given.
    original = raw.get("original_max_position_embeddings") or scaling.get(
        "original_max_position_embeddings") or config.max_position_embeddings
    scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}
    scaling.setdefault("factor", config.max_position_embeddings / original)
    return replace(config, rope_scaling=scaling)


def _from_gguf(gguf: GGUFModel) -> ModelConfig:
    scaling = None
    if "rope_factors_long.weight" in gguf.tensor_names:  # the factors come with the weights
        scaling = {"rope_type": "longrope",
                   "original_max_position_embeddings":
                       gguf.key("rope.scaling.original_context_length"),
                   "attention_factor": gguf.key("rope.scaling.attn_factor", 1.0)}
    # llama.cpp's converter writes a window of 0 where the model has none (Phi-4).
    return gguf_config(gguf, "phi3", rope_scaling=scaling,
                       sliding_window=gguf.key("attention.sliding_window") or None)


def _gguf_fixup(config: ModelConfig, weights: Weights) -> ModelConfig:
    if config.rope_scaling is None:
        return config
    long, short = weights.pop("rope_factors_long.weight"), weights.pop("rope_factors_short.weight")
    return replace(config, rope_scaling={**config.rope_scaling, "long_factor": long.tolist(),
                                         "short_factor": short.tolist()})


FAMILY = ModelFamily(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    config_from_hf=_from_hf,
    config_from_gguf=_from_gguf,
    gguf_layer_names={"ffn_up": "mlp.gate_up_proj"},
    gguf_fixup=_gguf_fixup,
)
