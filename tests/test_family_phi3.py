"""Phi-3 / Phi-4-mini: fused q/k/v and gate/up, partial rotary and LongRoPE, from an HF
directory and from the GGUF llama.cpp's converter writes.

A tiny random-weight Phi-3 built from transformers' Phi3Config shaped like Phi-4-mini (3/4 of
each head rotates; LongRoPE with random short and long factors, pretraining length 64 of 512)
against transformers in float32. transformers picks LongRoPE's factors per forward call (long
once a sequence passes 64 tokens); an engine picks them once, by its max_model_len (as
llama.cpp does by its context): an engine for 64 tokens is checked on prompts of up to 64,
the default one (512) on longer ones. Then cache on == off and chunked == unchunked exactly,
the converter's GGUF, its Q8_0 copy, int4 at load, and mutations (a wrong rotary share, the
wrong factors) that the parity check must catch.
"""

from __future__ import annotations

import pytest
import torch

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
# tests/test_family_qwen3.py). Measured 0.027-0.044 (Q8_0) and 0.48-0.73 (int4: the tied
# embedding table is Q4_1 too; the default model's own Q4_1 blocks measure 0.79).
Q8_0_TOLERANCE = 0.15
INT4_TOLERANCE = 1.0
ORIGINAL_CONTEXT = 64
SHORT_PROMPTS = random_prompts((7, 40, 56))
LONG_PROMPTS = random_prompts((65, 100, 200), seed=2)


def _phi3(rotary_share: float, **fields):
    """A tiny Phi-3 with LongRoPE (random factors) over `rotary_share` of each head."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    half_rotary = int(32 * rotary_share) // 2  # head_dim 32

    def factors() -> list[float]:
        return (1 + 3 * torch.rand(half_rotary, generator=generator)).tolist()

    config = transformers.Phi3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512,
        original_max_position_embeddings=ORIGINAL_CONTEXT, tie_word_embeddings=True,
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": rotary_share, "short_factor": factors(),
                         "long_factor": factors()}, **fields)
    hf = transformers.Phi3ForCausalLM(config)
    perturb_norms(hf, 1.0, 0.3)
    return hf.float().eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_path) -> FamilyCheckpoint:
    return build_family_checkpoint(_phi3(0.75), tmp_path_factory.mktemp("phi3"), model_path)


@pytest.mark.parametrize("source", ["directory", "gguf"])
def test_matches_transformers_with_short_and_long_factors(checkpoint, source):
    path = getattr(checkpoint, source)
    short = fresh_llm(path, quantization="none", max_model_len=ORIGINAL_CONTEXT)
    config = short.engine.model_config
    assert (config.family, config.rotary_dim) == ("phi3", 24)
    gaps = logit_gaps(short, checkpoint.hf, SHORT_PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps
    long = fresh_llm(path, quantization="none")
    gaps = logit_gaps(long, checkpoint.hf, LONG_PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps
    if source == "directory":
        for llm, prompt in ((short, SHORT_PROMPTS[1]), (long, LONG_PROMPTS[1])):
            llm.engine.config.max_num_batched_tokens = 16  # the prompt prefills in chunks
            assert greedy_divergence(llm, checkpoint.hf, prompt, 8) is None


def test_phi3_with_whole_heads_rotating_runs_on_the_decoder_stack(tmp_path, model_path):
    # Phi-3-mini's shape: every head dimension rotates, and a sliding window (48 tokens here).
    hf = _phi3(1.0, sliding_window=48)
    llm = fresh_llm(save_checkpoint(hf, tmp_path, model_path))
    assert llm.engine.model.stack is not None
    gaps = logit_gaps(llm, hf, LONG_PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps


def test_quantized_copies_agree_with_float(checkpoint):
    q8_0 = quantized_gaps(fresh_llm(checkpoint.gguf_q8_0),
                          fresh_llm(checkpoint.gguf_q8_0, quantization="none"), LONG_PROMPTS)
    int4 = quantized_gaps(fresh_llm(checkpoint.directory, quantization="int4"),
                          fresh_llm(checkpoint.directory), LONG_PROMPTS)
    print(f"quantized logit gaps: Q8_0 {q8_0}, int4 {int4}")
    assert all(0 < gap < Q8_0_TOLERANCE for gap in q8_0), q8_0  # > 0: not the float path
    assert all(0 < gap < INT4_TOLERANCE for gap in int4), int4


def test_cache_on_equals_off_and_chunked_equals_unchunked(checkpoint):
    cached_and_chunked, plain = cache_and_chunking_runs(checkpoint.directory)
    assert cached_and_chunked == plain


def _half_rotary(llm) -> None:
    """Half of each head rotating instead of 3/4, on the first of the same frequencies."""
    model = llm.engine.model
    for layer in model.layers:
        layer.self_attn.rotary_dim = 16
    scaling = model.config.rope_scaling
    truncated = {**scaling, "short_factor": scaling["short_factor"][:8],
                 "long_factor": scaling["long_factor"][:8]}
    model.rope_tables = [rope_table(RopeConfig(model.config.rope_theta, truncated), 16,
                                    model.max_context)]


def _short_factors_on_a_long_context(llm) -> None:
    model = llm.engine.model
    model.rope_tables = [rope_table(model.config.rope, model.config.rotary_dim, 0)]


@pytest.mark.parametrize("mutate", [_half_rotary, _short_factors_on_a_long_context],
                         ids=["partial-rotary-0.5", "short-longrope-factors"])
def test_parity_check_catches_a_wrong_feature(checkpoint, mutate):
    llm = fresh_llm(checkpoint.directory, mutate)
    assert max(logit_gaps(llm, checkpoint.hf, LONG_PROMPTS)) > 100 * LOGIT_TOLERANCE
