"""GGUF blocks of random matrices for the quantized kernels' tests: gguf-py quantizes the
formats it can (Q8_0, Q4_0, Q4_1, MXFP4); the K-quants, which it cannot, get random valid
blocks with finite, varied fp16 scales (any other byte is valid)."""

from __future__ import annotations

import numpy as np

K_QUANT_BYTES = {"Q4_K": 144, "Q6_K": 210}


def random_blocks(rows: int, cols: int, type_name: str, seed: int = 0,
                  std: float = 0.05) -> np.ndarray:
    """uint8 [rows, bytes per row] of a random [rows, cols] matrix in `type_name`'s blocks,
    weights of about `std`."""
    import gguf

    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[type_name]
    if type_name not in K_QUANT_BYTES:
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * std
        return gguf.quants.quantize(weights, kind)
    blocks = rows * cols // 256
    if type_name == "Q6_K":  # ql[128] qh[64] scales int8[16] d; |w| ~ d * 32 * 32
        body = rng.integers(0, 256, (blocks, 208), dtype=np.uint8)
        d = rng.uniform(0.2, 1.0, blocks) * std / 600
        return np.concatenate([body, _half(d)], axis=1).reshape(rows, -1)
    # Q4_K: d, dmin, scales[12] (6-bit scales and mins), qs[128]; |w| ~ d * 32 * 8
    d = _half(rng.uniform(0.2, 1.0, blocks) * std / 150)
    dmin = _half(rng.uniform(0.2, 1.0, blocks) * std / 150)
    body = rng.integers(0, 256, (blocks, 140), dtype=np.uint8)
    return np.concatenate([d, dmin, body], axis=1).reshape(rows, -1)


def dequantized(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's float32 decoding of `random_blocks`' output."""
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


def _half(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)
