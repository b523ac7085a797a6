"""Gemma 3 (text): sliding-window layers with their own RoPE base, QK-norm, (1 + w) norms,
sandwich norms, GELU-tanh, scaled embeddings, from an HF directory and from the GGUF
llama.cpp's converter writes (and a multimodal checkpoint's language model).

A tiny random-weight Gemma 3 built from transformers' Gemma3TextConfig (6 layers: 5 local with
a 16-token window, 1 global; norms randomised around Gemma's 0) against transformers in
float32, on prompts several windows long: logits and greedy tokens through the engine, cache on
== off and chunked == unchunked exactly, the converter's GGUF, its Q8_0 copy, int4 at load; a
query_pre_attn_scalar other than head_dim (GGUF keeps none: llama.cpp derives it, so that
check is HF-only); and mutations the parity check must catch.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.layers.attention import LayerAttention
from radixserve.model.config import RopeConfig
from radixserve.model.rope import rope_table
from tests.support.families import (
    FamilyCheckpoint,
    build_family_checkpoint,
    cache_and_chunking_runs,
    fresh_llm,
    greedy_divergence,
    logit_gaps,
    perturb_norms,
    quantized_gaps,
    random_prompts,
    save_checkpoint,
)

pytestmark = [pytest.mark.model]

transformers = pytest.importorskip("transformers")

LOGIT_TOLERANCE = 1e-4  # float32 both sides: summation orders only
# Quantized against float, the RMS of the logit difference over the logits' spread (as in
# tests/test_family_qwen3.py). Measured 0.018-0.023 (Q8_0) and 0.30-0.40 (int4; the tied
# embedding table is Q4_1 too).
Q8_0_TOLERANCE = 0.15
INT4_TOLERANCE = 1.0
WINDOW = 16
PROMPTS = random_prompts((7, 40, 100))
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=512,
             sliding_window=WINDOW, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)


def _gemma(**fields):
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SHAPE, **fields))
    perturb_norms(hf, 0.0, 0.3)
    return hf.float().eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_path) -> FamilyCheckpoint:
    hf = _gemma(query_pre_attn_scalar=32)
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    return build_family_checkpoint(hf, tmp_path_factory.mktemp("gemma3"), model_path)


@pytest.mark.parametrize("source", ["directory", "gguf"])
def test_matches_transformers(checkpoint, source):
    llm = fresh_llm(getattr(checkpoint, source), quantization="none")
    config = llm.engine.model_config
    assert config.family == "gemma3" and config.layer_window(0) == WINDOW
    assert config.layer_window(5) is None and config.local_rope == RopeConfig(10000.0)
    gaps = logit_gaps(llm, checkpoint.hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps
    llm.engine.config.max_num_batched_tokens = 16  # the prompt prefills in chunks
    assert greedy_divergence(llm, checkpoint.hf, PROMPTS[2][:50], 8) is None


def test_its_own_attention_scale_matches_transformers(tmp_path, model_path):
    hf = _gemma(query_pre_attn_scalar=24)
    llm = fresh_llm(save_checkpoint(hf, tmp_path, model_path))
    assert llm.engine.model_config.attention_scale == 24**-0.5
    gaps = logit_gaps(llm, hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps


def test_a_multimodal_checkpoint_serves_its_language_model(checkpoint, tmp_path):
    # transformers 5's names for Gemma3ForConditionalGeneration; the image encoder is skipped.
    weights = load_file(checkpoint.directory / "model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): tensor
               for name, tensor in weights.items()}
    renamed["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    save_file(renamed, tmp_path / "model.safetensors")
    text = json.loads((checkpoint.directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint.directory / name).read_bytes())
    llm = fresh_llm(tmp_path)
    assert llm.engine.model_config.architecture == "gemma3"
    gaps = logit_gaps(llm, checkpoint.hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps


def test_quantized_copies_agree_with_float(checkpoint):
    q8_0 = quantized_gaps(fresh_llm(checkpoint.gguf_q8_0),
                          fresh_llm(checkpoint.gguf_q8_0, quantization="none"), PROMPTS)
    int4 = quantized_gaps(fresh_llm(checkpoint.directory, quantization="int4"),
                          fresh_llm(checkpoint.directory), PROMPTS)
    print(f"quantized logit gaps: Q8_0 {q8_0}, int4 {int4}")
    assert all(0 < gap < Q8_0_TOLERANCE for gap in q8_0), q8_0  # > 0: not the float path
    assert all(0 < gap < INT4_TOLERANCE for gap in int4), int4


def test_cache_on_equals_off_and_chunked_equals_unchunked(checkpoint):
    cached_and_chunked, plain = cache_and_chunking_runs(checkpoint.directory)
    assert cached_and_chunked == plain


def _drop_qk_norm(llm) -> None:
    for layer in llm.engine.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None


def _norms_as_w(llm) -> None:
    with torch.no_grad():
        for name, parameter in llm.engine.model.named_parameters():
            if name.endswith("norm.weight"):
                parameter -= 1.0


def _window_doubled(llm) -> None:
    for layer in llm.engine.model.layers:
        if layer.self_attn.layer_attention.window is not None:
            layer.self_attn.layer_attention = LayerAttention(window=2 * WINDOW)


def _global_rope_on_local_layers(llm) -> None:
    model = llm.engine.model
    model.layer_rope = [0] * len(model.layers)
    model.rope_tables = [rope_table(model.config.rope, model.config.rotary_dim,
                                    model.max_context)]


@pytest.mark.parametrize("mutate", [_drop_qk_norm, _norms_as_w, _window_doubled,
                                    _global_rope_on_local_layers],
                         ids=["no-qk-norm", "norm-as-w", "window-doubled", "one-rope-base"])
def test_parity_check_catches_a_wrong_feature(checkpoint, mutate):
    llm = fresh_llm(checkpoint.directory, mutate)
    assert max(logit_gaps(llm, checkpoint.hf, PROMPTS)) > 100 * LOGIT_TOLERANCE
