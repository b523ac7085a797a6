"""The shape of a decoder-only model, as a family reads it from an HF config.json or GGUF
metadata (radixserve/model/family.py). The common fields fit every family; the optional ones
say what a family adds (QK-norm, per-layer windows and RoPE, partial rotary, the MLP's
activation, Gemma's norms, mixture-of-experts); `options` holds what only one family has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

LayerType = Literal["full_attention", "sliding_attention"]
Activation = Literal["silu", "gelu_pytorch_tanh"]


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding: its base and scaling (None: plain RoPE). Scaling kinds: linear,
    llama3, longrope (short_factor/long_factor, original_max_position_embeddings, optional
    attention_factor), factors (GGUF's per-frequency divisors)."""

    theta: float
    scaling: dict[str, Any] | None = None


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (radixserve/model/moe.py): each token's router picks
    `experts_per_token` of `num_experts` experts of `expert_intermediate_size`."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()  # layers whose MLP stays dense
    router_bias: bool = False
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the HF model_type (or GGUF general.architecture) it was read as
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8, ...}
    # A sliding window in tokens: every layer's (Mistral v0.1), or with `layer_types` the
    # sliding layers' (Gemma 3).
    sliding_window: int | None = None
    family: str = "llama"  # the registry's name for the family (radixserve/model/families.py)
    layer_types: tuple[LayerType, ...] | None = None  # None: every layer full_attention
    # RoPE of the sliding layers where it differs from the full ones' (Gemma 3's local base).
    local_rope: RopeConfig | None = None
    rope_layers: tuple[bool, ...] | None = None  # False: the layer has no RoPE (SmolLM3)
    partial_rotary_factor: float = 1.0  # the leading share of each head that rotates (Phi-4)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    hidden_act: Activation = "silu"  # the gate's activation
    attention_scale: float | None = None  # None: head_dim ** -0.5
    embedding_scale: float | None = None  # token embeddings times this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # norms after attention and MLP outputs too (Gemma)
    final_logit_softcap: float | None = None
    moe: MoEConfig | None = None
    options: Any = None  # a family's own frozen dataclass, for what no other family has

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        for name in ("layer_types", "rope_layers"):
            per_layer = getattr(self, name)
            if per_layer is not None and len(per_layer) != self.num_layers:
                raise ValueError(f"{name} has {len(per_layer)} entries for {self.num_layers} "
                                 "layers")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives "
                             f"{self.rotary_dim} rotary dimensions of a {self.head_dim}-wide "
                             "head; it must be an even number in (0, head_dim]")

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head rotate."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope(self) -> RopeConfig:
        """The (full-attention layers') rotary embedding."""
        return RopeConfig(self.rope_theta, self.rope_scaling)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer in tokens (None: it attends to the whole context)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> RopeConfig | None:
        """A layer's rotary embedding (None: the layer has none)."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return None
        if self.local_rope is not None and self.layer_window(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def uniform_windows(self) -> bool:
        """Whether every layer has the same sliding window (or none)."""
        return len({self.layer_window(i) for i in range(self.num_layers)}) == 1

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer attends alike: one window, one RoPE (what the C++ decoder
        stack and a single attention environment run)."""
        first = (self.layer_window(0), self.layer_rope(0))
        return all((self.layer_window(i), self.layer_rope(i)) == first
                   for i in range(1, self.num_layers))
