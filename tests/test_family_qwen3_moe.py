"""Qwen3-MoE: Qwen3's attention with a mixture-of-experts MLP, from an HF directory and from the
GGUF llama.cpp's converter writes.

A tiny random-weight Qwen3-MoE built from transformers' Qwen3MoeConfig (2 layers, hidden 64, 8
experts of FFN 32, top 2 renormalised, norms randomised) against transformers in float32:
logits (every expert hit) and greedy tokens through the engine, cache on == off and chunked ==
unchunked exactly, the converter's GGUF, its Q8_0 copy (experts included, run by the MoE
kernel) and float matrices quantized to Q4_1 at load, and a mutation (the chosen experts'
weights left unnormalised) that the parity check must catch.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model.moe import MoEBlock, Routing
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

EXPERTS, TOP_K = 8, 2
# Float32 both sides; the only differences are summation orders (fused q/k/v, attention, the
# experts' weighted sum).
LOGIT_TOLERANCE = 1e-4
# Quantized against float, RMS of the logit difference over the logits' spread (as
# test_family_qwen3.py states it): Q8_0 blocks of every matrix and expert executed, against
# the same blocks dequantized; float matrices quantized to Q4_1 at load against the floats.
Q8_0_TOLERANCE = 0.15
INT4_TOLERANCE = 0.5
PROMPTS = random_prompts((7, 40, 100))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_path) -> FamilyCheckpoint:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
        max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=False,
        initializer_range=0.1)
    hf = transformers.Qwen3MoeForCausalLM(config)
    perturb_norms(hf, 1.0, 0.3)
    return build_family_checkpoint(hf, tmp_path_factory.mktemp("qwen3_moe"), model_path)


def _experts_hit(llm, prompts: list[list[int]]) -> set[tuple[int, int]]:
    """(layer, expert) pairs the router chose for the prompts' tokens."""
    hit: set[tuple[int, int]] = set()
    hooks = []
    for i, layer in enumerate(llm.engine.model.layers):
        def record(module, args, logits, i=i, block=layer.mlp):
            ids, _ = block.routing.choose(logits.float())
            hit.update((i, e) for e in ids.flatten().tolist())
        hooks.append(layer.mlp.gate.register_forward_hook(record))
    for ids in prompts:
        llm.engine.prompt_logits(ids)
    for hook in hooks:
        hook.remove()
    return hit


def test_hf_directory_matches_transformers_with_every_expert_hit(checkpoint):
    llm = fresh_llm(checkpoint.directory)
    config = llm.engine.model_config
    assert (config.family, config.moe.num_experts, config.moe.norm_topk_prob) == (
        "qwen3_moe", EXPERTS, True)
    assert all(isinstance(layer.mlp, MoEBlock) for layer in llm.engine.model.layers)
    # Every token reaches the first layer's MLP (the last layer's runs only sampled rows).
    assert {(0, e) for e in range(EXPERTS)} <= _experts_hit(llm, PROMPTS)
    gaps = logit_gaps(llm, checkpoint.hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps
    llm.engine.config.max_num_batched_tokens = 16  # the prompt prefills in chunks
    assert greedy_divergence(llm, checkpoint.hf, PROMPTS[2][:50], 8) is None


def test_converted_gguf_matches_transformers(checkpoint):
    llm = fresh_llm(checkpoint.gguf, quantization="none")
    assert llm.engine.model_config.architecture == "qwen3moe"
    gaps = logit_gaps(llm, checkpoint.hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps


def test_quantized_copies_agree_with_float(checkpoint):
    quantized = fresh_llm(checkpoint.gguf_q8_0)
    assert all(layer.mlp.experts.panels is not None for layer in quantized.engine.model.layers)
    q8_0 = quantized_gaps(quantized, fresh_llm(checkpoint.gguf_q8_0, quantization="none"),
                          PROMPTS)
    int4 = fresh_llm(checkpoint.directory, quantization="int4")
    assert int4.engine.model.layers[0].mlp.experts.panels is not None
    int4_gaps = quantized_gaps(int4, fresh_llm(checkpoint.directory), PROMPTS)
    print(f"quantized logit gaps: Q8_0 {q8_0}, int4 {int4_gaps}")
    assert all(0 < gap < Q8_0_TOLERANCE for gap in q8_0), q8_0  # > 0: not the float path
    assert all(0 < gap < INT4_TOLERANCE for gap in int4_gaps), int4_gaps


def test_cache_on_equals_off_and_chunked_equals_unchunked(checkpoint):
    cached_in_chunks, off = cache_and_chunking_runs(checkpoint.gguf_q8_0)
    assert cached_in_chunks == off


def _unnormalised_experts(llm) -> None:
    for layer in llm.engine.model.layers:
        layer.mlp.routing = Routing("softmax_topk", TOP_K, normalize=False)


def test_parity_check_catches_a_wrong_expert_normalisation(checkpoint):
    llm = fresh_llm(checkpoint.directory, _unnormalised_experts)
    assert max(logit_gaps(llm, checkpoint.hf, PROMPTS)) > 100 * LOGIT_TOLERANCE
