"""GGUF blocks written at load time: float matrices quantized for `quantization=int8|int4`,
and file blocks of a format the kernels do not execute rewritten into one they do.

Vectorised numpy over chunks of rows, so each chunk's temporaries stay in cache, on as many
threads as torch uses (numpy's ufuncs release the GIL): a 1B-parameter model quantizes in
seconds. The round-to-nearest quantizers (Q8_0, Q4_1) write the bytes `gguf.quants.quantize`
writes, which are ggml's `quantize_row_*_ref`. What each rewrite costs in accuracy is stated at
REPACKED_TYPES (radixserve/layers/quantized.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# The block format float matrices are quantized to, per `quantization` setting; the
# embedding and LM head take it too. int8: Q8_0, ggml's per-32 fp16 scale, round to nearest.
# int4: Q4_1 (d and m per 32 weights, 5.0 bits per weight), measured against Q4_0 (4.5 bits)
# and a Q4_K quantizer of ours (4.5 bits; min/max per sub-block, two least-squares refits).
# Relative RMS error of the weights, Q4_1 / Q4_0 / Q4_K: 7.8 / 8.6 / 7.4% on Gaussian data,
# 9.4 / 11.5 / 9.0% on Student-t(4), 8.7 / 10.4 / 8.3% on SmolLM2's embedding. Logits of
# SmolLM2-135M (its Q4_1 blocks decoded and de-gridded with noise uniform in +-d/2, so that
# no format meets its own grid; table at Q8_0) against that float model, RMS difference
# over the logits' spread on 6 prompts: 0.79 / 1.16 / 0.94 (Q4_K where a row is a multiple
# of 256, Q4_1 elsewhere), top-1 token agreeing on 4 / 1 / 4. Q4_1 wins on logits, its kernel
# prefills faster than Q4_K's (benchmarks/bench_quant_matmul.py) and decodes as fast, it takes any
# row that is a multiple of 32, and gguf-py checks it bit for bit. The table at Q4_1 rather
# than Q8_0 measured 0.83 against 0.79, the same top-1 tokens: one format for every matrix.
QUANTIZE_TO = {"int8": "Q8_0", "int4": "Q4_1"}

# Weights per chunk: 1 MB of float32, so a few temporaries of it stay in L2.
_CHUNK_ELEMENTS = 1 << 18

BLOCK_SIZES = {"Q8_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q3_K": 256,
               "Q5_K": 256, "Q6_K": 256, "MXFP4": 32}
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q3_K": 110,
               "Q5_K": 176, "Q6_K": 210, "MXFP4": 17}


def quantize(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """A float [rows, cols] matrix (any float dtype) as Q8_0 or Q4_1 blocks, uint8
    [rows, bytes per row]; cols must be a multiple of 32."""
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"a row of {cols} is not a multiple of {type_name}'s block of 32")
    encode = _ENCODERS[type_name]
    out = torch.empty(rows, cols // 32 * BLOCK_BYTES[type_name], dtype=torch.uint8)
    blocks_out = out.numpy().reshape(-1, BLOCK_BYTES[type_name])
    step = max(1, _CHUNK_ELEMENTS // cols)

    def encode_rows(start: int) -> None:
        chunk = _float32(weight[start : start + step]).reshape(-1, 32)
        first = start * cols // 32
        encode(chunk, blocks_out[first : first + chunk.shape[0]])

    _run_chunks(encode_rows, range(0, rows, step))
    return out


def repack(type_name: str, raw: np.ndarray) -> tuple[str, torch.Tensor]:
    """Blocks of a format the kernels do not execute (uint8 [rows, bytes per row]) rewritten
    as blocks of one they do: (that format, uint8 [rows, its bytes per row]). Q5_0 and Q3_K
    keep every value; Q5_1 and Q5_K are requantized to Q8_0 (see REPACKED_TYPES)."""
    target, rewrite = _REPACKS[type_name]
    rows = raw.shape[0]
    blocks = raw.reshape(-1, BLOCK_BYTES[type_name])
    ratio = BLOCK_BYTES[target] * BLOCK_SIZES[type_name] // BLOCK_SIZES[target]
    out = torch.empty(rows, raw.shape[1] // BLOCK_BYTES[type_name] * ratio, dtype=torch.uint8)
    out_blocks = out.numpy().reshape(blocks.shape[0], ratio)
    step = max(1, _CHUNK_ELEMENTS // BLOCK_SIZES[type_name])

    def rewrite_blocks(start: int) -> None:
        rewrite(blocks[start : start + step], out_blocks[start : start + step])

    _run_chunks(rewrite_blocks, range(0, blocks.shape[0], step))
    return target, out


def _run_chunks(work: Callable[[int], None], starts: Iterable[int]) -> None:
    """`work(start)` for each start, on torch's thread count (chunks write disjoint rows)."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for _ in pool.map(work, starts):  # re-raises a chunk's exception
            pass


def _float32(rows: torch.Tensor) -> np.ndarray:
    """A chunk of rows as float32, widened in numpy: torch's own cast wakes its thread pool
    for every small chunk, which on busy cores costs more than the cast itself."""
    if rows.dtype == torch.float32:
        return rows.numpy()
    if rows.dtype == torch.bfloat16:  # the top half of a float32
        return (rows.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(
            np.float32)
    if rows.dtype == torch.float16:
        return rows.numpy().astype(np.float32)
    return rows.float().numpy()


# ----- round-to-nearest encoders: float32 [n, 32] -> blocks [n, block bytes] -----


def _round_away(x: np.ndarray) -> np.ndarray:
    """Halves away from zero, as ggml's roundf (gguf's np_roundf); every step is exact."""
    a = np.abs(x)
    whole = np.floor(a)
    whole += a - whole >= np.float32(0.5)
    return np.copysign(whole, x)


def _half_bytes(values: np.ndarray) -> np.ndarray:
    """float32 [n, 1] -> their fp16 little-endian bytes, uint8 [n, 2]."""
    return values.astype("<f2").view(np.uint8)


def _half_values(raw: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] little-endian fp16 -> float32 [n, 1]."""
    return raw.copy().view("<f2").astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d)


def _encode_q8_0(x: np.ndarray, out: np.ndarray) -> None:
    # d = max|x| / 127, q = roundf(x / d): ggml's quantize_row_q8_0_ref.
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    out[:, :2] = _half_bytes(d)
    out[:, 2:] = _round_away(x * _inverse(d)).astype(np.int8).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] of values < 16 -> [n, 16]: weight j is the low nibble of byte j, weight
    j + 16 the high one."""
    return q[:, :16] | (q[:, 16:] << 4)


def _encode_q4_1(x: np.ndarray, out: np.ndarray) -> None:
    # d = (max - min) / 15, m = min, q = trunc((x - min) / d + 0.5), clamped to 15.
    low, high = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (high - low) / np.float32(15)
    q = np.trunc((x - low) * _inverse(d) + np.float32(0.5))
    out[:, :2] = _half_bytes(d)
    out[:, 2:4] = _half_bytes(low)
    out[:, 4:] = _nibbles(np.minimum(q, 15).astype(np.uint8))


_ENCODERS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "Q8_0": _encode_q8_0,
    "Q4_1": _encode_q4_1,
}


# ----- rewrites: file blocks [n, bytes] -> executed blocks [n, bytes of the same weights] -----


def _five_bit_quants(low_nibbles: np.ndarray, high_bits: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 quants u in 0..31, uint8 [n, 32]: the nibbles laid out as in Q4_0, and bit j
    of the little-endian uint32 `high_bits` ([n, 4] bytes) is weight j's fifth bit."""
    high = high_bits.copy().view("<u4")  # [n, 1]
    u = np.empty((low_nibbles.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(low_nibbles, 0x0F, out=u[:, :16])
    np.right_shift(low_nibbles, 4, out=u[:, 16:])
    u |= (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    return u


def _q5_0_as_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # Q5_0 (fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles) holds x = d * (u - 16); Q8_0
    # holds x = d * q, so q = u - 16 with the same d gives the same float32 values.
    u = _five_bit_quants(blocks[:, 6:], blocks[:, 2:6])
    out[:, :2] = blocks[:, :2]
    out[:, 2:] = (u.astype(np.int8) - 16).view(np.uint8)


def _q5_1_as_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # Q5_1 (fp16 d, fp16 m, fifth bits, nibbles) holds x = d * u + m: an offset grid Q8_0
    # cannot hold exactly. The decoded values (as gguf decodes them) are requantized.
    u = _five_bit_quants(blocks[:, 8:], blocks[:, 4:8]).astype(np.float32)
    values = u * _half_values(blocks[:, :2]) + _half_values(blocks[:, 2:4])
    _encode_q8_0(values, out)


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins -> two uint8 [n, 8]: bytes
    0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for
    the mins, bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    first, second, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([first & 0x3F, (low & 0x0F) | ((first >> 2) & 0x30)], axis=1)
    mins = np.concatenate([second & 0x3F, (low >> 4) | ((second >> 2) & 0x30)], axis=1)
    return scales, mins


def _q5_k_as_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # Q5_K (fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 32 bytes of fifth bits, 128
    # of nibbles) holds x = d * sc[j] * u - dmin * m[j] per sub-block j of 32: an offset grid
    # per sub-block, which becomes one requantized Q8_0 block (8 per Q5_K block).
    n = blocks.shape[0]
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    step = (_half_values(blocks[:, 0:2]) * scales).reshape(n, 8, 1)
    offset = (_half_values(blocks[:, 2:4]) * mins).reshape(n, 8, 1)
    qh, qs = blocks[:, 16:48], blocks[:, 48:176]
    # Sub-block 2c takes the low nibbles of qs[32c : 32c + 32], 2c + 1 the high ones; bit j
    # of qh[l] is the fifth bit of sub-block j's weight l.
    nibbles = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F
    fifth = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    u = (nibbles.reshape(n, 8, 32) | (fifth << 4)).astype(np.float32)
    values = step * u - offset
    _encode_q8_0(values.reshape(n * 8, 32), out.reshape(n * 8, 34))


def _q3_k_as_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # Q3_K (32 bytes of high bits, 64 of 2-bit quants, 12 of 6-bit scales, fp16 d) holds
    # x = d * (s[j] - 32) * q per sub-block j of 16, q in -4..3. Q6_K holds x = d * sc[j] * q
    # with int8 sc[j] and q in -32..31 over the same sub-blocks: every value is kept, at
    # 210 bytes per 256 weights instead of 110.
    n = blocks.shape[0]
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:]
    # Scale j: low nibble of byte j (j < 8) or high nibble of byte j - 8, and bits 4-5 from
    # bits 2(j // 4)..+1 of byte 8 + j % 4.
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    scales = (low.reshape(n, 16) | (high.reshape(n, 16) << 4)).astype(np.int8) - 32
    # Weight 128h + 32s + l: bits 2s..2s+1 of qs[32h + l]; its high bit is bit (4h + s) of
    # hmask[l], and a clear bit subtracts 4.
    two = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    bit = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    u = two.reshape(n, 256) + 28 + (bit.reshape(n, 256) << 2)  # q + 32, in 28..35
    _encode_q6_k(u.astype(np.uint8), scales, d, out)


def _encode_q6_k(u: np.ndarray, scales: np.ndarray, d: np.ndarray, out: np.ndarray) -> None:
    """Q6_K blocks from u = q + 32 (uint8 [n, 256], 0..63), int8 scales [n, 16] and fp16 d
    bytes [n, 2]: ql[128] (weight 128h + l low nibble of ql[64h + l], + 64 its high nibble),
    qh[64] (bits 2s..2s+1 of qh[32h + l]: weight 128h + 32s + l's top two bits), scales, d."""
    n = u.shape[0]
    halves = u.reshape(n, 2, 2, 64)
    out[:, :128] = ((halves[:, :, 0] & 0x0F) | ((halves[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
    tops = (u.reshape(n, 2, 4, 32) >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    out[:, 128:192] = np.bitwise_or.reduce(tops, axis=2).reshape(n, 64)
    out[:, 192:208] = scales.view(np.uint8)
    out[:, 208:] = d


# MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4): code c's weight is this times 2^(e - 128).
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def _mxfp4_as_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # MXFP4 (E8M0 exponent e, 16 bytes of nibbles laid out as Q4_0's) holds x = v * 2^(e - 128)
    # with v in -12..12. Q8_0 holds x = q * d with an fp16 d: d = 2^(e - 128 - s) and q = v * 2^s
    # (s = 0..3 keeps |q| <= 96) give the same values wherever 2^(e - 128 - s) is an fp16 power
    # of two (2^-24 .. 2^15), which covers every block whose largest weight is 4e-7 .. 2^18.
    # Smaller blocks (e < 104) are rounded onto d = 2^-24; larger ones cannot occur in a model
    # (refused).
    n = blocks.shape[0]
    exponent = blocks[:, 0].astype(np.int32) - 128
    if (exponent > 18).any():
        raise ValueError("an MXFP4 block's scale exceeds 2^18: not a model's weights")
    shift = np.clip(exponent - 15, 0, 3)
    scale = np.maximum(exponent - shift, -24)
    codes = np.empty((n, 32), dtype=np.uint8)
    np.bitwise_and(blocks[:, 1:], 0x0F, out=codes[:, :16])
    np.right_shift(blocks[:, 1:], 4, out=codes[:, 16:])
    values = _MXFP4_VALUES[codes].astype(np.float64)
    q = np.rint(np.ldexp(values, (exponent - scale)[:, None]))
    out[:, :2] = np.ldexp(1.0, scale).astype(np.float16).reshape(n, 1).view(np.uint8)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)


_REPACKS: dict[str, tuple[str, Callable[[np.ndarray, np.ndarray], None]]] = {
    "MXFP4": ("Q8_0", _mxfp4_as_q8_0),
    "Q5_0": ("Q8_0", _q5_0_as_q8_0),
    "Q5_1": ("Q8_0", _q5_1_as_q8_0),
    "Q5_K": ("Q8_0", _q5_k_as_q8_0),
    "Q3_K": ("Q6_K", _q3_k_as_q6_k),
}
