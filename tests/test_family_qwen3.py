"""Qwen3 (dense): QK-norm, from an HF directory and from the GGUF llama.cpp's converter writes.

A tiny random-weight Qwen3 built from transformers' Qwen3Config (2 layers, hidden 64, head_dim
32 over 4 query and 2 KV heads, norms randomised) against transformers in float32: logits and
greedy tokens through the engine (paged KV, chunked prefill), cache on == off and chunked ==
unchunked exactly, the converter's GGUF and its Q8_0 copy, and a mutation (QK-norm dropped)
that the parity check must catch.
"""

from __future__ import annotations

import pytest
import torch

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
)

pytestmark = [pytest.mark.model]

transformers = pytest.importorskip("transformers")

# Float32 both sides; the only differences are summation orders (fused q/k/v, attention).
LOGIT_TOLERANCE = 1e-4
# Quantized against float: the RMS of the logit difference over the logits' spread, with
# int8 activations (as llama.cpp multiplies Q8_0 and Q4_1). Q8_0: the converter's file
# requantized, its blocks executed, against the same blocks dequantized; int4: float matrices
# quantized to Q4_1 at load, against the float weights. Measured 0.018-0.024 and 0.20-0.34
# (4-bit Gaussian weights; the default model's own Q4_1 blocks measure 0.79 against float).
Q8_0_TOLERANCE = 0.15
INT4_TOLERANCE = 0.5
PROMPTS = random_prompts((7, 40, 100))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_path) -> FamilyCheckpoint:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=512,
        rope_theta=1000000.0, tie_word_embeddings=False, initializer_range=0.1)
    hf = transformers.Qwen3ForCausalLM(config)
    perturb_norms(hf, 1.0, 0.3)
    return build_family_checkpoint(hf, tmp_path_factory.mktemp("qwen3"), model_path)


def test_hf_directory_matches_transformers(checkpoint):
    llm = fresh_llm(checkpoint.directory)
    assert (llm.engine.model_config.family, llm.engine.model_config.qk_norm) == ("qwen3", True)
    gaps = logit_gaps(llm, checkpoint.hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps
    llm.engine.config.max_num_batched_tokens = 16  # the prompt prefills in chunks
    assert greedy_divergence(llm, checkpoint.hf, PROMPTS[2][:50], 8) is None


def test_converted_gguf_matches_transformers(checkpoint):
    llm = fresh_llm(checkpoint.gguf, quantization="none")
    assert llm.engine.model_config.architecture == "qwen3"
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


@pytest.mark.parametrize("mutate", [_drop_qk_norm], ids=["no-qk-norm"])
def test_parity_check_catches_a_missing_feature(checkpoint, mutate):
    llm = fresh_llm(checkpoint.directory, mutate)
    assert max(logit_gaps(llm, checkpoint.hf, PROMPTS)) > 100 * LOGIT_TOLERANCE
