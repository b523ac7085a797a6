"""Gemma 3 (text; 270M-27B): five of every six layers attend to a sliding window with their
own RoPE base (10k; the full layers 1M, scaled on the larger models), QK-norm, (1 + w) RMSNorms
(folded into the weights at load, as llama.cpp's converter does when it writes a GGUF),
sandwich norms around attention and the MLP, a GELU-tanh gated MLP, embeddings scaled by
sqrt(hidden) and scores by query_pre_attn_scalar ** -0.5. A multimodal Gemma 3 checkpoint
(model_type gemma3) is read for its text model: its text_config, its language model's weights.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.config import ModelConfig, RopeConfig
from radixserve.model.family import (
    GGUFModel,
    ModelFamily,
    Weights,
    gguf_config,
    hf_config,
    shift_norms,
)

# Gemma3TextConfig's defaults: a multimodal checkpoint's text_config leaves many fields out.
TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    max_position_embeddings=131072, query_pre_attn_scalar=256, sliding_window=4096,
    tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
)
SLIDING_PATTERN = 6  # every sixth layer is global (transformers' and llama.cpp's default)
LOCAL_ROPE_THETA = 10000.0
GLOBAL_ROPE_THETA = 1000000.0
# llama.cpp's GGUF keeps no query_pre_attn_scalar: it is head_dim, but hidden / heads for the
# 27B (62 layers), llama.cpp's own rule.
LAYERS_27B = 62
_GEMMA_SHAPE: dict[str, Any] = dict(qk_norm=True, hidden_act="gelu_pytorch_tanh",
                                    sandwich_norms=True)

# Gemma's turn format, for a GGUF that carries no template (llama.cpp's GGUF-my-repo files of
# the base models): a system message opens the first user turn, the assistant is "model", and
# a tool result is a user turn (Gemma 3 has no tool role; tools go in as text).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(preamble='') %}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{% endif %}"
    "{% if loop.first and message['role'] == 'system' %}"
    "{% set ns.preamble = text ~ '\n\n' %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<start_of_turn>model\n' ~ (text | trim) ~ '<end_of_turn>\n' }}"
    "{% else %}"
    "{{ '<start_of_turn>user\n' ~ ns.preamble ~ (text | trim) ~ '<end_of_turn>\n' }}"
    "{% set ns.preamble = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    text = {**TEXT_DEFAULTS, **raw.get("text_config", raw)}
    for key, refused in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False),
                         ("hidden_activation", "gelu_pytorch_tanh")):
        if text.get(key, refused) != refused:
            raise ValueError(f"gemma3: {key}={text[key]!r} is not supported")
    layers = text["num_hidden_layers"]
    pattern = text.get("sliding_window_pattern", SLIDING_PATTERN)
    layer_types = text.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    rope = text.get("rope_parameters") or {}
    if "full_attention" in rope:  # transformers 5: one set per layer type
        full, local = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
    else:
        full = {**(text.get("rope_scaling") or {}),
                "rope_theta": text.get("rope_theta", GLOBAL_ROPE_THETA)}
        local = {"rope_theta": text.get("rope_local_base_freq", LOCAL_ROPE_THETA)}
    if local.get("rope_type", local.get("type")) not in (None, "default"):
        raise ValueError("gemma3: a scaled RoPE on the sliding layers is not supported")
    scaling = full if full.get("rope_type", full.get("type")) not in (None, "default") else None
    head_dim, scalar = text["head_dim"], text["query_pre_attn_scalar"]
    return hf_config(
        {**text, "model_type": raw.get("model_type", "gemma3_text")}, "gemma3",
        rope_theta=full.get("rope_theta", GLOBAL_ROPE_THETA), rope_scaling=scaling,
        local_rope=RopeConfig(local.get("rope_theta", LOCAL_ROPE_THETA)),
        sliding_window=text["sliding_window"], layer_types=tuple(layer_types),
        tie_word_embeddings=bool(text["tie_word_embeddings"]),
        attention_scale=None if scalar == head_dim else scalar**-0.5,
        final_logit_softcap=text.get("final_logit_softcapping"),
        **_GEMMA_SHAPE, embedding_scale=text["hidden_size"] ** 0.5,
    )


def _from_gguf(gguf: GGUFModel) -> ModelConfig:
    layers, hidden = gguf.key("block_count"), gguf.key("embedding_length")
    heads = gguf.key("attention.head_count")
    window = gguf.key("attention.sliding_window") or None
    pattern = gguf.key("attention.sliding_window_pattern", SLIDING_PATTERN)
    sliding = ([bool(flag) for flag in pattern] if isinstance(pattern, list) else
               [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)])
    return gguf_config(
        gguf, "gemma3",
        rms_norm_eps=gguf.key("attention.layer_norm_rms_epsilon", 1e-6),
        local_rope=RopeConfig(gguf.key("rope.freq_base_swa", LOCAL_ROPE_THETA)),
        sliding_window=window,
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding)
        if window else None,
        attention_scale=(hidden // heads) ** -0.5 if layers == LAYERS_27B else None,
        final_logit_softcap=gguf.key("final_logit_softcapping"),
        **_GEMMA_SHAPE, embedding_scale=hidden**0.5,
    )

# A multimodal checkpoint's language model, under transformers 4.x's and 5.x's names.
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}


def _hf_fixup(config: ModelConfig, weights: Weights) -> ModelConfig:
    for name in list(weights):
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            weights[_TEXT_PREFIXES[prefix] + name.removeprefix(prefix)] = weights.pop(name)
        elif "vision_tower" in name or "multi_modal_projector" in name:
            del weights[name]  # the image encoder: this engine reads text
    return shift_norms(config, weights)


FAMILY = ModelFamily(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    gguf_architectures=("gemma3",),
    config_from_hf=_from_hf,
    config_from_gguf=_from_gguf,
    gguf_layer_names={"ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"},
    hf_fixup=_hf_fixup,
    chat_template=CHAT_TEMPLATE,
)
