"""The GGUF quantized kernels (csrc/gguf/) against gguf-py.

Blocks come from gguf.quants.quantize (Q8_0, Q4_0, Q4_1) or are built by hand (Q4_K, Q6_K,
which gguf-py cannot quantize), with edge blocks; the oracle is gguf.quants.dequantize. Packing
and dequantizing rows are bitwise exact; the matmul equals a float64 product of the quantized
activations and the dequantized weights up to float32 rounding, and its vector paths equal the
portable one bit for bit, whatever the batch and thread count. Mutated blocks (a doubled scale,
swapped nibbles, scales read as mins) must fail the same checks, so the tolerances can catch a
wrong layout.
"""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import PanelArena, gguf_ops, path_names
from radixserve.kernels.cpu import cpu_flags

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

OPS = gguf_ops()
FORMATS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q6_K)  # blocks of 256
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 33, 64, 65, 300]  # tiles of 1, 2, 4; 256-row chunks
BEST = OPS.path() if OPS else 0  # this CPU's path


def _path(index: int) -> str:
    names = path_names("gguf")  # ("portable",) alone where the library cannot be built
    return names[index] if index < len(names) else f"path {index}"


def _block(kind: Q) -> int:
    return 256 if kind in K_QUANTS else 32


def _shapes(kind: Q) -> list[tuple[int, int]]:
    """(N, K): odd N, N a multiple of 16, one block (K = 7 and 18 blocks of 32; 2, 3 of 256)."""
    return [(37, 512), (200, 768), (16, 256)] if kind in K_QUANTS else [
        (37, 224), (200, 576), (16, 32)]


def _half(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def _k_quant_blocks(blocks: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (any byte is valid) with finite, varied fp16 scales."""
    if kind == Q.Q6_K:  # ql[128] qh[64] scales int8[16] d: 210 bytes
        body = rng.integers(0, 256, (blocks, 208), dtype=np.uint8)
        return np.concatenate([body, _half(rng.uniform(1e-4, 4e-3, blocks))], axis=1)
    # Q4_K: d, dmin, scales[12] (6-bit scales and mins), qs[128]: 144 bytes
    d, dmin = _half(rng.uniform(1e-4, 4e-3, blocks)), _half(rng.uniform(1e-4, 4e-3, blocks))
    return np.concatenate([d, dmin, rng.integers(0, 256, (blocks, 140), dtype=np.uint8)], axis=1)


def _add_edge_blocks(raw: np.ndarray, kind: Q) -> None:
    """Extreme blocks in rows 0-2: zero scale, every quant at its top, Q6_K's u = 0 with int8
    scales -128 and 127, Q8_0's -128 (valid bytes that gguf-py never writes)."""
    blocks = raw.reshape(raw.shape[0], -1, {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144,
                                             Q.Q6_K: 210}[kind])
    d_at = 208 if kind == Q.Q6_K else 0
    blocks[0, 0, d_at:d_at + 2] = 0
    if kind == Q.Q6_K:
        blocks[1, 0, :192] = 0xFF  # u = 63 everywhere
        blocks[2, 0, :192] = 0  # u = 0
        blocks[2, 0, 192:208] = np.tile(np.array([-128, 127], dtype=np.int8), 8).view(np.uint8)
    elif kind == Q.Q8_0:
        blocks[1, 0, 2:] = 0x80  # -128
    else:
        blocks[1, 0, {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q4_K: 16}[kind]:] = 0xFF  # u = 15 everywhere


def _weights(n: int, k: int, kind: Q, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw GGUF blocks of a random [n, k] matrix with edge blocks, and gguf-py's
    dequantization of them."""
    rng = np.random.default_rng(seed)
    if kind in K_QUANTS:
        raw = _k_quant_blocks(n * k // 256, kind, rng).reshape(n, -1)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32)
        raw = gguf.quants.quantize(w * rng.uniform(0.01, 1, (n, 1)).astype(np.float32), kind)
    if n >= 3:
        _add_edge_blocks(raw, kind)
    return raw, gguf.quants.dequantize(raw, kind)


def _magnitudes(raw: np.ndarray, weights: np.ndarray, kind: Q) -> np.ndarray:
    """|W| plus |the offset terms| (Q4_1's m, Q4_K's dmin * m): the kernel sums those apart
    from the d terms, so its rounding scales with both."""
    if kind not in (Q.Q4_1, Q.Q4_K):
        return np.abs(weights.astype(np.float64))
    blocks = raw.copy().reshape(raw.shape[0], -1, 20 if kind == Q.Q4_1 else 144)
    blocks[:, :, :2] = 0  # d = 0 leaves the offset term alone
    offsets = gguf.quants.dequantize(blocks.reshape(raw.shape[0], -1), kind)
    return np.abs(weights.astype(np.float64)) + np.abs(offsets)


def _linear(x, raw: np.ndarray, kind: Q, bias=None, path: int = BEST) -> torch.Tensor:
    panels = OPS.pack(torch.from_numpy(raw), int(kind))
    return OPS.linear(x, panels, int(kind), raw.shape[0], bias, path)


def _quantize_like_kernel(x: np.ndarray, block: int = 32) -> list[np.ndarray]:
    """The kernel's activation quantization in float32 numpy: per block, q = rint(x * 127 /
    max|x|) (ties to even) and dx = max|x| / 127. Blocks of 32 add sums of q and dxs = dx *
    sums; blocks of 256 add int16 sums of q per 16 and per 32."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // block, block)
    top = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        inverse = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[..., None]).astype(np.int8).reshape(m, k)
    dx = top / np.float32(127)
    sums32 = q.reshape(m, k // 32, 32).sum(-1, dtype=np.int32)
    if block == 32:
        return [q, dx, sums32, dx * sums32.astype(np.float32)]
    sums16 = q.reshape(m, k // 16, 16).sum(-1, dtype=np.int32)
    return [q, dx, sums16.astype(np.int16), sums32.astype(np.int16)]


def _reference(x: torch.Tensor, weights: np.ndarray, magnitudes: np.ndarray, kind: Q,
               bias=None):
    """Float64 (quantized x) @ W^T + bias, and the scale of its terms (|q dx| @ magnitudes^T,
    see _magnitudes)."""
    block = _block(kind)
    q, dx = _quantize_like_kernel(x.float().numpy(), block)[:2]
    m, k = q.shape
    xq = (q.reshape(m, k // block, block).astype(np.float64) * dx[..., None]).reshape(m, k)
    w = weights.astype(np.float64)
    want = xq @ w.T + (0 if bias is None else bias.double().numpy())
    return want, np.abs(xq) @ magnitudes.T


def _outside(got: torch.Tensor, want: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Where got misses want by more than float32 accumulation allows (bfloat16 output: plus
    its rounding)."""
    tolerance = 1e-5 * scale + 1e-6
    if got.dtype == torch.bfloat16:
        tolerance = tolerance + 2.0**-8 * np.abs(want)
    return np.abs(got.double().numpy() - want) > tolerance


def test_the_library_builds_and_names_the_path_of_this_cpu():
    # Part of the engine on this project's machines: a build failure is a real failure here.
    assert OPS is not None
    flags = cpu_flags()
    expected = "portable"
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        # AMX is used where Linux lets the process have the tile state (it does on every
        # kernel since 5.16 that shows the flags).
        expected = "avx512-amx" if {"amx_tile", "amx_int8"} <= flags else "avx512-vnni"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    assert OPS.path_name() == expected and OPS.path_name(0) == "portable"


@pytest.mark.parametrize("kind", FORMATS, ids=lambda k: k.name)
def test_pack_keeps_the_file_bytes_and_dequantizes_exactly(kind):
    k = 768
    raw, weights = _weights(37, k, kind)
    panels = OPS.pack(torch.from_numpy(raw), int(kind))
    assert panels.dtype == torch.uint8 and panels.shape[0] == 3  # ceil(37 / 16) panels
    # The file's bytes (rows padded to 48); Q4_K's 6-bit scales and mins take a byte each.
    row_bytes = raw.shape[1] // 144 * 148 if kind == Q.Q4_K else raw.shape[1]  # 1.03x, 1.00x
    assert panels.numel() == 48 * row_bytes
    # Any ids: repeats, any order, the edge rows, the last real row (in the padded panel).
    ids = torch.tensor([36, 0, 1, 2, 5, 5, 17, 32, 15, 16, 31])
    rows = OPS.dequantize_rows(panels, int(kind), 37, k, ids, torch.float32)
    assert np.array_equal(rows.numpy(), weights[ids.numpy()])  # bitwise
    half = OPS.dequantize_rows(panels, int(kind), 37, k, ids, torch.bfloat16)
    assert torch.equal(half, torch.from_numpy(weights[ids.numpy()]).to(torch.bfloat16))
    # A row order gathers rows while packing: the same panels as packing the permuted rows.
    order = torch.from_numpy(np.random.default_rng(1).permutation(37))
    assert torch.equal(OPS.pack(torch.from_numpy(raw), int(kind), order),
                       OPS.pack(torch.from_numpy(raw[order.numpy()]), int(kind)))


def _encode_q4k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's 12 scale bytes from 8 six-bit scales and mins, written from llama.cpp's
    published layout (get_scale_min_k4 read backwards), not from gguf-py."""
    s = np.zeros(12, dtype=np.uint8)
    for j in range(4):
        s[j] = sc[j] | (sc[j + 4] >> 4) << 6
        s[j + 4] = m[j] | (m[j + 4] >> 4) << 6
        s[j + 8] = (sc[j + 4] & 15) | (m[j + 4] & 15) << 4
    return s


def test_q4k_scales_follow_the_published_layout():
    # One block from known scales, mins and nibbles: our dequantization (and gguf-py's) must
    # give (d * sc_j) * u - dmin * m_j with sub-block j = the weight's index // 32.
    rng = np.random.default_rng(7)
    sc, m = rng.integers(0, 64, 8, dtype=np.uint8), rng.integers(0, 64, 8, dtype=np.uint8)
    u = rng.integers(0, 16, 256, dtype=np.uint8)
    d, dmin = np.float16(0.0123), np.float16(0.00456)
    # qs[32c + l]: low nibble = weight 64c + l, high nibble = weight 64c + 32 + l.
    u4 = u.reshape(4, 2, 32)
    qs = (u4[:, 0] | u4[:, 1] << 4).reshape(-1)
    raw = np.concatenate([_half([d, dmin]).reshape(-1), _encode_q4k_scales(sc, m), qs])[None]
    j = np.arange(256) // 32
    scale = np.float32(d) * sc[j].astype(np.float32)
    want = scale * u.astype(np.float32) - np.float32(dmin) * m[j].astype(np.float32)
    panels = OPS.pack(torch.from_numpy(raw), int(Q.Q4_K))
    got = OPS.dequantize_rows(panels, int(Q.Q4_K), 1, 256, torch.tensor([0]), torch.float32)
    assert np.array_equal(got.numpy()[0], want)
    assert np.array_equal(gguf.quants.dequantize(raw, Q.Q4_K)[0], want)


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("path", range(BEST + 1), ids=_path)
def test_activation_quantization_matches_numpy(path, block):
    x = torch.randn(6, 512) * torch.logspace(-3, 2, 6)[:, None]
    x[1] = 0  # a zero row
    x[2, 256:] = 0  # a zero block
    x[3, :32] = torch.cat((torch.tensor([127.0]), torch.arange(31) - 14.5))  # ties go to even
    x[3, 32:256] = x[3, 32:256].clamp(-127, 127)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = torch.ops.radixserve.gguf_quantize_activations(xd, block, path)
        got = [g for g in got if g.numel()]  # the other block size's sums are empty
        want = _quantize_like_kernel(xd.float().numpy(), block)
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g.numpy(), w)
        assert got[0].abs().max() <= 127  # never -128: vpmaddubsw pair sums cannot saturate


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", range(3), ids=["odd_n", "n_of_16", "one_block"])
@pytest.mark.parametrize("kind", FORMATS, ids=lambda k: k.name)
def test_linear_matches_float64(kind, shape, bias):
    n, k = _shapes(kind)[shape]
    raw, weights = _weights(n, k, kind, seed=n + k)
    panels = OPS.pack(torch.from_numpy(raw), int(kind))
    magnitudes = _magnitudes(raw, weights, kind)
    b = torch.randn(n) if bias else None
    gen = torch.Generator().manual_seed(k)
    for m in ROW_COUNTS:
        x = torch.randn(m, k, generator=gen)
        for dtype in (torch.bfloat16, torch.float32):
            xd = x.to(dtype)
            got = OPS.linear(xd, [panels], [int(kind)], [n], b, BEST)
            assert got.dtype == dtype and got.shape == (m, n)
            want, scale = _reference(xd, weights, magnitudes, kind, b)
            assert not _outside(got, want, scale).any(), (m, dtype)
        # Against the unquantized x, the error is the activations' int8 rounding: small
        # against |x| |W_n| (llama.cpp's q8 activations make the same trade; per 256 for
        # K-quants, as its q8_K).
        exact = x.double().numpy() @ weights.astype(np.float64).T
        if b is not None:
            exact += b.double().numpy()
        norms = np.linalg.norm(x.numpy(), axis=1)[:, None] * np.linalg.norm(weights, axis=1)
        assert (np.abs(got.double().numpy() - exact) <= 0.02 * norms).all()


@pytest.mark.parametrize("path", [1, 2, 3], ids=_path)
@pytest.mark.parametrize("kind", FORMATS, ids=lambda k: k.name)
def test_vector_paths_equal_the_portable_path_bitwise(kind, path):
    if path > BEST:
        where = ("on an emulated CPU in test_emulated_avx512.py" if path == 2 else
                 "on a CPU with AMX-INT8, such as Intel Xeon from Sapphire Rapids on")
        pytest.skip(f"this CPU runs {_path(BEST)}: the {_path(path)} path cannot "
                    f"run here (natively on machines that have it; {where})")
    n, k = _shapes(kind)[0]
    raw, _ = _weights(n, k, kind, seed=3)
    bias = torch.randn(n)
    # (On AVX2, Q4_K unpacks a superblock once for chunks of 8 rows or more and Q6_K for 24
    # or more; 7 and 27 are tiles of 4, 2, 1 on either side. AMX takes groups of 16 rows and
    # the AVX-512 path the rest: 16, 32 and 48 are whole groups, 300 is 18 of them in two
    # chunks with 12 rows left in the second.)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 24, 27, 32, 48, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            assert torch.equal(_linear(x, raw, kind, bias, path), _linear(x, raw, kind, bias, 0))


def test_the_amx_path_and_onednn_amx_matmuls_take_turns_on_one_thread():
    # Both configure the tile registers: each AMX call loads its own configuration and
    # releases the tiles after, and oneDNN's bfloat16 matmuls (AMX where it exists) must find
    # theirs again. Interleaved on one thread, neither result may move.
    if BEST < 3:
        pytest.skip(f"this CPU runs {_path(BEST)}: no AMX here (natively on CPUs with "
                    "AMX-INT8; the emulated CPU has none)")
    raw, _ = _weights(64, 512, Q.Q4_K, seed=8)
    x = torch.randn(300, 512).bfloat16()
    w = torch.randn(96, 512).bfloat16()
    dense, quantized = F.linear(x, w), _linear(x, raw, Q.Q4_K)
    for _ in range(3):
        assert torch.equal(_linear(x, raw, Q.Q4_K), quantized)
        assert torch.equal(F.linear(x, w), dense)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_K], ids=lambda k: k.name)
def test_vanishing_activation_blocks_quantize_to_zero_on_every_path(kind):
    # A block whose largest value is below ~3.7e-37 makes 127 / max overflow to inf; its
    # values must quantize to 0 (not inf * x cast to int8) and every path must agree.
    n, k = _shapes(kind)[0]
    raw, _ = _weights(n, k, kind, seed=6)
    x = torch.randn(3, k)
    x[1] = 1e-38
    x[2, : _block(kind)] = 2e-38
    portable = _linear(x, raw, kind, None, 0)
    assert torch.isfinite(portable).all()
    assert portable[1].abs().max() == 0
    assert torch.equal(_linear(x, raw, kind, None, BEST), portable)


@pytest.mark.parametrize("kind", FORMATS, ids=lambda k: k.name)
def test_rows_are_batch_invariant(kind):
    # A row's output is the same bits alone, in any sub-batch, across the 256-row chunk
    # boundary and whatever the thread count: what makes the prefix cache's on == off exact.
    n, k = _shapes(kind)[0]
    raw, _ = _weights(n, k, kind, seed=4)
    x = torch.randn(300, k)
    full = _linear(x, raw, kind)
    for lo, hi in [(0, 1), (5, 6), (255, 258), (299, 300), (3, 70), (250, 300)]:
        assert torch.equal(_linear(x[lo:hi], raw, kind), full[lo:hi]), (lo, hi)
    wide, _ = _weights(640, k, kind, seed=5)  # 40 panels: 5-7 runs of about 32 KB
    one_panel, _ = _weights(16, k, kind, seed=6)  # a single run
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [_linear(x, weight, kind) for weight in (wide, one_panel)]
        # Threads share out runs of panels and take from each other's shares once done with
        # their own: with more threads than cores some are descheduled while the others take
        # their runs, and with more threads than runs some get none; every output is written
        # exactly once, by whichever thread.
        for count in (1, 3, 5):
            torch.set_num_threads(count)
            assert torch.equal(_linear(x, raw, kind), full), count
            assert torch.equal(_linear(x[:2], raw, kind), full[:2]), count
            for weight, want in zip((wide, one_panel), alone, strict=True):
                assert torch.equal(_linear(x, weight, kind), want), count
    finally:
        torch.set_num_threads(threads)


def test_parts_of_mixed_types_in_one_call_equal_separate_calls():
    # A fused projection whose parts are of different types (Q4_K_M's q, k in Q4_K and v in
    # Q6_K; row counts not a multiple of 16) is one call: x is quantized once per block size
    # and each part lands at its column offset.
    parts = [(64, Q.Q4_K), (37, Q.Q6_K), (16, Q.Q4_0), (5, Q.Q8_0), (3, Q.Q4_1)]
    raws = [_weights(n, 512, kind, seed=n)[0] for n, kind in parts]
    panels = [OPS.pack(torch.from_numpy(raw), int(kind))
              for raw, (_, kind) in zip(raws, parts, strict=True)]
    columns = np.cumsum([0] + [n for n, _ in parts])
    bias = torch.randn(int(columns[-1]))
    x = torch.randn(9, 512)
    for path in range(BEST + 1):
        fused = OPS.linear(x, panels, [int(k) for _, k in parts], [n for n, _ in parts], bias, path)
        separate = torch.cat([_linear(x, raw, kind, bias[c:c + n], path)
                              for raw, (n, kind), c in zip(raws, parts, columns[:-1], strict=True)],
                             dim=1)
        assert torch.equal(fused, separate)


def test_bfloat16_outputs_are_the_float_outputs_rounded_as_torch_rounds():
    # The kernel writes a run of panels row by row, its bfloat16 outputs rounded in vector
    # registers: they must be the float32 outputs of the same activations rounded by torch
    # (to nearest even), for parts whose rows end inside a panel, runs that cross parts, more
    # than one chunk of 256 rows and a bias; and huge values must round to infinity.
    parts = [(70, Q.Q8_0), (37, Q.Q4_0), (100, Q.Q8_0), (21, Q.Q4_1)]
    raws = [_weights(n, 256, kind, seed=n)[0] for n, kind in parts]
    panels = [OPS.pack(torch.from_numpy(raw), int(kind))
              for raw, (_, kind) in zip(raws, parts, strict=True)]
    types, rows = [int(k) for _, k in parts], [n for n, _ in parts]
    bias = torch.randn(sum(rows))
    bias[::7] = 3.4e38  # past bfloat16's largest finite value (3.39e38): rounds to infinity
    x = torch.randn(300, 256).to(torch.bfloat16)
    for path in range(BEST + 1):
        wide = OPS.linear(x.float(), panels, types, rows, bias, path)
        narrow = OPS.linear(x, panels, types, rows, bias, path)
        assert narrow.dtype == torch.bfloat16
        assert torch.equal(narrow.view(torch.int16), wide.to(torch.bfloat16).view(torch.int16))
        assert narrow[:, ::7].float().abs().eq(float("inf")).any()


def _mapping_of(address: int) -> dict[str, int] | None:
    """The smaps fields (kB) of this process's mapping holding `address`, None if unmapped."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and line.split()[1].isdigit():  # (VmFlags holds words)
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields if inside else None


def _thp_faults() -> dict[str, int]:
    """The kernel's counts of page faults served by a huge page, and of those that fell back
    to 4 KB pages for want of one (/proc/vmstat, machine-wide)."""
    counts = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return {key: int(counts.get(key, 0)) for key in ("thp_fault_alloc", "thp_fault_fallback")}


def _check_huge_pages(address: int, pages: int, faults_before: dict[str, int]) -> None:
    """Where transparent huge pages are on, the mapping holding `address` has at least `pages`
    huge pages, unless the kernel had none to give (it then counts a fallback)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        warnings.warn("transparent huge pages are off here: checked the layout only",
                      stacklevel=2)
        return
    held = _mapping_of(address)["AnonHugePages"]
    if held >= pages * 2048:
        return
    fallbacks = _thp_faults()["thp_fault_fallback"] - faults_before["thp_fault_fallback"]
    assert fallbacks > 0, f"{held} kB on huge pages and no fallback: the buffer was not marked"
    warnings.warn(f"the kernel had no huge page free ({fallbacks} fallbacks): checked the "
                  "layout only", stacklevel=2)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_packed_weights_live_on_huge_pages_and_are_unmapped_when_freed():
    # A decode step streams the panels: on 2 MB pages it read 33-34 GB/s on a 2-core Xeon VM,
    # 25-28 on 4 KB ones. 6 MB of Q8_0 panels: their whole 2 MB stretches are huge pages where
    # transparent huge pages are on ("always" or "madvise"), and freeing the tensor unmaps them.
    raw, _ = _weights(1024, 6144, Q.Q8_0)
    faults = _thp_faults()
    panels = OPS.pack(torch.from_numpy(raw), int(Q.Q8_0))
    address, size = panels.data_ptr(), panels.numel()
    assert size > 3 * (2 << 20) and address % (2 << 20) == 0
    assert _mapping_of(address) is not None
    _check_huge_pages(address, 3, faults)  # its 3 whole 2 MB stretches
    assert torch.equal(panels, OPS.pack(torch.from_numpy(raw), int(Q.Q8_0)))
    del panels
    gc.collect()
    # Unmapped: nothing there now, or a smaller mapping that has since taken the hole.
    mapping = _mapping_of(address)
    assert mapping is None or mapping["Size"] * 1024 < size


def test_an_arena_packs_small_weights_side_by_side_on_shared_huge_pages():
    # Weights under 4 MB get no huge page of their own; packed through a PanelArena (as a
    # model's projections are) they lie side by side, 64-byte aligned, in one buffer on huge
    # pages; one that does not fit starts the next buffer, and one of 4 MB or more gets its
    # own without ending the current one.
    arena = PanelArena(buffer_bytes=4 << 20)
    faults = _thp_faults() if Path("/proc/vmstat").exists() else {}
    shapes = [(100, 512, Q.Q8_0), (37, 512, Q.Q4_K), (2048, 512, Q.Q8_0), (2048, 1536, Q.Q8_0),
              (1024, 6144, Q.Q8_0), (100, 512, Q.Q8_0)]  # 61 KB, 14 KB, 1.1, 3.3, 6.7 MB, 61 KB
    weights = [(_weights(n, k, kind, seed=n)[0], kind) for n, k, kind in shapes]
    packed = [OPS.pack(torch.from_numpy(raw), int(kind), None, arena) for raw, kind in weights]
    for (raw, kind), panels in zip(weights, packed, strict=True):
        assert torch.equal(panels, OPS.pack(torch.from_numpy(raw), int(kind)))
    starts = [p.data_ptr() for p in packed]
    buffers = [p.untyped_storage().data_ptr() for p in packed]
    for i in (1, 2, 5):  # each after the one before it in its buffer, rounded up to 64 bytes
        before = 3 if i == 5 else i - 1
        assert starts[i] == starts[before] + -(-packed[before].numel() // 64) * 64
    assert buffers[:3] == [buffers[0]] * 3 and buffers[3] == buffers[5]
    assert len({buffers[0], buffers[3], buffers[4]}) == 3  # 3.3 MB did not fit the first's 2.8
    if sys.platform == "linux":
        assert all(start % (2 << 20) == 0 for start in (starts[0], starts[3], starts[4]))
    if Path("/proc/self/smaps").exists():
        _check_huge_pages(starts[0], 1, faults)  # the first three's 1.2 MB: one huge page


QUANTS_AT = {Q.Q8_0: 2, Q.Q4_0: 2, Q.Q4_1: 4, Q.Q4_K: 16}  # where a block's quants start
BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144, Q.Q6_K: 210}


def _double_scale(block: np.ndarray, kind: Q) -> None:
    d = block[208:210] if kind == Q.Q6_K else block[:2]
    d[:] = (d.view(np.float16) * 2).view(np.uint8)


def _swap_nibbles(block: np.ndarray, kind: Q) -> None:
    quants = block[:128] if kind == Q.Q6_K else block[QUANTS_AT[kind]:]
    quants[:] = (quants >> 4) | (quants << 4)


def _reverse_quants(block: np.ndarray, kind: Q) -> None:
    quants = block[:128] if kind == Q.Q6_K else block[QUANTS_AT[kind]:]
    quants[:] = quants[::-1].copy()


def _scales_as_mins(block: np.ndarray, kind: Q) -> None:
    block[5], block[9] = block[9], block[5]  # Q4_K: s[1] and s[5]


def _rotate_high_bits(block: np.ndarray, kind: Q) -> None:
    qh = block[128:192]  # Q6_K: each weight's top two bits to the neighbouring pair
    qh[:] = (qh >> 2) | (qh << 6)


MUTATIONS = [(kind, mutate) for kind in FORMATS
             for mutate in (_double_scale, _swap_nibbles, _reverse_quants)
             if not (kind == Q.Q8_0 and mutate is _swap_nibbles)]  # Q8_0 has no nibbles
MUTATIONS += [(Q.Q4_K, _scales_as_mins), (Q.Q6_K, _rotate_high_bits)]


@pytest.mark.parametrize(("kind", "mutate"), MUTATIONS,
                         ids=[f"{k.name}-{m.__name__[1:]}" for k, m in MUTATIONS])
def test_a_wrong_scale_or_quant_order_is_caught(kind, mutate):
    n, k = _shapes(kind)[0]
    raw, weights = _weights(n, k, kind, seed=5)
    bad = raw.copy()
    row, block = 20, 1
    mutate(bad[row].reshape(-1, BLOCK_BYTES[kind])[block], kind)
    x = torch.randn(4, k)
    want, scale = _reference(x, weights, _magnitudes(raw, weights, kind), kind)
    assert not _outside(_linear(x, raw, kind), want, scale).any()
    for path in range(BEST + 1):
        outside = _outside(_linear(x, bad, kind, path=path), want, scale)
        assert outside[:, row].all() and not np.delete(outside, row, axis=1).any()


def test_bad_input_is_refused():
    raw, _ = _weights(20, 64, Q.Q4_0)
    panels = OPS.pack(torch.from_numpy(raw), int(Q.Q4_0))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="no panel layout"):
        OPS.pack(torch.from_numpy(raw), int(Q.Q5_K))
    with pytest.raises(ValueError, match="multiple of part 0's block"):
        k_quant = OPS.pack(torch.from_numpy(_weights(16, 256, Q.Q4_K)[0]), int(Q.Q4_K))
        OPS.linear(torch.randn(2, 224), [k_quant], [int(Q.Q4_K)], [16], None, 1)
    with pytest.raises(ValueError, match="whole blocks"):
        OPS.pack(torch.from_numpy(raw[:, :-1].copy()), int(Q.Q4_0))
    with pytest.raises(ValueError, match="uint8"):
        OPS.pack(torch.from_numpy(raw).to(torch.int16), int(Q.Q4_0))
    with pytest.raises(ValueError, match="not a row"):
        OPS.pack(torch.from_numpy(raw), int(Q.Q4_0), torch.full((20,), 20))
    with pytest.raises(ValueError, match=f"contiguous uint8 of {panels.numel()} bytes"):
        torch.ops.radixserve.gguf_pack_into(torch.from_numpy(raw), int(Q.Q4_0), None,
                                            torch.empty(panels.numel() - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of part 0's block"):
        OPS.linear(torch.randn(2, 48), [panels], [2], [20], None, 1)
    with pytest.raises(ValueError, match="panels must be"):
        OPS.linear(torch.randn(2, 96), [panels], [2], [20], None, 1)  # packed for K = 64
    with pytest.raises(ValueError, match="panels must be"):
        OPS.linear(x, [panels], [2], [33], None, 1)  # 33 rows need 3 panels
    with pytest.raises(ValueError, match="panels must be"):
        OPS.linear(x, [panels], [8], [20], None, 1)  # packed as Q4_0, read as Q8_0
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        OPS.linear(x.half(), [panels], [2], [20], None, 1)
    with pytest.raises(ValueError, match="contiguous"):
        OPS.linear(torch.randn(64, 2).T, [panels], [2], [20], None, 1)
    with pytest.raises(ValueError, match="one value per output"):
        OPS.linear(x, [panels], [2], [20], torch.zeros(19), 1)
    with pytest.raises(ValueError, match="one entry per part"):
        OPS.linear(x, [panels], [2, 2], [20], None, 1)
    with pytest.raises(ValueError, match="max_path"):
        OPS.linear(x, [panels], [2], [20], None, -1)
    with pytest.raises(IndexError, match="not a row"):
        OPS.dequantize_rows(panels, 2, 20, 64, torch.tensor([20]), torch.float32)
    with pytest.raises(ValueError, match="panels must be"):
        OPS.dequantize_rows(panels, 2, 20, 96, torch.tensor([0]), torch.float32)
