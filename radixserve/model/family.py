"""What a model family declares: the HF model_types and GGUF architectures it accepts, how it
reads its `ModelConfig` from each, the GGUF tensor names that differ from the common ones,
the fix-ups its weights need once read, its model class, and the reasoning and tool-call
formats its replies use. The common readers here do the
fields every family shares; a family passes what it adds. The registry of families is
radixserve/model/families.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.layers.quantized_weight import QuantizedWeight
from radixserve.model.config import ModelConfig
from radixserve.model.decoder import DecoderModel

Weights = dict[str, torch.Tensor | QuantizedWeight]  # HF names, as the loader reads them
# Changes read weights in place (renames, folds, drops) and returns the config they imply.
WeightsFixup = Callable[[ModelConfig, Weights], ModelConfig]

# GGUF `blk.N.<name>` -> HF `model.layers.N.<name>` (llama.cpp's tensor names, gguf-py's
# constants.py), where every family agrees; a family adds or overrides in `gguf_layer_names`.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class GGUFModel:
    """What a family reads its config from in a GGUF file: the metadata and tensor names."""

    metadata: Mapping[str, Any]
    tensor_names: frozenset[str]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's own key `<arch>.<name>` (llama.cpp's naming)."""
        return self.metadata.get(f"{self.architecture}.{name}", default)


@dataclass(frozen=True)
class ModelFamily:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_from_gguf: Callable[[GGUFModel], ModelConfig]
    model: type[DecoderModel] = DecoderModel
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    hf_fixup: WeightsFixup | None = None
    gguf_fixup: WeightsFixup | None = None
    # What the server reads from this family's replies by default (`--reasoning-parser auto`,
    # `--tool-call-parser` unset): its reasoning format (server/reasoning.py) and its
    # tool-call format (server/tool_calls/parsers.py; None: chosen from the chat template).
    reasoning_parser: str = "none"
    tool_call_parser: str | None = None
    # The family's chat format, for a GGUF file that carries no `tokenizer.chat_template`.
    chat_template: str | None = None

    def hf_name(self, gguf_name: str) -> str:
        """The HF name of a GGUF tensor (unknown ones are an error naming the tensor)."""
        base, _, suffix = gguf_name.rpartition(".")
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            hf = self.gguf_layer_names.get(part) or GGUF_LAYER_NAMES.get(part)
            if hf is None:
                raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for the {self.name} "
                                 "family")
            return f"model.layers.{layer}.{hf}.{suffix}"
        if base in GGUF_TOP_NAMES:
            return f"{GGUF_TOP_NAMES[base]}.{suffix}"
        return gguf_name


def hf_config(raw: dict[str, Any], family: str, **fields: Any) -> ModelConfig:
    """The common fields of an HF config.json (transformers 4.x or 5.x), and `fields`."""
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    # transformers 5 moved rope settings under `rope_parameters`; 4.x keeps them flat.
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = {}
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    base: dict[str, Any] = dict(
        architecture=raw.get("model_type", family),
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        rope_scaling=dict(scaling) or None,
        partial_rotary_factor=rope.get("partial_rotary_factor",
                                       raw.get("partial_rotary_factor", 1.0)),
        sliding_window=window,
        layer_types=tuple(raw["layer_types"]) if window and raw.get("layer_types") else None,
    )
    base.update(fields)
    return ModelConfig(**base)


def gguf_config(gguf: GGUFModel, family: str, **fields: Any) -> ModelConfig:
    """The common fields of a GGUF file's metadata (llama.cpp's keys), and `fields`."""
    key = gguf.key
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length") or hidden // heads
    scaling = None
    if key("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    names = gguf.tensor_names
    base: dict[str, Any] = dict(
        architecture=gguf.architecture,
        family=family,
        vocab_size=key("vocab_size") or len(gguf.metadata["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        rope_scaling=scaling,
        partial_rotary_factor=key("rope.dimension_count", head_dim) / head_dim,
    )
    base.update(fields)
    return ModelConfig(**base)


def unpermute_qk(config: ModelConfig, weights: Weights) -> ModelConfig:
    """Undoes llama.cpp's interleaving of each q and k head's rotary halves (its converter
    does it for Llama-style RoPE), so the weights match HF's rotate-half layout."""
    for i in range(config.num_layers):
        for proj, heads in (("q", config.num_heads), ("k", config.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            weights[name] = _unpermute(weights[name], heads)
    return config


def _unpermute(w: torch.Tensor | QuantizedWeight, n_head: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(w, QuantizedWeight):  # a pure row permutation, applied as the kernel packs
        return w.permute_rows(_unpermute(torch.arange(w.rows), n_head))
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def shift_norms(config: ModelConfig, weights: Weights) -> ModelConfig:
    """Folds Gemma's (1 + w) RMSNorm into the weight, so the common RMSNorm runs it (llama.cpp's
    converter does the same when it writes a GGUF)."""
    for name, tensor in weights.items():
        if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
            weights[name] = tensor.float() + 1.0
    return config
