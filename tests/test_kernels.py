"""The C++ kernels' library (radixserve/kernels): what it reports about the CPU, how it is
built, and the skinny bfloat16 matmul against float64 references and inside the engine.
Attention is in test_paged_attention.py, the GGUF kernels in test_gguf_kernels.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.kernels import SKINNY_MAX_ROWS, cpu_features, paged_attention_op, skinny_matmul_op
from radixserve.kernels.cpu import cpu_flags, has_fast_bf16
from radixserve.layers.linear import (
    DenseLinear,
    Linear,
    PanelFloatLinear,
    SkinnyLinear,
    WideningLinear,
    choose_linear_method,
)

pytestmark = [pytest.mark.model]

MATMUL = skinny_matmul_op()


def test_library_builds_here_and_reports_the_cpu_level():
    # The kernels are part of the engine on this project's machines: a build failure here is
    # a real failure, not a reason to fall back silently.
    assert paged_attention_op() is not None
    flags = cpu_flags()
    expected = 0
    if {"avx512f", "avx512dq"} <= flags:
        expected = 2 if {"avx512bw", "avx512vl", "avx512_bf16"} <= flags else 1
    # The library's one probe agrees with the kernel's view of the CPU, flag by flag.
    probed = cpu_features()
    for flag in ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16"):
        assert (flag in probed) == (flag in flags), flag
    level = 0
    if {"avx512f", "avx512dq"} <= probed:
        level = 2 if {"avx512bw", "avx512vl", "avx512_bf16"} <= probed else 1
    assert level == expected
    assert (MATMUL is not None) == (expected == 2)  # the matmul needs AVX512-BF16


# ----- the skinny matmul -----

needs_bf16_dot = pytest.mark.skipif(
    MATMUL is None, reason="the skinny matmul needs AVX512-BF16 (checked against the CPU's "
    "flags in test_library_builds_here_and_reports_the_cpu_level; its tiles also run on an "
    "emulated CPU in test_emulated_avx512.py)")


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 16, 27, 48])
@pytest.mark.parametrize(("n", "k", "bias"), [(48, 64, False), (960, 576, True),
                                              (576, 1536, False)])
def test_skinny_matmul_matches_float64(rows, n, k, bias):
    # Row counts cover every tile shape (8, 4, 2 and 1 rows of x) and their mixes.
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    got = MATMUL(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    # One bfloat16 rounding of the result (2^-8 relative) plus float32 sums.
    assert ((got.double() - want).abs() <= want.abs() / 128 + 1e-3).all()


@needs_bf16_dot
def test_skinny_matmul_refuses_what_it_cannot_take():
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(RuntimeError, match="rows"):
        MATMUL(torch.randn(SKINNY_MAX_ROWS + 1, 64).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        MATMUL(torch.randn(2, 64), w.float(), None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        MATMUL(torch.randn(2, 48).bfloat16(), torch.randn(64, 48).bfloat16(), None)
    with pytest.raises(RuntimeError, match="of 16"):
        MATMUL(torch.randn(2, 64).bfloat16(), torch.randn(40, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        MATMUL(torch.randn(64, 2).bfloat16().t(), w, None)


def test_skinny_method_falls_back_where_the_kernel_does_not_fit():
    calls = []

    def matmul(x, w, b):
        calls.append(tuple(w.shape))
        return torch.nn.functional.linear(x, w, b)

    x = torch.randn(3, 64)
    method = SkinnyLinear(matmul)
    fits, odd = Linear(64, 32, True, method), Linear(64, 40, True, method)
    for layer in (fits, odd):
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
    reference = torch.nn.functional.linear
    assert torch.equal(fits(x), reference(x, fits.weight, fits.bias))
    assert torch.equal(odd(x), reference(x, odd.weight, odd.bias))
    assert torch.equal(DenseLinear().apply(fits, x), reference(x, fits.weight, fits.bias))
    assert calls == [(32, 64)]
    tall = torch.randn(SKINNY_MAX_ROWS + 1, 64)  # more rows than the kernel takes: oneDNN
    assert torch.equal(fits(tall), reference(tall, fits.weight, fits.bias))
    assert calls == [(32, 64)]


def test_widening_method_runs_half_precision_in_float32_from_16_rows():
    # CPUs without native bfloat16 emulate it 7x slower than float32 at prefill sizes: from
    # 16 rows the widening method computes in float32 and rounds once; below, oneDNN as is.
    layer = Linear(64, 48, True, WideningLinear())
    for p in (layer.weight, layer.bias):
        torch.nn.init.normal_(p)
    layer.to(torch.bfloat16)
    w, b = layer.weight, layer.bias
    for rows in (1, 15, 16, 100):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        if rows < WideningLinear.min_rows:
            assert torch.equal(out, torch.nn.functional.linear(x, w, b))
        else:
            wide = torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16()
            assert torch.equal(out, wide)
        exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
        # One bfloat16 rounding of outputs up to ~30: within 2**-8 relative.
        assert ((out.double() - exact).abs() <= exact.abs() / 256 + 1e-6).all()
    cpu = torch.device("cpu")
    emulated = not has_fast_bf16()
    assert (WideningLinear.unavailable(cpu, torch.bfloat16) is None) == emulated
    assert WideningLinear.unavailable(cpu, torch.float32) is not None
    picked = choose_linear_method("auto", cpu, torch.bfloat16).name
    # The float kernel comes before widening wherever it has a vector path (its own tests are
    # in test_float_panels.py).
    float_kernel = PanelFloatLinear.unavailable(cpu, torch.bfloat16) is None
    assert picked == ("kernel" if MATMUL is not None else "float-panels" if float_kernel
                      else "widen" if emulated else "torch")
    assert choose_linear_method("auto", cpu, torch.float32).name == (
        "float-panels" if float_kernel else "torch")
    with pytest.raises(ValueError, match="matmul_backend='widen' needs a CPU and bfloat16"):
        choose_linear_method("widen", cpu, torch.float32)
    print(f"this CPU {'emulates' if emulated else 'has native'} bfloat16: auto picks {picked}")


@needs_bf16_dot
def test_engine_decodes_through_the_skinny_matmul(model_path):
    # bfloat16 engine: a step of at most 48 tokens runs every projection and the LM head
    # through the kernel, and its logits stay as close to float32 as nn.Linear's.
    settings = dict(kv_cache_tokens=2000, show_progress=False, prefix_cache="off",
                    quantization="none")  # float matrices: the bf16 kernel's shapes
    fast = LLM(str(model_path), dtype="bfloat16", matmul_backend="kernel", **settings)
    plain = LLM(str(model_path), dtype="bfloat16", matmul_backend="torch", **settings)
    exact = LLM(str(model_path), dtype="float32", **settings)
    assert plain.engine.model.linear_method.name == "torch"
    method = fast.engine.model.linear_method
    op, shapes = method.op, []

    def counted(x, w, b):
        shapes.append((x.shape[0], w.shape[0]))
        return op(x, w, b)

    method.op = counted
    try:
        for text in ["The capital of France is", "Write a haiku", "2 + 2 ="]:
            ids = fast.tokenizer.encode(text)
            assert len(ids) <= SKINNY_MAX_ROWS
            shapes.clear()
            ours = fast.engine.prompt_logits(ids)
            layers = fast.engine.model_config.num_layers
            assert len(shapes) == 4 * layers + 1  # qkv, o, gate_up, down per layer; LM head
            reference = exact.engine.prompt_logits(ids)
            linear = plain.engine.prompt_logits(ids)
            assert ours.argmax() == reference.argmax()
            assert (ours - reference).abs().max() <= max(1.0, 1.5 * (linear - reference).abs().max())
        shapes.clear()
        out = fast.generate({"prompt_token_ids": fast.tokenizer.encode("Hi")},
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 6
        assert len(shapes) == 6 * (4 * layers + 1)  # the prompt's step and five decode steps
    finally:
        method.op = op
    with pytest.raises(ValueError, match="matmul_backend='kernel' needs"):
        LLM(str(model_path), dtype="float32", matmul_backend="kernel", **settings)


_LOAD = ("import logging\nlogging.basicConfig(level=logging.INFO)\n"
         "import torch\nfrom radixserve.kernels import paged_attention_op\n"
         "op = paged_attention_op()\nprint('op:', op)\n"
         "print('path:', torch.ops.radixserve.kernel_best_path('attention') if op else None)\n")


def _python(code: str, home, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RADIXSERVE_HOME": str(home), **env},
    )


# The build and its lock with the CPU probe alone (its one source is the quickest to compile):
# the whole library takes a minute on 2 cores, and every other test already builds it in-process.
_LOAD_PROBE_ONLY = (
    "import logging\nlogging.basicConfig(level=logging.INFO)\n"
    "import torch\nimport radixserve.kernels.build as build\n"
    "build.SOURCES = [s for s in build.SOURCES if s.name == 'cpu_features.cpp']\n"
    "print('loaded:', build.load_library())\n"
    "print('paths:', torch.ops.radixserve.kernel_path_names('attention'))\n")


def test_concurrent_first_builds_both_load_and_publish_one_library(tmp_path):
    # Two processes start on a machine that has never built the kernel (server workers, test
    # runs): one builds while the other waits on the lock, both get the ops, one library is
    # published, nothing is left half-built; a third process then loads it without compiling.
    built = 0
    load = _LOAD_PROBE_ONLY
    for process in [_python(load, tmp_path), _python(load, tmp_path)]:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        assert "loaded: True" in out and "paths: [" in out, (out, err)
        built += "building the C++ kernels" in err
    assert built == 1
    kernels = tmp_path / "kernels"
    assert len(list(kernels.glob("kernels-*.so"))) == 1
    assert not list(kernels.glob("build-*"))
    third = _python(load, tmp_path)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0 and "paths: [" in out, err
    assert "building the C++ kernels" not in err  # loaded, not rebuilt


def test_without_a_compiler_the_engine_keeps_the_pytorch_path(tmp_path):
    broken = {"CXX": str(tmp_path / "no-such-compiler"), "PATH": str(tmp_path)}
    process = _python(_LOAD, tmp_path, **broken)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "op: None" in out
    assert "C++ kernels unavailable" in err and "using the PyTorch path" in err
    assert not list((tmp_path / "kernels").glob("*.so"))
