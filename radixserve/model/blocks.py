"""The layers decoder families share: RMSNorm, attention (fused q/k/v, optional QK-norm,
partial or no RoPE, its own window and scale), the gated MLP (SwiGLU or GELU-tanh) and the
decoder layer (pre-norm, or Gemma's sandwich of norms around each block). They know nothing
of scheduling, kernels or quantization: attention is the step's backend (`batch.attention`),
projections are `Linear` layers whose method decides how they run, and the norms and the
rotary embedding use the fused `LayerOps` where given (PyTorch's ops otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.attention import LayerAttention, LayerKV
from radixserve.layers.linear import Linear, LinearMethod
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch, Rotary

if TYPE_CHECKING:
    from radixserve.kernels import LayerOps

FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what LayerOps computes


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm. Gemma's (1 + w) form is this one with 1 added to the weight when
    it is loaded (radixserve/model/family.py)."""

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

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of each head of x [T, heads, D] (QK-norm), as [T, heads, D]."""
        return self(x.reshape(-1, x.shape[-1])).view(x.shape)

    def _fused(self, x: torch.Tensor) -> bool:
        return self.ops is not None and x.is_cpu and x.dtype in FUSED_DTYPES and x.dim() == 2


class Attention(nn.Module):
    """One layer's attention. `rotary` is None for a layer without RoPE; QK-norm, where the
    family has it, normalises each q and k head before the rotation."""

    def __init__(self, config: ModelConfig, linear: LinearMethod,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        # q, k and v in one matmul: one weight read per token instead of three.
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias,
                               linear)
        self.o_proj = Linear(q_size, config.hidden_size, False, linear)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if config.qk_norm \
            else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if config.qk_norm \
            else None
        # The backend scales scores by head_dim ** -0.5; a family with its own scale (Gemma 3's
        # query_pre_attn_scalar) has q multiplied by the ratio.
        scale = config.attention_scale
        self.query_factor = 1.0 if scale is None else scale / config.head_dim**-0.5
        # This layer's own window, scale or sinks; None: the model's (see LayerAttention).
        self.layer_attention: LayerAttention | None = None

    def forward(self, x: torch.Tensor, rotary: Rotary | None, batch: ForwardBatch,
                cache: LayerKV, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for `rows` of x (None: all), the K/V of every row written."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)
        rotated = self.num_heads + self.num_kv_heads
        v = qkv[:, rotated:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm.heads(qkv[:, : self.num_heads]),
                            self.k_norm.heads(qkv[:, self.num_heads : rotated])), dim=1)
        else:
            qk = qkv[:, :rotated]
        if rotary is not None:
            qk = self._rotate(qk, qkv if self.q_norm is None else None, rotary)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.query_factor != 1.0:
            q = q * self.query_factor
        out = batch.attention.forward(q, k, v, cache, batch.attention_plan,
                                      self.layer_attention).view(tokens, -1)
        return self.o_proj(out if rows is None else out[rows])

    def _rotate(self, qk: torch.Tensor, qkv: torch.Tensor | None,
                rotary: Rotary) -> torch.Tensor:
        """q and k heads rotated together: one call (or one set of PyTorch ops) instead of
        two; in place in `qkv` (the projection's output, where qk is a view of it) when the
        fused op runs."""
        whole = self.rotary_dim == self.head_dim
        if whole and self.ops is not None and qk.is_cpu and qk.dtype in FUSED_DTYPES:
            target = qkv.contiguous() if qkv is not None else qk.contiguous()
            self.ops.rotary_embedding_(target, rotary.cos, rotary.sin, qk.shape[1])
            return target[:, : qk.shape[1]]
        if whole:
            return rotary.rotate(qk)
        turned = rotary.rotate(qk[..., : self.rotary_dim])
        return torch.cat((turned, qk[..., self.rotary_dim :]), dim=-1)


class MLP(nn.Module):
    """The gated MLP: act(gate) * up, then down; SwiGLU (silu) or Gemma's GELU-tanh."""

    def __init__(self, config: ModelConfig, linear: LinearMethod,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate = config.intermediate_size
        self.activation = config.hidden_act
        # gate and up in one matmul, for the same reason as qkv.
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False,
                                   linear)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu":
            if self.ops is not None and gate_up.is_cpu and gate_up.dim() == 2:
                return self.down_proj(self.ops.silu_mul(gate_up))
            gate, up = gate_up.split(self.intermediate, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    """Attention and MLP, each with its residual. Pre-norm (Llama): input_layernorm before
    attention, post_attention_layernorm before the MLP. With sandwich norms (Gemma):
    post_attention_layernorm normalises attention's output, pre_ and post_feedforward_layernorm
    wrap the MLP."""

    def __init__(self, config: ModelConfig, mlp: nn.Module, linear: LinearMethod,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.self_attn = Attention(config, linear, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.mlp = mlp
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops) if config.sandwich_norms \
            else None
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops) if config.sandwich_norms \
            else None

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                rotary: Rotary | None, batch: ForwardBatch, cache: LayerKV,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output not yet added to it), for `rows` (None:
        all); `delta` is the previous layer's MLP output (None for the first layer). Each
        norm takes the residual add before it."""
        residual, x = self.input_layernorm.add_and_norm(residual, delta)
        h = self.self_attn(x, rotary, batch, cache, rows)
        if rows is not None:
            residual = residual[rows]
        if self.pre_feedforward_layernorm is None:
            residual, x = self.post_attention_layernorm.add_and_norm(residual, h)
            return residual, self.mlp(x)
        residual, x = self.pre_feedforward_layernorm.add_and_norm(
            residual, self.post_attention_layernorm(h))
        return residual, self.post_feedforward_layernorm(self.mlp(x))
