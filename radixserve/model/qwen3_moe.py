"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (QK-norm, no biases) with a
mixture-of-experts MLP (radixserve/model/moe.py) in place of the dense one: a softmax router
over the experts, the top k, renormalised to sum to 1 where `norm_topk_prob` says so (llama.cpp
always renormalises this architecture's), and SwiGLU experts. HF checkpoints store each
expert's gate, up and down apart; GGUF files stack them (ffn_{gate,up,down}_exps).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from radixserve.layers.experts import experts_method
from radixserve.model.config import ModelConfig, MoEConfig
from radixserve.model.decoder import DecoderModel
from radixserve.model.family import GGUFModel, ModelFamily, Weights, gguf_config, hf_config
from radixserve.model.moe import MoEBlock, MoESpec, Routing, put_experts


class Qwen3MoeModel(DecoderModel):
    def make_mlp(self, layer: int) -> nn.Module:
        moe = self.config.moe
        if moe is None or layer in moe.dense_layers:
            return super().make_mlp(layer)
        spec = MoESpec(moe.num_experts, moe.expert_intermediate_size,
                       Routing("softmax_topk", moe.experts_per_token, moe.norm_topk_prob))
        return MoEBlock(self.config.hidden_size, spec, self.linear_method,
                        experts_method(self.linear_method))


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    layers, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1)
    # A layer is sparse where (i + 1) % decoder_sparse_step == 0 and it is not in
    # mlp_only_layers (transformers' rule).
    dense = tuple(i for i in range(layers)
                  if i in (raw.get("mlp_only_layers") or []) or (i + 1) % step)
    # transformers 5 writes num_local_experts, the released configs num_experts.
    moe = MoEConfig(num_experts=raw.get("num_experts") or raw["num_local_experts"],
                    experts_per_token=raw["num_experts_per_tok"],
                    expert_intermediate_size=raw["moe_intermediate_size"],
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                    dense_layers=dense)
    return hf_config(raw, "qwen3_moe", qk_norm=True, moe=moe)


def _from_gguf(gguf: GGUFModel) -> ModelConfig:
    moe = MoEConfig(num_experts=gguf.key("expert_count"),
                    experts_per_token=gguf.key("expert_used_count"),
                    expert_intermediate_size=gguf.key("expert_feed_forward_length"),
                    norm_topk_prob=True)
    return gguf_config(gguf, "qwen3_moe", qk_norm=True, moe=moe,
                       intermediate_size=gguf.key("feed_forward_length") or 0)


def _sparse_layers(config: ModelConfig) -> list[int]:
    assert config.moe is not None
    return [i for i in range(config.num_layers) if i not in config.moe.dense_layers]


def _hf_fixup(config: ModelConfig, weights: Weights) -> ModelConfig:
    """Each sparse layer's experts, stored one matrix per expert, stacked."""
    assert config.moe is not None
    experts = config.moe.num_experts
    for i in _sparse_layers(config):
        prefix = f"model.layers.{i}.mlp.experts"
        parts = [[weights.pop(f"{prefix}.{e}.{name}_proj.weight") for e in range(experts)]
                 for name in ("gate", "up", "down")]
        put_experts(weights, i, experts, *parts)  # type: ignore[arg-type]
    return config


def _gguf_fixup(config: ModelConfig, weights: Weights) -> ModelConfig:
    assert config.moe is not None
    for i in _sparse_layers(config):
        prefix = f"model.layers.{i}.mlp.experts"
        put_experts(weights, i, config.moe.num_experts,
                    *(weights.pop(f"{prefix}.{name}.weight") for name in ("gate", "up", "down")))
    return config


FAMILY = ModelFamily(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    config_from_hf=_from_hf,
    config_from_gguf=_from_gguf,
    model=Qwen3MoeModel,
    gguf_layer_names={"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate",
                      "ffn_up_exps": "mlp.experts.up", "ffn_down_exps": "mlp.experts.down"},
    hf_fixup=_hf_fixup,
    gguf_fixup=_gguf_fixup,
    reasoning_parser="think",
    tool_call_parser="hermes",
)
