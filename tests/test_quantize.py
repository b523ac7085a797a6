"""Weights written as GGUF blocks at load (radixserve/model/quantize.py): the int8 and int4
quantizers against gguf-py bit for bit; the rewrites of formats the kernel does not execute
against gguf-py's decoding; and the default model, dequantized and saved as a float HF
directory, loaded with quantization none (the reference), int8 and int4."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from radixserve import LLM
from radixserve.layers.linear import Linear
from radixserve.model.loader import load_model_files
from radixserve.model.quantize import quantize, repack
from radixserve.model.weights import weight_formats

pytestmark = [pytest.mark.model]

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random rows of varied scale and tails, and edge blocks: zeros, a constant, values whose
    scaled form is exactly k + 0.5 (where round-half-away and round-half-even differ), a
    block of one sign."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, (rows, cols)) * rng.uniform(1e-3, 3, (rows, 1))
    w[0, :32] = 0
    w[1, :32] = -0.75
    w[2, :32] = np.r_[127, np.arange(31) + 0.5] * np.where(np.arange(32) % 2, -1, 1)
    w[3, :32] = np.abs(w[3, :32]) + 1
    return w.astype(np.float32)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_quantizers_write_the_bytes_gguf_writes(kind):
    # 600 x 576 spans several chunks of the vectorised loop.
    w = _matrix(600, 576, seed=0)
    want = gguf.quants.quantize(w, Q[kind])
    assert np.array_equal(quantize(torch.from_numpy(w), kind).numpy(), want)
    half = torch.from_numpy(w).bfloat16()  # safetensors' usual dtype, widened per chunk
    want = gguf.quants.quantize(half.float().numpy(), Q[kind])
    assert np.array_equal(quantize(half, kind).numpy(), want)
    with pytest.raises(ValueError, match="not a multiple of"):
        quantize(torch.zeros(2, 48), kind)


def _k_blocks(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q3_K / Q5_K blocks (any byte is valid) with finite, varied fp16 scales, built to
    the published layouts: Q3_K hmask[32] qs[64] scales[12] d; Q5_K d dmin scales[12] qh[32]
    qs[128]."""
    def half(size: int) -> np.ndarray:
        return rng.uniform(1e-4, 4e-3, (size, 1)).astype(np.float16).view(np.uint8)

    if kind == "Q3_K":
        return np.concatenate([rng.integers(0, 256, (n, 108), dtype=np.uint8), half(n)], axis=1)
    return np.concatenate([half(n), half(n), rng.integers(0, 256, (n, 172), dtype=np.uint8)],
                          axis=1)


def _decoded(raw: np.ndarray, kind: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, Q[kind])


def test_q5_0_and_q3_k_are_rewritten_without_loss():
    # Q5_0 -> Q8_0 (q = u - 16) and Q3_K -> Q6_K (same sub-blocks, scales and quants): every
    # decoded value is bitwise the file's, and a wrong fifth or high bit would not be.
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 2, (7, 1))).astype(np.float32)
    q5 = gguf.quants.quantize(w, Q.Q5_0)
    q3 = _k_blocks("Q3_K", 6, rng).reshape(3, 220)
    for kind, raw, target, row_bytes in (("Q5_0", q5, "Q8_0", 3 * 34), ("Q3_K", q3, "Q6_K", 420)):
        got_kind, rewritten = repack(kind, raw)
        assert (got_kind, rewritten.shape) == (target, (raw.shape[0], row_bytes))
        want = _decoded(raw, kind)
        assert np.array_equal(_decoded(rewritten.numpy(), target).view(np.uint32),
                              want.view(np.uint32))
        flipped = raw.copy()
        flipped[0, 2] ^= 1  # Q5_0: weight 0's fifth bit; Q3_K: weight 2's high bit
        assert not np.array_equal(_decoded(repack(kind, flipped)[1].numpy(), target), want)


@pytest.mark.parametrize("kind", ["Q5_1", "Q5_K"])
def test_q5_1_and_q5_k_are_requantized_as_q8_0(kind):
    # Offset grids (d * u + m) that Q8_0 cannot hold: each block of 32 decoded values is
    # requantized, bitwise as gguf would quantize gguf's own decoding of the file's blocks.
    # What that adds is small against the file's own error (REPACKED_TYPES): here under 1%
    # of the values' RMS.
    rng = np.random.default_rng(6)
    if kind == "Q5_1":
        raw = gguf.quants.quantize(_matrix(64, 512, seed=1), Q.Q5_1)
    else:
        raw = _k_blocks("Q5_K", 128, rng).reshape(64, 2 * 176)
    target, rewritten = repack(kind, raw)
    values = _decoded(raw, kind)
    assert target == "Q8_0"
    assert np.array_equal(rewritten.numpy(), gguf.quants.quantize(values, Q.Q8_0))
    added = _decoded(rewritten.numpy(), "Q8_0") - values
    assert np.sqrt((added**2).mean() / (values**2).mean()) < 0.01


# ----- the default model as a float HF directory, loaded none / int8 / int4 -----

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three uses of a hammer:",
           "Translate to German: good morning, how are you?"]
SETTINGS = dict(dtype="float32", kv_cache_tokens=1024, show_progress=False)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory, model_path):
    """SmolLM2-135M's weights decoded from its GGUF and saved as bfloat16 safetensors with
    an HF config and tokenizer: a float model as users download them."""
    files = load_model_files(model_path, progress=False)
    cfg, directory = files.config, tmp_path_factory.mktemp("smollm2-bf16")
    save_file({name: w.bfloat16() for name, w in files.weights.items()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": True}))
    files.tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": files.tokenizer.chat_template, "eos_token": files.tokenizer.eos_token,
        "bos_token": files.tokenizer.bos_token}))
    return directory


@pytest.fixture(scope="module")
def reference_logits(float_model) -> list[tuple[list[int], torch.Tensor]]:
    llm = LLM(str(float_model), quantization="none", **SETTINGS)
    return [(ids, llm.engine.prompt_logits(ids))
            for ids in map(llm.tokenizer.encode, PROMPTS)]


# int8: measured 0.04-0.12 of the logits' spread (RMS) on these prompts, mostly from the
# int8 activations. int4: measured 0.20-0.54: this model's projections already sit on a
# Q4_1 grid (requantizing them loses little), its embedding table on Q8_0's (requantized to
# Q4_1 it loses the most). Top-1 tokens agree on every prompt for both.
LOGIT_TOLERANCE = {"int8": 0.2, "int4": 0.75}
BYTES_PER_WEIGHT = {"int8": 34 / 32, "int4": 20 / 32}
TYPE_IDS = {"int8": 8, "int4": 3}


@pytest.mark.parametrize("setting", ["int8", "int4"])
def test_float_models_are_quantized_at_load(float_model, reference_logits, setting):
    llm = LLM(str(float_model), quantization=setting, **SETTINGS)
    model = llm.engine.model
    # Every projection and the embedding table in the setting's format; the tied LM head
    # shares the table; nothing else float but the norms.
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight is None and set(m.packed.types) == {TYPE_IDS[setting]}
               for m in linears)
    assert model.embed_tokens.packed.types == [TYPE_IDS[setting]]
    assert model.lm_head.packed is model.embed_tokens.packed
    cfg = llm.engine.model_config
    matrix_weights = sum(p.out_features * p.in_features for p in linears
                         if p is not model.lm_head) + cfg.vocab_size * cfg.hidden_size
    held = weight_formats(model)
    assert held.pop("float32") == (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    assert held == {"Q8_0" if setting == "int8" else "Q4_1":
                    matrix_weights * BYTES_PER_WEIGHT[setting]}
    for ids, want in reference_logits:
        got = llm.engine.prompt_logits(ids)
        rms = ((got - want).pow(2).mean().sqrt() / want.std()).item()
        print(f"{setting}: logit difference {rms:.3f} of the logits' spread (RMS)")
        assert 0 < rms < LOGIT_TOLERANCE[setting]
        assert got.argmax() == want.argmax()
