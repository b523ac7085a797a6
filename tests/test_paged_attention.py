"""Attention over the paged pool by our C++ kernel (radixserve/kernels/csrc/attention/attention.cpp),
for decode rows and prefill rows: every vector path against float64, a row's bits
independent of the rows around it (what makes cache on == off exact), its input checks, and
the engine through it against the PyTorch paths."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.engine.request import Request
from radixserve.kernels import attention_path, paged_attention_op, path_names
from radixserve.kernels.cpu import cpu_flags
from radixserve.model.decoder_stack import DecoderStack

pytestmark = [pytest.mark.model]

OP = paged_attention_op()
ATTENTION_PATHS = path_names("attention")
PATHS = range(len(ATTENTION_PATHS))


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
    """Float64 attention of each row over its table (GQA: q head i reads kv head i // G)."""
    heads, kv_heads = q.shape[1], k.shape[0]
    out = []
    for b, table in enumerate(tables):
        idx = torch.tensor(table)
        keys = k[:, idx].double().repeat_interleave(heads // kv_heads, dim=0)
        values = v[:, idx].double().repeat_interleave(heads // kv_heads, dim=0)
        scores = torch.einsum("hd,htd->ht", q[b].double(), keys) * scale
        out.append(torch.einsum("ht,htd->hd", torch.softmax(scores, -1), values))
    return torch.stack(out)


def _run(q, k, v, tables, scale, path):
    """Each row with its own table (decode rows)."""
    slots = torch.tensor([s for t in tables for s in t], dtype=torch.int32)
    lengths = torch.tensor([len(t) for t in tables])
    begins = torch.cumsum(lengths, 0) - lengths
    return OP(q, k, v, slots, begins, lengths, scale, path)


def _run_chunk(q, k, v, table, first, scale, path):
    """Rows of one prefill chunk: row i sits at position first + i and reads table[:first+i+1]."""
    rows = q.shape[0]
    slots = torch.tensor(table[:first + rows], dtype=torch.int32)
    lengths = torch.arange(first + 1, first + rows + 1)
    return OP(q, k, v, slots, torch.zeros(rows, dtype=torch.int64), lengths, scale, path)


def test_kernel_builds_here_and_reports_the_cpu_path():
    # The kernel is part of the engine on this project's machines: a build failure here is a
    # real failure, not a reason to fall back silently.
    assert OP is not None
    flags = cpu_flags()
    expected = 0
    if {"avx2", "fma"} <= flags:
        expected = 1
    if {"avx512f", "avx512dq"} <= flags:
        expected = 3 if {"avx512bw", "avx512vl", "avx512_bf16"} <= flags else 2
        if expected == 3 and {"amx_tile", "amx_bf16"} <= flags:
            expected = 4
    assert attention_path() == expected
    skipped = [name for i, name in enumerate(ATTENTION_PATHS) if i > expected]
    print(f"attention paths tested here: {ATTENTION_PATHS[:expected + 1]}; "
          f"not this CPU's (they run as the best path it has; the AVX-512 ones, AMX aside, "
          f"also on an emulated CPU in test_emulated_avx512.py): {skipped}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 4, 64), (7, 1, 64), (8, 2, 128), (6, 2, 128),
                          (6, 2, 96), (4, 1, 256), (6, 2, 256)])
def test_every_path_matches_float64(dtype, path, heads, kv_heads, dim):
    # Lengths cover one key, partial blocks of 4, 8 and 16 keys, an odd tail (V is read in
    # pairs on the BF16 path), L1-sized key blocks and long contexts; head counts cover the
    # bfloat16 path's blocks of query heads (4 at dim 64, 2 at dims 96, 128 and 256) and their
    # remainders; dim 256 (Gemma 3's; 4 query heads per kv head as its 1B) is read in slices
    # of 128 dims on the AVX2 and BF16 paths and scored in two passes on the AMX one, and 96
    # (Phi-3-mini's) runs path 3 where AMX is (its tiles are 64 dims wide). A path above this
    # CPU's runs as the best it has.
    lengths = [1, 3, 15, 16, 17, 33, 64, 65, 301]
    q, k, v, tables = _case(dtype, heads, kv_heads, dim, lengths, seed=heads * dim + path)
    scale = dim**-0.5
    got = _run(q, k, v, tables, scale, path)
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(q, k, v, tables, scale)
    # bfloat16: outputs are rounded to 8 bits of mantissa (and probabilities too on the BF16
    # path); float32 only reorders sums.
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max().item() < tolerance
    # The same rows as one prefill chunk (a shared table, lengths growing row by row: the
    # AVX2 path's tiles of 8 rows).
    first = 290
    chunk = torch.randn(11, heads, dim, generator=torch.Generator().manual_seed(path)).to(dtype)
    table = tables[-1]
    got = _run_chunk(chunk, k, v, table, first, scale, path)
    want = _reference(chunk, k, v, [table[:first + i + 1] for i in range(11)], scale)
    assert (got.double() - want).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", PATHS)
def test_a_rows_bits_do_not_depend_on_the_rows_around_it(dtype, path):
    # A 300-token prompt's rows computed as one chunk, as chunks of other sizes (other tile
    # cuts), and one by one as decode rows beside unrelated requests: bitwise the same. This
    # is what makes a cached prefix's K/V, and everything computed after it, the same as with
    # the cache off.
    q, k, v, tables = _case(dtype, 9, 3, 64, [300, 77, 500], seed=path)
    prompt = tables[0]
    rows = torch.randn(300, 9, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    whole = _run_chunk(rows, k, v, prompt, 0, 0.125, path)
    for cut in ([0, 5, 100, 101, 300], [0, 299, 300], [0, 13, 29, 250, 300]):
        parts = [_run_chunk(rows[a:b].contiguous(), k, v, prompt, a, 0.125, path)
                 for a, b in zip(cut, cut[1:], strict=False)]
        assert torch.equal(torch.cat(parts), whole), cut
    for i in (0, 7, 8, 150, 299):
        batch = torch.stack([q[1], rows[i], q[2]])
        alone = _run(batch, k, v, [tables[1], prompt[:i + 1], tables[2]], 0.125, path)
        assert torch.equal(alone[1], whole[i]), i


def test_paths_really_differ_and_ignore_slot_layout():
    # The vector paths are not the portable one under another name (their float rounding
    # differs), and moving a context's K/V to other slots changes nothing, bit for bit.
    top = attention_path()
    q, k, v, tables = _case(torch.float32, 9, 3, 64, [40, 300, 1000], seed=5)
    runs = {path: _run(q, k, v, tables, 0.125, path) for path in PATHS}
    if top >= 1:  # float32 shows a vector path's different order of sums
        assert not torch.equal(runs[1], runs[0])
    if top >= 2:
        assert not torch.equal(runs[2], runs[1])
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    bf16_runs = {path: _run(qb, kb, vb, tables, 0.125, path) for path in PATHS}
    if top >= 3:  # bfloat16 probabilities on the BF16 path
        assert not torch.equal(bf16_runs[3], bf16_runs[2])
    if top >= 4:  # the tiles sum each score over all dims in one order: a 300-row chunk
        # shows it (outputs are bfloat16, so 3 decode rows rarely do)
        rows = torch.randn(300, 9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
        assert not torch.equal(_run_chunk(rows, kb, vb, tables[2], 0, 0.125, 4),
                               _run_chunk(rows, kb, vb, tables[2], 0, 0.125, 3))
        # One query head per kv head runs path 3 (a decode row's tile would be 1/16 full).
        q1, k1, v1, tables1 = _case(torch.bfloat16, 4, 4, 64, [40, 300], seed=6)
        assert torch.equal(_run(q1, k1, v1, tables1, 0.125, 4),
                           _run(q1, k1, v1, tables1, 0.125, 3))
    # A pool twice as large: the first two contexts move to fresh slots in the new half.
    fresh = random.Random(1).sample(range(k.shape[1], 2 * k.shape[1]), 340)
    moved_tables = [fresh[:40], fresh[40:], tables[2]]  # the 1,000-slot context stays
    for pool, results in (((q, k, v), runs), ((qb, kb, vb), bf16_runs)):
        query, keys, values = pool
        moved_k, moved_v = torch.cat((keys, torch.zeros_like(keys)), 1), torch.cat(
            (values, torch.zeros_like(values)), 1)
        for table, new in zip(tables[:2], moved_tables, strict=False):
            moved_k[:, new], moved_v[:, new] = keys[:, table], values[:, table]
        for path in PATHS:
            assert torch.equal(_run(query, moved_k, moved_v, moved_tables, 0.125, path),
                               results[path])


def test_bad_input_is_refused_not_read():
    q, k, v, tables = _case(torch.float32, 4, 2, 64, [5, 6])
    slots = torch.tensor([s for t in tables for s in t], dtype=torch.int32)
    begins, lengths = torch.tensor([0, 5]), torch.tensor([5, 6])
    top = len(ATTENTION_PATHS) - 1
    for index in (3, 0):
        bad = slots.clone()
        bad[index] = k.shape[1] if index else -1
        with pytest.raises(RuntimeError, match="outside the pool"):
            OP(q, k, v, bad, begins, lengths, 0.1, top)
    with pytest.raises(RuntimeError, match="at least one slot"):
        OP(q, k, v, slots, begins, torch.tensor([0, 6]), 0.1, top)
    with pytest.raises(RuntimeError, match="past slots"):
        OP(q, k, v, slots, begins, torch.tensor([5, 7]), 0.1, top)
    with pytest.raises(RuntimeError, match="begins and lengths"):
        OP(q, k, v, slots, torch.tensor([0]), lengths, 0.1, top)
    with pytest.raises(RuntimeError, match="int32"):
        OP(q, k, v, slots.long(), begins, lengths, 0.1, top)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        OP(q.half(), k.half(), v.half(), slots, begins, lengths, 0.1, top)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        OP(q[:, :3].contiguous(), k, v, slots, begins, lengths, 0.1, top)


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
                    prefix_cache="radix", debug_invariants=True, quantization="none")
    kernel = LLM(str(model_path), **settings)
    torch_path = LLM(str(model_path), attention_backend="torch",
                     prefill_attention_backend="sdpa", **settings)
    return kernel, torch_path


def _prompts(llm: LLM) -> list[dict]:
    rng = random.Random(3)
    system = [rng.randrange(200, 40000) for _ in range(300)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(200, 40000) for _ in range(3 + i)]}
               for i in range(5)]  # five chats on one cached system prompt
    prompts += [{"prompt_token_ids": llm.tokenizer.encode_chat(
        [{"role": "user", "content": f"Question {i}: name a colour."}])} for i in range(3)]
    return prompts


def test_engine_kernel_equals_torch_path(engines, monkeypatch):
    kernel, torch_path = engines
    attention = kernel.engine.runner.attention
    assert (attention.decode.name, attention.prefill.name) == ("kernel", "kernel")
    reference = torch_path.engine.runner.attention
    assert (reference.decode.name, reference.prefill.name) == ("torch", "sdpa")
    prompts = _prompts(kernel)
    calls = []  # rows per call of the kernel: from Python, or a whole step in the C++ stack
    op, run = attention.decode.op, DecoderStack.run

    def counted(*args):
        calls.append(args[0].shape[0])
        return op(*args)

    def stacked(self, x, *args):
        out = run(self, x, *args)
        if out is not None:
            calls.append(x.shape[0])
        return out

    attention.decode.op = attention.prefill.op = counted
    monkeypatch.setattr(DecoderStack, "run", stacked)
    try:
        got = [r.outputs[0].token_ids for r in kernel.generate(prompts, GREEDY)]
    finally:
        attention.decode.op = attention.prefill.op = op
    assert len(prompts) in calls  # decodes of the full batch went through it
    assert max(calls) >= 300  # and the system prompt's prefill
    want = [r.outputs[0].token_ids for r in torch_path.generate(prompts, GREEDY)]
    assert got == want
    for llm in engines:
        stats = llm.pool_stats()
        assert stats.balanced and stats.private == 0 and stats.protected == 0, stats


def test_engine_portable_kernel_path_agrees(engines):
    # The portable C++ path (what a CPU without AVX2 runs) gives the same greedy tokens.
    kernel, _ = engines
    prompts = _prompts(kernel)
    attention = kernel.engine.runner.attention
    want = [r.outputs[0].token_ids for r in kernel.generate(prompts, GREEDY)]
    top = attention.decode.max_path
    attention.decode.max_path = attention.prefill.max_path = 0
    try:
        got = [r.outputs[0].token_ids for r in kernel.generate(prompts, GREEDY)]
    finally:
        attention.decode.max_path = attention.prefill.max_path = top
    assert got == want


def test_kernel_backend_refuses_what_it_cannot_run(model_path):
    for setting in ("attention_backend", "prefill_attention_backend"):
        with pytest.raises(ValueError, match=f"{setting}='kernel' needs"):
            LLM(str(model_path), dtype="float16", kv_cache_tokens=256, show_progress=False,
                **{setting: "kernel"})
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(str(model_path), attention_backend="flash", show_progress=False)


def test_backends_are_named_at_start_and_refused_where_they_cannot_run(model_path, caplog):
    import logging

    settings = dict(dtype="float32", kv_cache_tokens=256, show_progress=False,
                    matmul_backend="torch", quantization="none")
    with caplog.at_level(logging.INFO, logger="radixserve.engine.engine"):
        LLM(str(model_path), attention_backend="torch", prefill_attention_backend="sdpa",
            **settings)
        LLM(str(model_path), **settings)
    assert "attention: decode torch, prefill sdpa; projections: torch" in caplog.text
    # The kernel's vector path is named: float32 pools never run the bfloat16 paths.
    path = ATTENTION_PATHS[min(attention_path(), 2)]
    assert (f"attention: decode kernel ({path}), prefill kernel ({path}); projections: torch"
            in caplog.text)
    with pytest.raises(ValueError, match="prefill_attention_backend='blocked' needs"):
        LLM(str(model_path), prefill_attention_backend="blocked", **settings)
    with pytest.raises(ValueError, match="prefill_attention_backend must be one of"):
        LLM(str(model_path), prefill_attention_backend="flash", show_progress=False)
