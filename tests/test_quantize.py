"""Weights written as GGUF blocks at load (radixserve/model/quantize.py): the Q8_0 and Q4_1
quantizers against gguf-py bit for bit, and the rewrites of formats the kernel does not
execute against gguf-py's decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model.quantize import quantize, repack

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
