"""Our Llama-family forward pass (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5) over a paged KV pool.

One call runs a variable-length batch: decode tokens of many requests and prefill chunks of
others, flattened into one token axis (no padding of the projections or the MLP). The layers
know nothing of scheduling, kernels or quantization: attention is the step's attention
backend (`batch.attention`, planned once per step by the runner), projections are `Linear`
layers whose method decides how they run, and the norms and the rotary embedding use the
fused `LayerOps` the engine passes in where it runs them (PyTorch's ops otherwise). Where every
part of a layer has a C++ form, a step's layers run as one C++ call of the same kernels
(`DecoderStack`), with the same bits. This module is the architecture only: the weights are
read by radixserve/model/loader.py and put into these modules by radixserve/model/weights.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.attention import LayerAttention, LayerKV
from radixserve.layers.linear import DenseLinear, Linear, LinearMethod
from radixserve.model.config import ModelConfig
from radixserve.model.decoder_stack import DecoderStack, StackLayer
from radixserve.model.forward_batch import ForwardBatch, Rotary

if TYPE_CHECKING:
    from radixserve.kernels import LayerOps

FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what LayerOps computes


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the model's scaling applied; on the
    CPU whatever the default device (on the meta device, where a model is built before its
    weights load, arange goes through torch._refs, which import torch._dynamo, slowing every
    start)."""
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (config.rope_theta ** (steps / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, blended, inv)
    elif kind == "factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        inv = inv / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind is not None:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    return inv.float()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as HF does, so bfloat16 runs stay close to the float32 ones.
        if self._fused(x):
            return self.ops.rms_norm(x.contiguous(), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm); with no delta, (residual, its norm). One call where
        the fused ops run: between a decode step's matmuls every dispatch counts."""
        if delta is None:
            return residual, self(residual)
        if self._fused(residual) and delta.dtype == residual.dtype:
            return self.ops.add_rms_norm(residual.contiguous(), delta.contiguous(), self.weight,
                                         self.eps)
        residual = residual + delta
        return residual, self(residual)

    def _fused(self, x: torch.Tensor) -> bool:
        return self.ops is not None and x.is_cpu and x.dtype in FUSED_DTYPES and x.dim() == 2


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearMethod,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        # q, k and v in one matmul: one weight read per token instead of three.
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias,
                               linear)
        self.o_proj = Linear(q_size, config.hidden_size, False, linear)
        # This layer's own window, scale or sinks; None: the model's (see LayerAttention).
        self.layer_attention: LayerAttention | None = None

    def forward(self, x: torch.Tensor, rotary: Rotary, batch: ForwardBatch, cache: LayerKV,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for `rows` of x (None: all), the K/V of every row written."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)
        rotated = self.num_heads + self.num_kv_heads
        # q and k heads rotate together: one call (or one set of PyTorch ops) instead of two.
        if self.ops is not None and qkv.is_cpu and qkv.dtype in FUSED_DTYPES:
            qkv = qkv.contiguous()
            self.ops.rotary_embedding_(qkv, rotary.cos, rotary.sin, rotated)
            qk = qkv[:, :rotated]
        else:
            qk = rotary.rotate(qkv[:, :rotated])
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, rotated:]
        out = batch.attention.forward(q, k, v, cache, batch.attention_plan,
                                      self.layer_attention).view(tokens, -1)
        return self.o_proj(out if rows is None else out[rows])


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearMethod,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate = config.intermediate_size
        # gate and up in one matmul, for the same reason as qkv.
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False,
                                   linear)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and gate_up.is_cpu and gate_up.dim() == 2:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearMethod,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, linear, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, linear, ops)

    def stack_layer(self) -> StackLayer:
        """This layer's parts as the C++ decoder stack takes them."""
        return StackLayer(self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj,
                          self.mlp.down_proj, self.input_layernorm.weight,
                          self.post_attention_layernorm.weight)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; see `forward`. Every projection runs
    through `linear` (see radixserve.layers.linear); `ops`, where given, runs the norms and
    the rotary embedding of CPU steps in float32 or bfloat16."""

    def __init__(self, config: ModelConfig, linear: LinearMethod | None = None,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.linear_method = linear = linear or DenseLinear()
        # With a weight given, nn.Embedding skips its random init, whose normal_ on the meta
        # device imports torch._dynamo (slowing every start); the loader sets the weight.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size,
                                                             config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, linear, ops)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, linear)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.ops = ops
        # The layers as one C++ call per step, built once the weights are loaded (None: the
        # Python layers run every step; see radixserve/model/decoder_stack.py).
        self.stack: DecoderStack | None = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: list[LayerKV]) -> torch.Tensor:
        """Runs the batch, writing its K/V into the caches; returns float32 logits [R, vocab]."""
        return self.compute_logits(self.hidden_states(batch, caches)[batch.logit_rows])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of rows of `hidden_states`; each row is independent, so a
        caller may project many rows a slice at a time (prompt log-probabilities do)."""
        return self.lm_head(self.norm(hidden)).float()

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, caches: list[LayerKV]) -> torch.Tensor:
        """Runs the batch, writing its K/V into the caches; returns the last layer's output
        for the batch's output rows ([T, hidden] where it names none), before the final norm
        (see `compute_logits`)."""
        x = self.embed_tokens(batch.input_ids)
        angles = batch.positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq
        rotary = Rotary(angles.cos(), angles.sin())  # [T, D / 2] each
        if self.stack is not None:
            hidden = self.stack.run(x, rotary, batch, caches)
            if hidden is not None:
                return hidden
        residual, h = x, None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # Each norm takes the residual add before it (the previous block's output).
            residual, x = layer.input_layernorm.add_and_norm(residual, h)
            rows = batch.output_rows if i == last else None
            h = layer.self_attn(x, rotary, batch, caches[i], rows)
            if rows is not None:
                residual = residual[rows]
            residual, x = layer.post_attention_layernorm.add_and_norm(residual, h)
            h = layer.mlp(x)
        return residual if h is None else residual + h
