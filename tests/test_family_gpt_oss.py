"""gpt-oss: attention sinks, alternating sliding-window and full layers, YaRN RoPE, q/k/v/o
biases, and a mixture-of-experts MLP (biased router, top-k then softmax, clamped SwiGLU),
from an HF directory and from the GGUF llama.cpp's converter writes.

A tiny random-weight gpt-oss built from transformers' GptOssConfig (2 layers: the first on an
8-token window, the second full; hidden 64, 8 experts of FFN 32, top 2; norms and sinks
randomised) against transformers in float32: logits (every expert hit) and greedy tokens
through the engine on prompts longer than the window, cache on == off and chunked ==
unchunked exactly, the converter's GGUF, and its MXFP4 copy (the released models' expert
format, rewritten losslessly to Q8_0 and run by the MoE kernel) within a stated tolerance;
mutations (sinks off, no window, a softmax over all experts) that the parity check must
catch.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.attention import LayerAttention
from radixserve.model.moe import MoEBlock, Routing
from tests.support.families import (
    build_family_checkpoint,
    cache_and_chunking_runs,
    fresh_llm,
    greedy_divergence,
    logit_gaps,
    perturb_norms,
    quantized_gaps,
    random_prompts,
    requantize_gguf,
)

pytestmark = [pytest.mark.model]

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K, WINDOW = 8, 2, 8
LOGIT_TOLERANCE = 1e-4  # float32 both sides: summation orders only
# MXFP4 copy (every matrix and expert; the router and biases stay float, as llama-quantize
# leaves them), executed with int8 activations, against the same blocks dequantized: RMS of
# the logit difference over the logits' spread, measured 0.014-0.019. (With the router
# quantized too, one prompt measured 0.34: a near-tie between two experts flipped.)
MXFP4_TOLERANCE = 0.15
PROMPTS = random_prompts((7, 40, 100))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_path):
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=49152, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, sliding_window=WINDOW, max_position_embeddings=4096,
        tie_word_embeddings=False, initializer_range=0.1)
    hf = transformers.GptOssForCausalLM(config)
    perturb_norms(hf, 1.0, 0.3)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    folder = tmp_path_factory.mktemp("gpt_oss")
    built = build_family_checkpoint(hf, folder, model_path)
    return built, requantize_gguf(built.gguf, folder / "model-mxfp4.gguf", "MXFP4")


def test_hf_directory_matches_transformers_with_every_expert_hit(checkpoint):
    built, _ = checkpoint
    llm = fresh_llm(built.directory)
    config = llm.engine.model_config
    assert (config.family, config.layer_types) == ("gpt_oss",
                                                   ("sliding_attention", "full_attention"))
    layers = llm.engine.model.layers
    assert [layer.self_attn.window for layer in layers] == [WINDOW, None]
    assert all(isinstance(layer.mlp, MoEBlock) for layer in layers)
    hit: set[int] = set()
    block = layers[0].mlp
    hook = block.gate.register_forward_hook(
        lambda module, args, logits: hit.update(block.routing.choose(logits)[0].flatten().tolist()))
    gaps = logit_gaps(llm, built.hf, PROMPTS)
    hook.remove()
    assert hit == set(range(EXPERTS))
    assert max(gaps) < LOGIT_TOLERANCE, gaps
    llm.engine.config.max_num_batched_tokens = 16  # the prompt prefills in chunks
    assert greedy_divergence(llm, built.hf, PROMPTS[2][:50], 8) is None


def test_converted_gguf_matches_transformers(checkpoint):
    built, _ = checkpoint
    llm = fresh_llm(built.gguf, quantization="none")
    assert llm.engine.model_config.architecture == "gpt-oss"
    gaps = logit_gaps(llm, built.hf, PROMPTS)
    assert max(gaps) < LOGIT_TOLERANCE, gaps


def test_mxfp4_copy_agrees_with_its_dequantized_blocks(checkpoint):
    _, mxfp4 = checkpoint
    quantized = fresh_llm(mxfp4)
    experts = quantized.engine.model.layers[0].mlp.experts
    assert experts.panels is not None and experts.panels.gate[1] == 8  # Q8_0, rewritten
    gaps = quantized_gaps(quantized, fresh_llm(mxfp4, quantization="none"), PROMPTS)
    print(f"MXFP4 logit gaps: {gaps}")
    assert all(0 < gap < MXFP4_TOLERANCE for gap in gaps), gaps


def test_cache_on_equals_off_and_chunked_equals_unchunked(checkpoint):
    _, mxfp4 = checkpoint
    cached_in_chunks, off = cache_and_chunking_runs(mxfp4)
    assert cached_in_chunks == off


def _no_sinks(llm) -> None:
    for layer in llm.engine.model.layers:
        layer.self_attn.layer_attention = LayerAttention(window=layer.self_attn.window)


def _no_window(llm) -> None:
    for layer in llm.engine.model.layers:
        layer.self_attn.layer_attention = LayerAttention(sinks=layer.self_attn.sinks)


def _softmax_over_all(llm) -> None:
    for layer in llm.engine.model.layers:
        layer.mlp.routing = Routing("softmax_topk", TOP_K)


@pytest.mark.parametrize("mutate", [_no_sinks, _no_window, _softmax_over_all],
                         ids=["sinks-off", "no-window", "softmax-over-all-experts"])
def test_parity_check_catches_a_missing_feature(checkpoint, mutate):
    built, _ = checkpoint
    llm = fresh_llm(built.directory, mutate)
    assert max(logit_gaps(llm, built.hf, PROMPTS)) > 100 * LOGIT_TOLERANCE


def test_released_mxfp4_experts_decode_as_transformers_decodes_them():
    import gguf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from radixserve.model.gpt_oss import mxfp4_blocks

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 134, (2, 6, 4), dtype=torch.uint8, generator=generator)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    ours = gguf.quants.dequantize(mxfp4_blocks(blocks, scales).reshape(12, -1).numpy(),
                                  gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(ours).view(2, 6, 128), expected)


def test_mxfp4_is_rewritten_to_q8_0_without_loss():
    import gguf
    import numpy as np

    from radixserve.model.quantize import repack

    rng = np.random.default_rng(0)
    # Rows of weights from 1e-5 to 1e3 in magnitude: block scales 2^-18 .. 2^8.
    weights = (rng.standard_normal((64, 256)) * np.logspace(-5, 3, 64)[:, None]).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.MXFP4)
    target, rewritten = repack("MXFP4", raw)
    assert target == "Q8_0" and rewritten.shape == (64, 256 // 32 * 34)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    got = gguf.quants.dequantize(rewritten.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got, want)
    raw[0, 0] = 255  # a scale of 2^127: no model's weights
    with pytest.raises(ValueError, match="exceeds 2"):
        repack("MXFP4", raw)
