"""gpt-oss (20b, 120b): attention with q/k/v/o biases and a learned sink logit per head (it
joins each softmax's denominator), every other layer on a 128-token sliding window, YaRN RoPE;
and a mixture-of-experts MLP (radixserve/model/moe.py) whose router has a bias and takes the
top k logits before a softmax over them, with gpt-oss's clamped SwiGLU experts (biased). HF
checkpoints interleave each expert's gate and up ([experts, hidden, 2 * inter] floats, gate at
even columns; the released ones' MXFP4 blocks by rows alike); GGUF files hold them apart
(ffn_{gate,up,down}_exps). MXFP4 experts, from either, are rewritten losslessly to Q8_0 at
load (radixserve/layers/quantized_weight.py says what that costs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.attention import LayerAttention, LayerKV
from radixserve.layers.experts import ExpertActivation, experts_method
from radixserve.layers.linear import Linear, LinearMethod
from radixserve.layers.quantized_weight import QuantizedWeight
from radixserve.model.blocks import Attention
from radixserve.model.config import ModelConfig, MoEConfig
from radixserve.model.decoder import DecoderModel
from radixserve.model.family import GGUFModel, ModelFamily, Weights, gguf_config, hf_config
from radixserve.model.forward_batch import ForwardBatch, Rotary
from radixserve.model.moe import MoEBlock, MoESpec, Routing, put_experts
from radixserve.model.quantize import repack

if TYPE_CHECKING:
    from radixserve.kernels import LayerOps

# llama.cpp's constants for this architecture (its GGUF files carry neither).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class GptOssOptions:
    swiglu_alpha: float = SWIGLU_ALPHA


class GptOssAttention(Attention):
    """The shared attention with an output bias and one sink logit per query head, on the
    layer's own window (`layer_attention`, made on the first step, once the sinks are
    loaded)."""

    def __init__(self, config: ModelConfig, layer: int, linear: LinearMethod,
                 ops: LayerOps | None = None) -> None:
        super().__init__(config, linear, ops)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, True,
                             linear)
        self.sinks = nn.Parameter(torch.empty(config.num_heads))
        self.window = config.layer_window(layer)

    def forward(self, x: torch.Tensor, rotary: Rotary | None, batch: ForwardBatch,
                cache: LayerKV, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.layer_attention is None:
            self.layer_attention = LayerAttention(window=self.window, sinks=self.sinks)
        return super().forward(x, rotary, batch, cache, rows)


class GptOssModel(DecoderModel):
    def __init__(self, config: ModelConfig, linear: LinearMethod | None = None,
                 ops: LayerOps | None = None, max_context: int | None = None) -> None:
        super().__init__(config, linear, ops, max_context)
        for i, layer in enumerate(self.layers):
            layer.self_attn = GptOssAttention(config, i, self.linear_method, ops)

    def make_mlp(self, layer: int) -> nn.Module:
        moe, options = self.config.moe, self.config.options
        assert moe is not None and moe.swiglu_limit is not None
        alpha = options.swiglu_alpha if isinstance(options, GptOssOptions) else SWIGLU_ALPHA
        spec = MoESpec(moe.num_experts, moe.expert_intermediate_size,
                       Routing("topk_softmax", moe.experts_per_token),
                       ExpertActivation("clamped_swiglu", alpha, moe.swiglu_limit),
                       router_bias=True, expert_bias=True)
        return MoEBlock(self.config.hidden_size, spec, self.linear_method,
                        experts_method(self.linear_method))


def _moe(experts: int, top_k: int, inter: int, limit: float) -> MoEConfig:
    return MoEConfig(num_experts=experts, experts_per_token=top_k,
                     expert_intermediate_size=inter, norm_topk_prob=False, router_bias=True,
                     swiglu_limit=limit)


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    moe = _moe(raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"],
               raw.get("swiglu_limit", SWIGLU_LIMIT))
    return hf_config(raw, "gpt_oss", attention_bias=True, moe=moe,
                     options=GptOssOptions(raw.get("swiglu_alpha", SWIGLU_ALPHA)))


def _from_gguf(gguf: GGUFModel) -> ModelConfig:
    key = gguf.key
    layers = key("block_count")
    scaling = None
    if key("rope.scaling.type") == "yarn":
        # transformers' gpt-oss config sets truncate off; llama.cpp's files do not say.
        scaling = {"rope_type": "yarn", "factor": key("rope.scaling.factor"),
                   "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                   "beta_fast": key("rope.scaling.yarn_beta_fast"),
                   "beta_slow": key("rope.scaling.yarn_beta_slow"), "truncate": False}
    inter = key("expert_feed_forward_length")
    moe = _moe(key("expert_count"), key("expert_used_count"), inter, SWIGLU_LIMIT)
    # llama.cpp's pattern for this architecture: even layers slide, odd ones attend fully.
    layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers))
    return gguf_config(gguf, "gpt_oss", intermediate_size=inter, attention_bias=True,
                       rope_scaling=scaling, sliding_window=key("attention.sliding_window"),
                       layer_types=layer_types, moe=moe, options=GptOssOptions())


def _hf_fixup(config: ModelConfig, weights: Weights) -> ModelConfig:
    """The router under our name; each expert's interleaved gate/up columns split into gate
    rows then up rows, and every matrix as [out, in]."""
    assert config.moe is not None
    for i in range(config.num_layers):
        p = f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias"):
            weights[f"{p}gate.{suffix}"] = weights.pop(f"{p}router.{suffix}")
        if p + "experts.gate_up_proj_blocks" in weights:  # the released MXFP4 checkpoints
            gate_up = mxfp4_blocks(weights.pop(p + "experts.gate_up_proj_blocks"),
                                   weights.pop(p + "experts.gate_up_proj_scales"))
            down = mxfp4_blocks(weights.pop(p + "experts.down_proj_blocks"),
                                weights.pop(p + "experts.down_proj_scales"))
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
            put_experts(weights, i, config.moe.num_experts,
                        *(_q8_0_rows(part) for part in (gate, up, down)))
        else:  # floats [experts, in, out]
            gate_up = weights.pop(p + "experts.gate_up_proj").transpose(1, 2)  # type: ignore[union-attr]
            down = weights.pop(p + "experts.down_proj").transpose(1, 2)  # type: ignore[union-attr]
            put_experts(weights, i, config.moe.num_experts, gate_up[:, 0::2], gate_up[:, 1::2],
                        down)
        bias = weights.pop(p + "experts.gate_up_proj_bias")
        weights[p + "experts.gate_up_bias"] = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        weights[p + "experts.down_bias"] = weights.pop(p + "experts.down_proj_bias")
    return config


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF's MXFP4 experts (blocks uint8 [experts, rows, groups, 16]: value 2k of a group in
    byte k's low nibble, 2k + 1 in its high one; scales uint8 [experts, rows, groups], E8M0) as
    GGUF's MXFP4 blocks uint8 [experts, rows, groups * 17]: the scale, then value j in byte
    j's low nibble and j + 16 in its high one (what llama.cpp's converter writes)."""
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., groups, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2)


def _q8_0_rows(blocks: torch.Tensor) -> QuantizedWeight:
    """GGUF MXFP4 blocks [experts, rows, bytes] as one Q8_0 matrix of experts * rows,
    rewritten losslessly (radixserve/model/quantize.py)."""
    experts, rows, row_bytes = blocks.shape
    type_name, raw = repack("MXFP4", blocks.reshape(experts * rows, row_bytes).numpy())
    return QuantizedWeight(type_name, experts * rows, row_bytes // 17 * 32, raw)


def _float(tensor: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """A bias as floats (a file may hold one in blocks; the experts add them in float32)."""
    return tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor


def _gguf_fixup(config: ModelConfig, weights: Weights) -> ModelConfig:
    assert config.moe is not None
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.sinks"] = weights.pop(p + "self_attn.sinks.weight")
        e = p + "mlp.experts."
        put_experts(weights, i, config.moe.num_experts,
                    *(weights.pop(f"{e}{name}.weight") for name in ("gate", "up", "down")))
        gate_bias, up_bias, down_bias = (_float(weights.pop(f"{e}{name}.bias"))
                                         for name in ("gate", "up", "down"))
        weights[e + "gate_up_bias"] = torch.cat([gate_bias, up_bias], dim=1)
        weights[e + "down_bias"] = down_bias
    return config


FAMILY = ModelFamily(
    name="gpt_oss",
    hf_model_types=("gpt_oss",),
    gguf_architectures=("gpt-oss",),
    config_from_hf=_from_hf,
    config_from_gguf=_from_gguf,
    model=GptOssModel,
    gguf_layer_names={"post_attention_norm": "post_attention_layernorm",
                      "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.gate",
                      "ffn_gate_exps": "mlp.experts.gate", "ffn_up_exps": "mlp.experts.up",
                      "ffn_down_exps": "mlp.experts.down"},
    hf_fixup=_hf_fixup,
    gguf_fixup=_gguf_fixup,
)
