"""GGUF loading across tensor types: a small Llama written as GGUF with F32, F16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K and Q6_K tensors loads through our loader and matches HF
transformers' logits on the same file (HF dequantizes and un-permutes GGUF on its own); run
quantized (the file's blocks, rewritten where the kernel needs it, float matrices quantized
for int4) it stays within a stated distance of that reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import LLM
from tests.support.engine import load_hf_gguf

pytestmark = [pytest.mark.model]

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2


def _k_quant_blocks(rows: int, cols: int, kind, rng: np.random.Generator) -> np.ndarray:
    """Raw K-quant blocks with random quants and small, finite fp16 scales.

    gguf-py can dequantize K-quants but not quantize them, so blocks are built by hand.
    """
    blocks = rows * cols // 256
    if kind == Q.Q3_K:  # hmask[32] qs[64] scales[12] (6-bit, minus 32) d (fp16): 110 bytes
        body = rng.integers(0, 256, (blocks, 108), dtype=np.uint8)
        d = np.full((blocks, 1), 0.002, dtype=np.float16).view(np.uint8)
        return np.concatenate([body, d], axis=1).reshape(rows, -1)
    if kind == Q.Q5_K:  # d, dmin (fp16) scales[12] qh[32] qs[128]: 176 bytes
        d = np.full((blocks, 1), 0.002, dtype=np.float16).view(np.uint8)
        dmin = np.full((blocks, 1), 0.001, dtype=np.float16).view(np.uint8)
        rest = rng.integers(0, 256, (blocks, 172), dtype=np.uint8)
        return np.concatenate([d, dmin, rest], axis=1).reshape(rows, -1)
    if kind == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d (fp16): 210 bytes
        body = rng.integers(0, 256, (blocks, 192), dtype=np.uint8)
        scales = rng.integers(-8, 8, (blocks, 16), dtype=np.int8).view(np.uint8)
        d = np.full((blocks, 1), 0.002, dtype=np.float16).view(np.uint8)
        raw = np.concatenate([body, scales, d], axis=1)
    else:  # Q4_K: d, dmin (fp16) scales[12] qs[128]: 144 bytes
        d = np.full((blocks, 1), 0.004, dtype=np.float16).view(np.uint8)
        dmin = np.full((blocks, 1), 0.002, dtype=np.float16).view(np.uint8)
        rest = rng.integers(0, 256, (blocks, 140), dtype=np.uint8)
        raw = np.concatenate([d, dmin, rest], axis=1)
    return raw.reshape(rows, -1)


def _write_gguf(path, tokenizer: dict | None, vocab: int) -> None:
    """The tiny model, its tensors the same on every call; with `tokenizer` (the default
    model's token list, types and merges), else with only the vocabulary's size: all HF
    needs, and its reader parses the 49k-entry arrays twice per load (12 of its 15 s)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if tokenizer is None:
        writer.add_vocab_size(vocab)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["token_type"])
        writer.add_token_merges(tokenizer["merges"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def dense(rows: int, cols: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def add(name: str, rows: int, cols: int, kind) -> None:
        if kind in (Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            writer.add_tensor(name, _k_quant_blocks(rows, cols, kind, rng), raw_dtype=kind)
        elif kind == Q.F32:
            writer.add_tensor(name, dense(rows, cols))
        elif kind == Q.F16:
            writer.add_tensor(name, dense(rows, cols).astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(dense(rows, cols), kind), raw_dtype=kind)

    add("token_embd.weight", vocab, HIDDEN, Q.Q8_0)
    head_dim = HIDDEN // HEADS
    layouts = [
        (Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32),
        (Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.F16, Q.Q4_1, Q.Q5_0, Q.Q5_1),
    ]
    for i, (q, k, v, o, gate, up, down) in enumerate(layouts):
        add(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN, q)
        add(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, k)
        add(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, v)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim, o)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, gate)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, up)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, down)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + dense(1, HIDDEN, 0.1)[0])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + dense(1, HIDDEN, 0.1)[0])
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    add("output.weight", vocab, HIDDEN, Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# int8 activations (per 32 or 256 weights) against float32 activations: the RMS of the logit
# difference over the logits' standard deviation. Measured 0.024 and 0.049 on this random
# model (5 and 60 tokens), 0.03-0.13 on the default model (test_quantized_model.py).
QUANTIZED_LOGIT_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    """The tiny model's file, and a copy of it for HF without the tokenizer (same tensors)."""
    folder = tmp_path_factory.mktemp("tiny")
    reader = gguf.GGUFReader(str(model_path))
    tokenizer = {name: reader.fields[f"tokenizer.ggml.{name}"].contents()
                 for name in ("tokens", "token_type", "merges")}
    _write_gguf(folder / "tiny.gguf", tokenizer, len(tokenizer["tokens"]))
    (folder / "hf").mkdir()
    _write_gguf(folder / "hf" / "tiny.gguf", None, len(tokenizer["tokens"]))
    return folder / "tiny.gguf"


def test_quantized_gguf_matches_hf(tiny):
    llm = LLM(str(tiny), dtype="float32", kv_cache_tokens=1024, show_progress=False,
              quantization="none")  # the reference path: every tensor dequantized to float32
    hf = load_hf_gguf(tiny.parent / "hf", tiny.name)
    assert hf.config.vocab_size == llm.engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for length in (5, 60):
        ids = torch.randint(200, 40000, (length,), generator=generator).tolist()
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).logits[0, -1]
        got = llm.engine.prompt_logits(ids)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported \(supported: llama, mistral, qwen2, "):
        LLM(str(path), show_progress=False)


def test_quantized_execution_follows_the_dequantized_reference(tiny):
    # quantization="auto" keeps every Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrix in its blocks and
    # rewrites Q5_0/Q5_1/Q5_K as Q8_0 and Q3_K as Q6_K (a fused qkv of three formats runs as
    # three parts of one call; gate Q8_0 beside up F16 falls back to float), and multiplies
    # with int8-quantized activations, as llama.cpp does. int4 keeps the same blocks and
    # quantizes the float matrices to Q4_1. Both stay within a stated distance of the
    # dequantized float32 path.
    path = tiny
    settings = dict(dtype="float32", kv_cache_tokens=1024, show_progress=False)
    exact = LLM(str(path), quantization="none", **settings)
    quick = LLM(str(path), quantization="auto", **settings)
    int4 = LLM(str(path), quantization="int4", **settings)
    model = quick.engine.model
    first, second = model.layers
    assert first.self_attn.qkv_proj.packed.types == [12, 14, 2]  # Q4_K, Q6_K, Q4_0
    assert first.mlp.gate_up_proj.packed is None  # Q8_0 + F16: float
    assert first.mlp.down_proj.packed is None  # F32
    assert second.self_attn.qkv_proj.packed.types == [14, 8, 14]  # Q6_K, Q5_K and Q3_K rewritten
    assert second.self_attn.o_proj.packed is None  # F16
    assert second.mlp.gate_up_proj.packed.types == [3, 8]  # Q4_1, Q5_0 rewritten as Q8_0
    assert second.mlp.down_proj.packed.types == [8]  # Q5_1 requantized as Q8_0
    assert model.lm_head.packed.types == [14] and model.embed_tokens.packed.types == [8]
    assert exact.engine.model.lm_head.packed is None
    first, second = int4.engine.model.layers
    assert first.self_attn.qkv_proj.packed.types == [12, 14, 2]  # the file's blocks, kept
    assert first.mlp.gate_up_proj.packed.types == [8, 3]  # Q8_0 kept, F16 quantized
    assert first.mlp.down_proj.packed.types == [3]  # F32 quantized
    assert second.self_attn.o_proj.packed.types == [3]
    generator = torch.Generator().manual_seed(1)
    for length in (5, 60):
        ids = torch.randint(200, 40000, (length,), generator=generator).tolist()
        want = exact.engine.prompt_logits(ids)
        for name, llm in (("auto", quick), ("int4", int4)):
            got = llm.engine.prompt_logits(ids)
            rms = ((got - want).pow(2).mean().sqrt() / want.std()).item()
            print(f"{name}, {length} tokens: logit difference {rms:.4f} of the logits' spread")
            assert 0 < rms <= QUANTIZED_LOGIT_TOLERANCE  # > 0: not the float path

