"""SmolLM3: no RoPE in every fourth layer, from an HF directory and from the GGUF llama.cpp's
converter writes (its Llama converter: q and k permuted for llama.cpp's RoPE, unpermuted on
load, on float weights and on kept Q8_0 blocks alike).

A tiny random-weight SmolLM3 built from transformers' SmolLM3Config (4 layers, so the last
has no RoPE) against transformers in float32: logits and greedy tokens through the engine,
cache on == off and chunked == unchunked exactly, the converter's GGUF, its Q8_0 copy, int4
at load, and a mutation (RoPE given to the NoPE layer) that the parity check must catch.
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

LOGIT_TOLERANCE = 1e-4  # float32 both sides: summation orders only
# Quantized against float, the RMS of the logit difference over the logits' spread (as in
# tests/test_family_qwen3.py). Measured 0.018-0.032 (Q8_0) and 0.31-0.37 (int4; the tied
# embedding table is Q4_1 too).
Q8_0_TOLERANCE = 0.15
INT4_TOLERANCE = 1.0
PROMPTS = random_prompts((7, 40, 100))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_path) -> FamilyCheckpoint:
    torch.manual_seed(0)
    config = transformers.SmolLM3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512,
        rope_theta=5000000.0, tie_word_embeddings=True, initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert config.no_rope_layers == [1, 1, 1, 0]
    hf = transformers.SmolLM3ForCausalLM(config)
    perturb_norms(hf, 1.0, 0.3)
    return build_family_checkpoint(hf, tmp_path_factory.mktemp("smollm3"), model_path)


@pytest.mark.parametrize("source", ["directory", "gguf"])
def test_matches_transformers(checkpoint, source):
    llm = fresh_llm(getattr(checkpoint, source), quantization="none")
    config = llm.engine.model_config
    assert (config.family, config.rope_layers) == ("smollm3", (True, True, True, False))
    gaps = logit_gaps(llm, checkpoint.hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps
    llm.engine.config.max_num_batched_tokens = 16  # the prompt prefills in chunks
    assert greedy_divergence(llm, checkpoint.hf, PROMPTS[2][:50], 8) is None


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


def _rope_everywhere(llm) -> None:
    model = llm.engine.model
    model.layer_rope = [0] * len(model.layers)


@pytest.mark.parametrize("mutate", [_rope_everywhere], ids=["nope-layer-given-rope"])
def test_parity_check_catches_a_wrong_feature(checkpoint, mutate):
    llm = fresh_llm(checkpoint.directory, mutate)
    assert max(logit_gaps(llm, checkpoint.hf, PROMPTS)) > 100 * LOGIT_TOLERANCE
