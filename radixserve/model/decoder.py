"""A decoder-only model over a paged KV pool: embedding, the family's decoder layers, final
norm and LM head. Every family is one of these; a family module changes what its config
says (radixserve/model/config.py) and, where it must, the MLP of a layer (`make_mlp`).

One call runs a variable-length batch: decode tokens of many requests and prefill chunks of
others, flattened into one token axis (no padding of the projections or the MLP). Where every
part of a layer has a C++ form, a step's layers run as one C++ call of the same kernels
(`DecoderStack`), with the same bits. The weights are read by radixserve/model/loader.py and
put into these modules by radixserve/model/weights.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from radixserve.layers.attention import LayerKV
from radixserve.layers.linear import DenseLinear, Linear, LinearMethod
from radixserve.model.blocks import MLP, DecoderLayer, RMSNorm
from radixserve.model.config import ModelConfig, RopeConfig
from radixserve.model.decoder_stack import DecoderStack, StackLayer
from radixserve.model.forward_batch import ForwardBatch, Rotary
from radixserve.model.rope import RopeTable, rope_table

if TYPE_CHECKING:
    from radixserve.kernels import LayerOps


class DecoderModel(nn.Module):
    """See the module's docstring and `forward`. Every projection runs through `linear` (see
    radixserve.layers.linear); `ops`, where given, runs the norms and the rotary embedding of
    CPU steps in float32 or bfloat16. `max_context` is the longest context the engine serves
    (it picks LongRoPE's factors; None: the model's own length)."""

    # Our fused projections and their HF parts, in output order, as the loader fuses them (a
    # checkpoint that stores one already fused, as Phi-3 does, is read as it is).
    fused_projections: ClassVar[dict[str, tuple[str, ...]]] = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }

    def __init__(self, config: ModelConfig, linear: LinearMethod | None = None,
                 ops: LayerOps | None = None, max_context: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.linear_method = linear = linear or DenseLinear()
        self.ops = ops
        self.max_context = max_context or config.max_position_embeddings
        # With a weight given, nn.Embedding skips its random init, whose normal_ on the meta
        # device imports torch._dynamo (slowing every start); the loader sets the weight.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size,
                                                             config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, self.make_mlp(i), linear, ops)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, linear)
        # Each distinct rotary embedding once, and which one each layer uses (None: no RoPE).
        ropes: list[RopeConfig] = []
        self.layer_rope: list[int | None] = []
        for i in range(config.num_layers):
            rope = config.layer_rope(i)
            if rope is not None and rope not in ropes:
                ropes.append(rope)
            self.layer_rope.append(None if rope is None else ropes.index(rope))
        self.rope_tables: list[RopeTable] = [
            rope_table(rope, config.rotary_dim, self.max_context) for rope in ropes]
        # The layers as one C++ call per step, built once the weights are loaded (None: the
        # Python layers run every step; see radixserve/model/decoder_stack.py).
        self.stack: DecoderStack | None = None

    def make_mlp(self, layer: int) -> nn.Module:
        """Layer `layer`'s MLP, a module mapping [T, hidden] to [T, hidden] (a mixture-of-experts
        family returns its MoE block where the config puts one)."""
        return MLP(self.config, self.linear_method, self.ops)

    def stack_blocker(self) -> str | None:
        """What keeps this model's layers off the C++ decoder stack (None: nothing), for the
        log: the stack runs Llama-shaped layers only."""
        cfg = self.config
        reasons = [
            (cfg.qk_norm, "QK-norm"),
            (cfg.rotary_dim != cfg.head_dim, "partial rotary"),
            (not cfg.uniform_layers, "per-layer attention (windows or RoPE)"),
            (self.layer_rope[0] is None, "layers without RoPE"),
            (cfg.hidden_act != "silu", f"the {cfg.hidden_act} activation"),
            (cfg.sandwich_norms, "sandwich norms"),
            (cfg.moe is not None, "mixture-of-experts layers"),
            (cfg.attention_scale is not None, "its own attention scale"),
            (any(not isinstance(layer.mlp, MLP) for layer in self.layers), "its MLP"),
        ]
        found = [reason for blocked, reason in reasons if blocked]
        return ", ".join(found) or None

    def stack_layers(self) -> list[StackLayer]:
        """Each layer's parts as the C++ decoder stack takes them (see `stack_blocker`)."""
        return [StackLayer(layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj,
                           layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
                for layer in self.layers]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: list[LayerKV]) -> torch.Tensor:
        """Runs the batch, writing its K/V into the caches; returns float32 logits [R, vocab]."""
        return self.compute_logits(self.hidden_states(batch, caches)[batch.logit_rows])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of rows of `hidden_states`; each row is independent, so a
        caller may project many rows a slice at a time (prompt log-probabilities do)."""
        logits = self.lm_head(self.norm(hidden)).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, caches: list[LayerKV]) -> torch.Tensor:
        """Runs the batch, writing its K/V into the caches; returns the last layer's output
        for the batch's output rows ([T, hidden] where it names none), before the final norm
        (see `compute_logits`)."""
        x = self.embed_tokens(batch.input_ids)
        if self.config.embedding_scale is not None:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        rotaries = [self._rotary(table, batch.positions) for table in self.rope_tables]
        if self.stack is not None:
            hidden = self.stack.run(x, rotaries[0], batch, caches)
            if hidden is not None:
                return hidden
        residual, h = x, None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rope = self.layer_rope[i]
            rows = batch.output_rows if i == last else None
            residual, h = layer(residual, h, None if rope is None else rotaries[rope], batch,
                                caches[i], rows)
        return residual if h is None else residual + h

    @staticmethod
    def _rotary(table: RopeTable, positions: torch.Tensor) -> Rotary:
        inv_freq = table.inv_freq.to(positions.device)
        angles = positions.to(inv_freq.dtype).unsqueeze(-1) * inv_freq
        cos, sin = angles.cos(), angles.sin()  # [T, rotary_dim / 2] each
        if table.magnitude != 1.0:
            cos, sin = cos * table.magnitude, sin * table.magnitude
        return Rotary(cos, sin)
