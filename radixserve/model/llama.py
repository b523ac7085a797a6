"""Our Llama-family forward pass (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5) over a paged KV pool.

One call runs a variable-length batch: decode tokens of many requests and prefill chunks of
others, flattened into one token axis (no padding of the projections or the MLP). The layers
know nothing of scheduling, kernels or quantization: attention is the step's attention
backend (`batch.attention`, planned once per step by the runner), projections are `Linear`
layers whose method decides how they run, and the norms and the rotary embedding use the
fused `LayerOps` the engine passes in where it runs them (PyTorch's ops otherwise). Where every
part of a layer has a C++ form, a step's layers run as one C++ call of the same kernels
(`DecoderStack`), with the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from radixserve.layers.attention import LayerKV, StepAttention, StepPlan
from radixserve.layers.linear import DenseLinear, Linear, LinearMethod, PanelEmbedding
from radixserve.layers.quantized import QuantizedEmbedding
from radixserve.layers.quantized_weight import EXECUTED_TYPES, PackedParts, QuantizedWeight
from radixserve.model.config import ModelConfig
from radixserve.model.decoder_stack import DecoderStack

if TYPE_CHECKING:
    from radixserve.kernels import LayerOps

FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what LayerOps computes


@dataclass(frozen=True)
class ForwardBatch:
    """One step's tokens and how they attend. Rows [0, D) are decode tokens (one per
    request), prefill chunks follow; `attention.forward(..., attention_plan)` knows which."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    # [R] rows of hidden_states' result whose next-token logits are wanted
    logit_rows: torch.Tensor
    attention: StepAttention
    attention_plan: StepPlan
    # [O] ascending rows whose last-layer output hidden_states returns; None: every row. The
    # other rows' last layer stops once their K/V is written: nothing reads the rest.
    output_rows: torch.Tensor | None = None


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the model's scaling applied; on the
    CPU whatever the default device (on the meta device, where a model is built before its
    weights load, arange goes through torch._refs, which import torch._dynamo: 1.6 s)."""
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


@dataclass(frozen=True)
class Rotary:
    """A step's rotary angles: cos and sin [T, D / 2] in float32."""

    cos: torch.Tensor
    sin: torch.Tensor
    # PyTorch's rotation wants them [T, 1, D] in the model's dtype: made once per step.
    widened: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated "rotate half" style, in x's dtype (PyTorch's ops)."""
        if x.dtype not in self.widened:
            self.widened[x.dtype] = tuple(  # type: ignore[assignment]
                torch.cat((t, t), dim=-1).unsqueeze(1).to(x.dtype) for t in (self.cos, self.sin))
        cos, sin = self.widened[x.dtype]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


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
        out = batch.attention.forward(q, k, v, cache, batch.attention_plan).view(tokens, -1)
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
        # device imports torch._dynamo (1.6 s of every start); the loader sets the weight.
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

    def load_hf_weights(self, weights: dict[str, torch.Tensor | QuantizedWeight],
                        dtype: torch.dtype, progress: bool = False) -> None:
        """Takes HF-named weights, fusing q/k/v and gate/up; casts float ones to `dtype`.
        `QuantizedWeight`s (GGUF blocks the linear method executes) are packed for the
        kernel, layer by layer (with a progress bar if asked). Empties `weights`, so that
        each matrix's blocks are freed once packed: a model's blocks and panels never all
        exist at once."""
        cfg = self.config
        embed = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight")
        tied = head is None or cfg.tie_word_embeddings
        state: dict[str, torch.Tensor | QuantizedWeight | list] = {
            "embed_tokens.weight": embed,
            "norm.weight": weights["model.norm.weight"],
            "lm_head.weight": embed if tied else head,
        }
        for i in range(cfg.num_layers):
            p, ours = f"model.layers.{i}.", f"layers.{i}."
            state[ours + "input_layernorm.weight"] = weights[p + "input_layernorm.weight"]
            state[ours + "post_attention_layernorm.weight"] = weights[
                p + "post_attention_layernorm.weight"
            ]
            state[ours + "self_attn.qkv_proj.weight"] = [
                weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            if cfg.attention_bias:
                state[ours + "self_attn.qkv_proj.bias"] = [
                    weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]
            state[ours + "self_attn.o_proj.weight"] = weights[p + "self_attn.o_proj.weight"]
            state[ours + "mlp.gate_up_proj.weight"] = [
                weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
            state[ours + "mlp.down_proj.weight"] = weights[p + "mlp.down_proj.weight"]
        weights.clear()
        floats = self._take_quantized(state, dtype, tied, progress)
        missing, unexpected = self.load_state_dict(floats, strict=False, assign=True)
        missing = [m for m in missing if m != "inv_freq"]
        if missing or unexpected:
            raise ValueError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
        self.to(dtype)
        self.inv_freq = rope_inv_freq(cfg).to(self.norm.weight.device)
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.prepare(module)
        if tied and isinstance(self.embed_tokens, nn.Embedding) and \
                getattr(self.lm_head, "panels", None) is not None:
            # The head was repacked into panels (float-panels): read the table from them
            # rather than hold it twice.
            self.embed_tokens = PanelEmbedding(self.lm_head, dtype)
        self.stack = DecoderStack.build(self, dtype)

    def weight_formats(self) -> dict[str, int]:
        """Bytes of weights held, by format: GGUF panels by type (a table shared by the
        embedding and a tied head counted once), float tensors by dtype."""
        type_names = {type_id: name for name, type_id in EXECUTED_TYPES.items()}
        held: dict[str, int] = {}
        tables: dict[int, PackedParts] = {}
        for module in self.modules():
            packed = getattr(module, "packed", None)
            if isinstance(packed, PackedParts):
                tables[id(packed)] = packed
        for packed in tables.values():
            for panels, type_id in zip(packed.panels, packed.types, strict=True):
                name = type_names[type_id]
                held[name] = held.get(name, 0) + panels.numel()
        for tensor in self.parameters():
            name = str(tensor.dtype).removeprefix("torch.")
            held[name] = held.get(name, 0) + tensor.numel() * tensor.element_size()
        return held

    def _take_quantized(self, state: dict[str, Any], dtype: torch.dtype, tied: bool,
                        progress: bool) -> dict[str, torch.Tensor]:
        """Hands quantized weights to their layers and returns the float state; fused parts
        (lists) are concatenated, or kept as quantized parts where all of them are."""
        floats: dict[str, torch.Tensor] = {}
        quantized = any(isinstance(p, QuantizedWeight) for value in state.values()
                        for p in (value if isinstance(value, list) else [value]))
        for name in tqdm(list(state), desc="Packing weights", unit="tensor",
                         disable=not (progress and quantized)):
            value = state.pop(name)  # the only reference left: freed once packed
            parts = value if isinstance(value, list) else [value]
            if all(isinstance(p, QuantizedWeight) for p in parts) and name.endswith(".weight"):
                self._load_quantized(name.removesuffix(".weight"), parts, dtype, tied)
            elif isinstance(value, torch.Tensor):
                floats[name] = value  # as it is: a copy would double a large model's peak
            else:  # a fused float (or float and quantized) projection or bias
                floats[name] = torch.cat([
                    p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])
        return floats

    def _load_quantized(self, module: str, parts: list[QuantizedWeight], dtype: torch.dtype,
                        tied: bool) -> None:
        if module == "embed_tokens":
            table = parts[0]
            if (table.rows, table.cols) != (self.config.vocab_size, self.config.hidden_size):
                raise ValueError(f"token embedding {table.rows}x{table.cols} does not match the "
                                 f"model's vocabulary x hidden size {self.config.vocab_size}x"
                                 f"{self.config.hidden_size}")
            self.embed_tokens = QuantizedEmbedding(table, dtype)
        elif module == "lm_head" and tied and isinstance(self.embed_tokens, QuantizedEmbedding):
            self.lm_head.share_packed(self.embed_tokens.packed)  # one copy of a tied table
        else:
            self.get_submodule(module).load_quantized(parts)
