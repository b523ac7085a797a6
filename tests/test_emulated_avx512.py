"""The kernels' AVX-512 paths on an emulated Sapphire Rapids CPU (tests/emulated_cpu.py), on any
x86-64 machine: the GGUF matmul's AVX-512 VNNI path and skinny_float's AVX-512 path must give
the portable path's bits, as on real hardware; the attention kernel's AVX-512 and AVX512-BF16
row functions and skinny_matmul's AVX512-BF16 tiles must match float64 (test_gguf_kernels,
test_float_panels, test_paged_attention and test_kernels run them natively where the CPU has
AVX-512). The matmuls' oracle runs
natively: the same inputs through the library's portable path. One image build per module and
one emulator process per test.
"""

from __future__ import annotations

import struct
from pathlib import Path

import emulated_cpu
import numpy as np
import pytest
import torch
from emulated_cpu import Arena, Call, EmulationFault, read

from radixserve.kernels import float_panel_ops, gguf_ops

if (why := emulated_cpu.missing()) is not None:
    pytest.skip(why, allow_module_level=True)

from test_gguf_kernels import FORMATS, _block, _shapes, _weights, gguf  # noqa: E402

pytestmark = [pytest.mark.emulated, pytest.mark.slow]

GGUF = gguf_ops()
FLOAT = float_panel_ops()
# Tiles of 4 activation rows (Q6_K: 2) and single rows, within chunks of rows as gguf_linear
# cuts them (rows from r0 > 0 included).
GGUF_ROWS = [(1, 1), (3, 3), (4, 4), (9, 9), (9, 5), (19, 8)]  # (rows, chunk)
# 1-3 rows: one tile over 8 (3 rows: 6) panels at a time, then single panels; more: tiles of
# up to 12 rows cut as evenly as can be (10, 11, 23 = 12 + 11, 25 = 9 + 8 + 8).
FLOAT_ROWS = [1, 2, 3, 4, 5, 10, 11, 12, 13, 23, 25]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulated_cpu.build_image(tmp_path_factory.mktemp("emulated"))


def _cpuid(image: Path, leaf: int, subleaf: int = 0, model: str = "sapphire_rapids") -> list[int]:
    arena = Arena()
    out = arena.output((4,), np.uint32)
    [after] = emulated_cpu.run(image, [Call("rs_cpuid", (leaf, subleaf, out), arena)], model)
    return read(after, out, (4,), np.uint32).tolist()


def test_the_emulated_cpu_has_the_features_of_the_avx512_paths(image: Path):
    _, ebx, ecx, _ = _cpuid(image, 7)
    bf16 = _cpuid(image, 7, 1)[0]
    features = {"avx512f": ebx >> 16, "avx512dq": ebx >> 17, "avx512bw": ebx >> 30,
                "avx512vl": ebx >> 31, "avx512_vnni": ecx >> 11, "avx512_bf16": bf16 >> 5}
    assert {name for name, bit in features.items() if bit & 1} == set(features)
    # The model without VNNI says so: the check above can fail.
    assert not _cpuid(image, 7, model="corei3_cnl")[2] >> 11 & 1


def _gguf_call(kind: gguf.GGMLQuantizationType, n: int, k: int, m: int, chunk: int,
               seed: int) -> tuple[Call, int, np.ndarray]:
    """A call of the AVX-512 path over a random weight (with gguf-py's blocks and edge
    blocks) and its expected output from the native portable path."""
    raw, _ = _weights(n, k, kind, seed=seed)
    panels = GGUF.pack(torch.from_numpy(raw), int(kind))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0  # a block of zeros (dx = 0)
    quantized = torch.ops.radixserve.gguf_quantize_activations(x, _block(kind), 0)
    want = GGUF.linear(x, panels, int(kind), n, None, 0).numpy()
    arena = Arena()
    arrays = [arena.put(panels.numpy())] + [arena.put(t.numpy()) for t in quantized]
    count = panels.shape[0]
    out = arena.output((count, m, 16), np.float32)
    fields = struct.pack("<6q8Q", int(kind), count, panels.shape[1], m, k, chunk, *arrays, out)
    return Call("rs_gguf_panels", (arena.put(fields),), arena), out, want


@pytest.mark.parametrize("kind", FORMATS, ids=lambda kind: kind.name)
def test_gguf_avx512_vnni_path_gives_the_portable_bits(image: Path,
                                                      kind: gguf.GGMLQuantizationType):
    calls, checks = [], []
    for shape_index, (n, k) in enumerate(_shapes(kind)[:2]):
        for m, chunk in GGUF_ROWS:
            call, out, want = _gguf_call(kind, n, k, m, chunk, seed=100 * shape_index + m)
            calls.append(call)
            checks.append((out, want, n, k, m, chunk))
    arenas = emulated_cpu.run(image, calls)
    for after, (out, want, n, k, m, chunk) in zip(arenas, checks, strict=True):
        by_panel = read(after, out, (-(-n // 16), m, 16), np.float32)
        got = by_panel.transpose(1, 0, 2).reshape(m, -1)[:, :n]
        assert np.abs(want).max() > 0
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
            f"{kind.name} N={n} K={k} M={m} chunk={chunk}: "
            f"{np.count_nonzero(got != want)} of {got.size} outputs differ")


def test_gguf_kernel_needs_vnni(image: Path):
    """On AVX-512 without VNNI (Cannon Lake) the path faults at its first vpdpbusd: the
    emulated runs above did execute the VNNI instructions."""
    call, _, _ = _gguf_call(FORMATS[0], 16, 32, 1, 1, seed=0)
    # The tile may be inlined into panel_avx512 or not, as the compiler chooses.
    with pytest.raises(EmulationFault, match="invalid opcode near .* in .*(panel_avx512|tile)"):
        emulated_cpu.run(image, [call], model="corei3_cnl")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_float_panels_avx512_path_gives_the_portable_bits(image: Path, bias: bool):
    """Every weight type, row counts across the tile shapes, N and K odd, with and without a
    bias, against the native portable path. The 20 panels (the last partial) are split between
    two calls as between threads, 11 and 9, so that 1-3 rows run tiles of 8 (3 rows: 6) panels
    and single panels in both."""
    calls, cases = [], []
    n, k = 317, 33
    for type_id, dtype in enumerate([torch.float32, torch.float16, torch.bfloat16]):
        gen = torch.Generator().manual_seed(type_id)
        weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        panels = FLOAT.pack(weight, dtype)
        count = panels.shape[0]
        b = torch.randn(n, generator=gen) if bias else None
        padded_bias = torch.zeros(count * 16)
        if b is not None:
            padded_bias[:n] = b
        bits = panels.numpy() if dtype == torch.float32 else panels.view(torch.int16).numpy()
        for m in FLOAT_ROWS:
            x = torch.randn(m, k, generator=gen)
            parts = []  # (out, first panel, end panel) of each call
            for p0, p1 in [(0, 11), (11, count)]:
                arena = Arena()
                w = arena.put(bits)
                out = arena.output((m, count * 16), np.float32)
                problem = struct.pack("<Q3qQQ", arena.put(x.numpy()), m, k, count * 16,
                                      arena.put(padded_bias.numpy()) if bias else 0, out)
                calls.append(Call("rs_skinny_float", (arena.put(problem), w, type_id, p0, p1),
                                  arena))
                parts.append((out, p0, p1))
            cases.append((f"{dtype} M={m}", FLOAT.linear(x, panels, n, b, 0).numpy(), parts))
    arenas = iter(emulated_cpu.run(image, calls))
    for case, want, parts in cases:
        got = np.zeros((want.shape[0], 16 * parts[-1][2]), np.float32)
        for out, p0, p1 in parts:
            columns = slice(16 * p0, 16 * p1)
            got[:, columns] = read(next(arenas), out, got.shape, np.float32)[:, columns]
        got = got[:, :n]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
            f"{case}: {np.count_nonzero(got != want)} of {want.size} outputs differ")


# (path, pool dtype): attend_avx512 on float32 and bfloat16 pools, attend_bf16 on bfloat16.
ATTENTION_PATHS = [(2, torch.float32), (2, torch.bfloat16), (3, torch.bfloat16)]


@pytest.mark.parametrize("path, dtype", ATTENTION_PATHS,
                         ids=["avx512-float32", "avx512-bfloat16", "avx512-bf16-bfloat16"])
def test_attention_avx512_paths_match_float64(image: Path, path: int, dtype: torch.dtype):
    """One row and kv head per call, as paged_attention runs them: head dims 64 and 128,
    1-5 query heads per kv head (attend_bf16 weighs values 4 or 2 heads at a time), contexts
    shorter and longer than 16 keys and odd (keys are scored 16 at a time, values read in
    pairs), slots scattered over the pool, with attention sinks and without. Tolerances as
    test_paged_attention's."""
    calls, checks = [], []
    for dim in (64, 128):
        for groups, n, with_sinks in [(1, 1, False), (2, 15, True), (4, 16, False),
                                      (5, 17, True), (3, 100, False), (3, 100, True)]:
            gen = torch.Generator().manual_seed(dim + 10 * groups + n)
            keys = torch.randn(300, dim, generator=gen).to(dtype)
            values = torch.randn(300, dim, generator=gen).to(dtype)
            q = torch.randn(groups, dim, generator=gen).to(dtype)
            slots = torch.randperm(300, generator=gen)[:n].to(torch.int32)
            scale = dim**-0.5
            sinks = torch.randn(groups, generator=gen) * 2
            k64, v64 = keys[slots.long()].double(), values[slots.long()].double()
            logits = q.double() @ k64.T * scale
            if with_sinks:  # a column in the softmax's denominator only
                logits = torch.cat((logits, sinks.double()[:, None]), dim=-1)
            weights = torch.softmax(logits, dim=-1)[:, :n]
            want = (weights @ v64).numpy()
            arena = Arena()
            as_bits = (lambda t: t.view(torch.int16).numpy()) if dtype == torch.bfloat16 else (
                lambda t: t.numpy())
            q_in = as_bits(q) if path == 3 else q.float().numpy()
            out = arena.output((groups, dim), np.int16 if dtype == torch.bfloat16 else np.float32)
            fields = struct.pack(
                "<5qd9Q", path, dtype == torch.bfloat16, dim, n, groups, scale, arena.put(q_in),
                arena.put(as_bits(keys)), arena.put(as_bits(values)), arena.put(slots.numpy()),
                arena.output((groups * n,), np.float32),
                arena.output((groups * (n + 2),), np.uint16), arena.output((groups,), np.float32),
                out, arena.put(sinks.numpy()) if with_sinks else 0)
            calls.append(Call("rs_attend", (arena.put(fields),), arena))
            checks.append((out, want, groups, dim, n))
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    arenas = emulated_cpu.run(image, calls)
    for after, (out, want, groups, dim, n) in zip(arenas, checks, strict=True):
        if dtype == torch.bfloat16:
            bits = torch.from_numpy(read(after, out, (groups, dim), np.int16))
            got = bits.view(torch.bfloat16).double().numpy()
        else:
            got = read(after, out, (groups, dim), np.float32).astype(np.float64)
        error = np.abs(got - want).max()
        assert error < tolerance, f"dim={dim} groups={groups} n={n}: off by {error}"


def test_skinny_matmul_avx512_bf16_path_matches_float64(image: Path):
    """The bfloat16 matmul (vdpbf16ps) for row counts that take every tile (8, 4, 2 and 1 rows
    of x: 7 = 4 + 2 + 1, 13 = 8 + 4 + 1, 48 = 6 x 8), against float64 products of the same
    bfloat16 values: only the float32 order of the sums may differ."""
    n, k = 48, 96
    calls, cases = [], []
    for m in [1, 2, 3, 4, 7, 8, 13, 48]:
        gen = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        arena = Arena()
        out = arena.output((m, n), np.float32)
        args = (arena.put(x.view(torch.int16).numpy()), arena.put(w.view(torch.int16).numpy()),
                m, k, n, out)
        calls.append(Call("rs_skinny_matmul", args, arena))
        x64, w64 = x.double().numpy(), w.double().numpy()
        cases.append((m, out, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T))
    for after, (m, out, want, scale) in zip(emulated_cpu.run(image, calls), cases, strict=True):
        got = read(after, out, (m, n), np.float32).astype(np.float64)
        assert (np.abs(got - want) <= 1e-5 * scale).all(), f"M={m}"
