"""The C++ kernels (radixserve/kernels): decode attention on every code path and the skinny
bfloat16 matmul against float64 references, their input checks, the engine's outputs through
them against the PyTorch paths, and how the library is built."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.engine.request import Request
from radixserve.kernels import SKINNY_MAX_ROWS, decode_attention_op, skinny_matmul_op
from radixserve.kernels.cpu import has_fast_bf16
from radixserve.layers.linear import (
    DenseLinear,
    Linear,
    SkinnyLinear,
    WideningLinear,
    choose_linear_method,
)

OP = decode_attention_op()
MATMUL = skinny_matmul_op()


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _case(dtype, heads, kv_heads, dim, lengths, seed=0, num_slots=3000):
    """Random pool, queries and slot tables; tables share a 40-slot run where long enough."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, num_slots, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, num_slots, dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    rng = random.Random(seed)
    shared = list(range(100, 140))
    tables = []
    for n in lengths:
        own = rng.sample(range(200, num_slots), n)
        tables.append((shared + own)[:n] if n > 60 else own)
    return q, k, v, tables


def _reference(q, k, v, tables, scale):
    """Float64 attention of each request over its table (GQA: q head i reads kv head i // G)."""
    heads, kv_heads = q.shape[1], k.shape[0]
    out = []
    for b, table in enumerate(tables):
        idx = torch.tensor(table)
        keys = k[:, idx].double().repeat_interleave(heads // kv_heads, dim=0)
        values = v[:, idx].double().repeat_interleave(heads // kv_heads, dim=0)
        scores = torch.einsum("hd,htd->ht", q[b].double(), keys) * scale
        out.append(torch.einsum("ht,htd->hd", torch.softmax(scores, -1), values))
    return torch.stack(out)


def _run(q, k, v, tables, scale, level):
    slots = torch.tensor([s for t in tables for s in t], dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(len(t) for t in tables)])
    return OP(q, k, v, slots, starts, scale, level)


def test_kernel_builds_here_and_reports_the_cpu_level():
    # The kernel is part of the engine on this project's machines: a build failure here is a
    # real failure, not a reason to fall back silently.
    assert OP is not None
    flags = _cpu_flags()
    expected = 0
    if {"avx512f", "avx512dq"} <= flags:
        expected = 2 if {"avx512bw", "avx512vl", "avx512_bf16"} <= flags else 1
    assert torch.ops.radixserve.decode_attention_level() == expected
    assert (MATMUL is not None) == (expected == 2)  # the matmul needs AVX512-BF16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 4, 64), (7, 1, 64), (8, 2, 128), (6, 2, 128)])
def test_every_path_matches_float64(dtype, level, heads, kv_heads, dim):
    # Lengths cover one key, a partial 16-key block, exact blocks, an odd tail (V is read in
    # pairs) and long contexts; head counts cover the bfloat16 path's blocks of query heads
    # (4 at dim 64, 2 at dim 128) and their remainders.
    lengths = [1, 15, 16, 17, 33, 64, 301]
    q, k, v, tables = _case(dtype, heads, kv_heads, dim, lengths, seed=heads * dim + level)
    scale = dim**-0.5
    got = _run(q, k, v, tables, scale, level)
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(q, k, v, tables, scale)
    # bfloat16: outputs are rounded to 8 bits of mantissa (and probabilities too on the BF16
    # path); float32 only reorders sums.
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max().item() < tolerance


def test_paths_really_differ_and_ignore_slot_layout():
    # The vector paths are not the portable one under another name (their float rounding
    # differs), and moving a context's K/V to other slots changes nothing, bit for bit: what
    # makes cache-on outputs equal cache-off ones.
    top = torch.ops.radixserve.decode_attention_level()
    if top >= 1:  # float32 shows the AVX-512 path's different order of sums
        q, k, v, tables = _case(torch.float32, 9, 3, 64, [40, 300, 1000], seed=5)
        assert not torch.equal(_run(q, k, v, tables, 0.125, 1), _run(q, k, v, tables, 0.125, 0))
    q, k, v, tables = _case(torch.bfloat16, 9, 3, 64, [40, 300, 1000], seed=5)
    runs = {level: _run(q, k, v, tables, 0.125, level) for level in (0, 1, 2)}
    if top >= 2:  # bfloat16 probabilities on the BF16 path
        assert not torch.equal(runs[2], runs[1])
    # A pool twice as large: the first two contexts move to fresh slots in the new half.
    moved_k, moved_v = torch.cat((k, torch.zeros_like(k)), 1), torch.cat((v, torch.zeros_like(v)), 1)
    fresh = random.Random(1).sample(range(k.shape[1], 2 * k.shape[1]), 340)
    moved_tables = [fresh[:40], fresh[40:]]
    for table, new in zip(tables[:2], moved_tables, strict=True):
        moved_k[:, new], moved_v[:, new] = k[:, table], v[:, table]
    moved_tables.append(tables[2])  # the 1,000-slot context stays where it was
    for level in (0, 1, 2):
        assert torch.equal(_run(q, moved_k, moved_v, moved_tables, 0.125, level), runs[level])


def test_bad_input_is_refused_not_read():
    q, k, v, tables = _case(torch.float32, 4, 2, 64, [5, 6])
    slots = torch.tensor([s for t in tables for s in t], dtype=torch.int32)
    starts = torch.tensor([0, 5, 11])
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = slots.clone()
        bad[3] = k.shape[1]
        OP(q, k, v, bad, starts, 0.1, 2)
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = slots.clone()
        bad[0] = -1
        OP(q, k, v, bad, starts, 0.1, 2)
    with pytest.raises(RuntimeError, match="at least one slot"):
        OP(q, k, v, slots, torch.tensor([0, 0, 11]), 0.1, 2)
    with pytest.raises(RuntimeError, match="past slots"):
        OP(q, k, v, slots, torch.tensor([0, 5, 12]), 0.1, 2)
    with pytest.raises(RuntimeError, match="starts"):
        OP(q, k, v, slots, torch.tensor([0, 11]), 0.1, 2)
    with pytest.raises(RuntimeError, match="int32"):
        OP(q, k, v, slots.long(), starts, 0.1, 2)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        OP(q.half(), k.half(), v.half(), slots, starts, 0.1, 2)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        OP(q[:, :3].contiguous(), k, v, slots, starts, 0.1, 2)


def test_request_slot_mirror_follows_every_change():
    # The kernel reads a request's slots from an int32 mirror kept beside the list: appends,
    # re-pointed slots (cache dedup) and replaced tables must all show in it.
    from radixserve.sampling_params import SamplingParams as Params

    request = Request("r", [1, 2, 3], Params(max_tokens=1))
    request.slots = [5, 6, 7]
    assert request.slot_array(3).tolist() == [5, 6, 7]
    request.slots.extend(range(100, 200))
    assert request.slot_array(103).tolist() == request.slots
    request.repoint_slot(1, 42)
    request.repoint_slot(102, 43)  # mirrored
    request.slots.extend([300])
    request.repoint_slot(103, 44)  # not yet mirrored
    assert request.slot_array(104).tolist() == request.slots
    assert request.slot_array(104, 100).tolist() == request.slots[100:]
    request.slots = [9, 8]
    assert request.slot_array(2).tolist() == [9, 8]
    assert isinstance(request.slot_array(2), np.ndarray)


# ----- the engine through the kernel -----

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(model_path):
    settings = dict(dtype="float32", kv_cache_tokens=6000, show_progress=False,
                    prefix_cache="radix", debug_invariants=True)
    kernel = LLM(str(model_path), attention_backend="kernel", **settings)
    torch_path = LLM(str(model_path), attention_backend="torch", **settings)
    return kernel, torch_path


def _prompts(llm: LLM) -> list[dict]:
    rng = random.Random(3)
    system = [rng.randrange(200, 40000) for _ in range(300)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(200, 40000) for _ in range(3 + i)]}
               for i in range(5)]  # five chats on one cached system prompt
    prompts += [{"prompt_token_ids": llm.tokenizer.encode_chat(
        [{"role": "user", "content": f"Question {i}: name a colour."}])} for i in range(3)]
    return prompts


def test_engine_kernel_equals_torch_path(engines):
    kernel, torch_path = engines
    decode = kernel.engine.runner.attention.decode
    assert decode.name == "kernel"
    assert torch_path.engine.runner.attention.decode.name == "torch"
    prompts = _prompts(kernel)
    calls = []
    op = decode.op

    def counted(*args):
        calls.append(args[0].shape[0])
        return op(*args)

    decode.op = counted
    try:
        got = [r.outputs[0].token_ids for r in kernel.generate(prompts, GREEDY)]
    finally:
        decode.op = op
    assert max(calls) == len(prompts)  # every decode of the full batch went through it
    want = [r.outputs[0].token_ids for r in torch_path.generate(prompts, GREEDY)]
    assert got == want
    for llm in engines:
        stats = llm.pool_stats()
        assert stats.balanced and stats.private == 0 and stats.protected == 0, stats


def test_engine_portable_kernel_path_agrees(engines):
    # The portable C++ path (what a CPU without AVX-512 runs) gives the same greedy tokens.
    kernel, _ = engines
    prompts = _prompts(kernel)
    decode = kernel.engine.runner.attention.decode
    want = [r.outputs[0].token_ids for r in kernel.generate(prompts, GREEDY)]
    decode.max_level = 0
    try:
        got = [r.outputs[0].token_ids for r in kernel.generate(prompts, GREEDY)]
    finally:
        decode.max_level = 2
    assert got == want


def test_kernel_backend_refuses_what_it_cannot_run(model_path):
    with pytest.raises(ValueError, match="attention_backend='kernel' needs"):
        LLM(str(model_path), dtype="float16", attention_backend="kernel", kv_cache_tokens=256,
            show_progress=False)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(str(model_path), attention_backend="flash", show_progress=False)


def test_backends_are_named_at_start_and_refused_where_they_cannot_run(model_path, caplog):
    import logging

    settings = dict(dtype="float32", kv_cache_tokens=256, show_progress=False)
    with caplog.at_level(logging.INFO, logger="radixserve.engine.engine"):
        LLM(str(model_path), attention_backend="torch", prefill_attention_backend="sdpa",
            **settings)
    assert "attention: decode torch, prefill sdpa; projections: torch" in caplog.text
    with pytest.raises(ValueError, match="prefill_attention_backend='blocked' needs"):
        LLM(str(model_path), prefill_attention_backend="blocked", **settings)
    with pytest.raises(ValueError, match="prefill_attention_backend must be one of"):
        LLM(str(model_path), prefill_attention_backend="flash", show_progress=False)


# ----- building it -----

# ----- the skinny matmul -----

needs_bf16_dot = pytest.mark.skipif(
    MATMUL is None, reason="the skinny matmul needs AVX512-BF16 (checked against the CPU's "
    "flags in test_kernel_builds_here_and_reports_the_cpu_level)")


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
    assert picked == ("widen" if emulated else "kernel" if MATMUL is not None else "torch")
    assert choose_linear_method("auto", cpu, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="matmul_backend='widen' needs a CPU and bfloat16"):
        choose_linear_method("widen", cpu, torch.float32)
    print(f"this CPU {'emulates' if emulated else 'has native'} bfloat16: auto picks {picked}")


@needs_bf16_dot
def test_engine_decodes_through_the_skinny_matmul(model_path):
    # bfloat16 engine: a step of at most 48 tokens runs every projection and the LM head
    # through the kernel, and its logits stay as close to float32 as nn.Linear's.
    settings = dict(kv_cache_tokens=2000, show_progress=False, prefix_cache="off")
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
         "import torch\nfrom radixserve.kernels import decode_attention_op\n"
         "op = decode_attention_op()\nprint('op:', op)\n"
         "print('level:', torch.ops.radixserve.decode_attention_level() if op else None)\n")


def _python(code: str, home, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RADIXSERVE_HOME": str(home), **env},
    )


def test_concurrent_first_builds_both_load_and_publish_one_library(tmp_path):
    # Two processes start on a machine that has never built the kernel (server workers, test
    # runs): one builds while the other waits on the lock, both get the op, one library is
    # published, nothing is left half-built; a third process then loads it without compiling.
    built = 0
    for process in [_python(_LOAD, tmp_path), _python(_LOAD, tmp_path)]:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        assert "op: radixserve.decode_attention" in out, (out, err)
        built += "building the C++ kernels" in err
    assert built == 1
    kernels = tmp_path / "kernels"
    assert len(list(kernels.glob("kernels-*.so"))) == 1
    assert not list(kernels.glob("build-*"))
    third = _python(_LOAD, tmp_path)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0 and "op: radixserve.decode_attention" in out, err
    assert "building the C++ kernels" not in err  # loaded, not rebuilt


def test_without_a_compiler_the_engine_keeps_the_pytorch_path(tmp_path):
    broken = {"CXX": str(tmp_path / "no-such-compiler"), "PATH": str(tmp_path)}
    process = _python(_LOAD, tmp_path, **broken)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "op: None" in out
    assert "C++ kernels unavailable" in err and "using the PyTorch path" in err
    assert not list((tmp_path / "kernels").glob("*.so"))
