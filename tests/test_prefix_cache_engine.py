"""The prefix cache inside the engine, on the real default model: reuse is exact (cache on ==
cache off, bit for bit: on the default path, the GGUF kernels and the attention kernel, every
row's arithmetic is independent of batching and chunking; on the PyTorch attention path, in
float32 on the dequantized weights), honest (num_cached_tokens == the true shared prefix),
shared across concurrent requests, and kept apart between tenants."""

from __future__ import annotations

import dataclasses
import random

import pytest

from radixserve import LLM, SamplingParams
from tests.support.engine import use_torch_attention
from tests.support.workloads import mixed_workload, run_rounds

pytestmark = [pytest.mark.model]



def _engine(model_path, **overrides) -> LLM:
    settings = dict(dtype="float32", kv_cache_tokens=8192, show_progress=False,
                    debug_invariants=True)
    settings.update(overrides)
    return LLM(str(model_path), **settings)


@pytest.fixture(scope="module")
def radix(model_path):
    return _engine(model_path, prefix_cache="radix")


@pytest.fixture(scope="module")
def off(model_path):
    return _engine(model_path, prefix_cache="off")


# The PyTorch attention path (the CUDA path) promises equality where its arithmetic is float32
# on float weights: int8-quantized activations would turn SDPA's chunk-dependent last bits
# into different roundings.
@pytest.fixture(scope="module")
def radix_float(model_path):
    return _engine(model_path, prefix_cache="radix", quantization="none")


@pytest.fixture(scope="module")
def off_float(model_path):
    return _engine(model_path, prefix_cache="off", quantization="none")


def _assert_idle(llm: LLM) -> None:
    stats = llm.pool_stats()
    assert stats.balanced, stats
    assert stats.private == 0 and stats.protected == 0, stats


def test_cache_on_equals_cache_off(radix, off):
    # The default path: the attention kernel in both roles.
    attention = radix.engine.runner.attention
    assert (attention.decode.name, attention.prefill.name) == ("kernel", "kernel")
    rounds = mixed_workload(radix)
    expected = run_rounds(off, rounds)
    assert run_rounds(radix, rounds) == expected
    assert radix.engine.scheduler.counters.prefix_cache_hits > 0
    _assert_idle(radix)


def test_cache_on_equals_cache_off_on_the_pytorch_path(radix_float, off_float, monkeypatch):
    # PyTorch's decode gathers with shared-prefix groups and SDPA prefill over cached context.
    for llm in (radix_float, off_float):
        use_torch_attention(monkeypatch, llm)
    rounds = mixed_workload(radix_float)
    expected = run_rounds(off_float, rounds)
    assert run_rounds(radix_float, rounds) == expected
    assert radix_float.engine.scheduler.counters.prefix_cache_hits > 0
    _assert_idle(radix_float)


@pytest.mark.parametrize("mode, page_size", [("radix", 1), ("radix", 4), ("hash", 16)])
def test_cache_on_equals_off_under_eviction(model_path, off, mode, page_size):
    rounds = mixed_workload(off)
    expected = run_rounds(off, rounds)
    # A pool that holds little more than one round: every round evicts the one before.
    longest = max(len(p) for r in rounds for p in r)
    small = _engine(model_path, prefix_cache=mode, page_size=page_size,
                    kv_cache_tokens=longest * 2)
    assert run_rounds(small, rounds) == expected
    assert small.engine.cache.stats().evicted_tokens_total > 0
    _assert_idle(small)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("page_size", [1, 8])
def test_num_cached_tokens_is_the_true_shared_prefix(model_path, page_size):
    llm = _engine(model_path, prefix_cache="radix", page_size=page_size)
    rng = random.Random(5)
    base = [rng.randrange(200, 40000) for _ in range(120)]
    prompts = [base[:50], base[:80], base[:30] + [7, 8, 9], base[:80], base[:81] + [5],
               [9] + base[:40], base[:50]]
    seen: list[list[int]] = []
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for prompt in prompts:
        result = llm.generate({"prompt_token_ids": prompt}, params)[0]
        best = max((_lcp(prompt, s) for s in seen), default=0)
        expected = min(best, len(prompt) - 1) // page_size * page_size
        assert result.num_cached_tokens == expected, (prompt[:3], len(prompt))
        # What the cache now holds: every token with computed KV (the last sample has none).
        seen.append((prompt + result.outputs[0].token_ids)[:-1])
    _assert_idle(llm)


def test_concurrent_requests_prefill_a_shared_prefix_once(radix, off):
    rng = random.Random(11)
    prefix = [rng.randrange(200, 40000) for _ in range(1000)]
    suffixes = [[rng.randrange(200, 40000) for _ in range(10)] for _ in range(8)]
    prompts = [{"prompt_token_ids": prefix + s} for s in suffixes]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    counters = radix.engine.scheduler.counters
    before = counters.computed_prompt_tokens
    results = radix.generate(prompts, params)
    computed = counters.computed_prompt_tokens - before
    # The 1,000-token prefix once, plus each request's own suffix.
    assert computed <= 1000 + 8 * 10, computed
    assert sum(r.num_cached_tokens for r in results) >= 7 * 1000
    # The first (computed) and two that read it; the other five are read the same way.
    expected = off.generate(prompts[:3], params)
    assert ([r.outputs[0].token_ids for r in results[:3]]
            == [r.outputs[0].token_ids for r in expected])
    _assert_idle(radix)


def test_tenants_never_share(radix):
    prompt = {"prompt_token_ids": list(range(300, 700))}
    params = SamplingParams(max_tokens=1, temperature=0)
    radix.generate(prompt, params, cache_salt="tenant-a")
    other = radix.generate(prompt, params, cache_salt="tenant-b")[0]
    same = radix.generate(prompt, params, cache_salt="tenant-a")[0]
    unsalted = radix.generate(prompt, params)[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 399
    assert unsalted.num_cached_tokens == 0
    _assert_idle(radix)


def test_n_samples_share_the_prompt(radix):
    rng = random.Random(3)
    prompt = {"prompt_token_ids": [rng.randrange(200, 40000) for _ in range(400)]}
    counters = radix.engine.scheduler.counters
    before = counters.computed_prompt_tokens
    result = radix.generate(prompt, SamplingParams(max_tokens=4, temperature=1.0, n=4, seed=1))[0]
    assert len(result.outputs) == 4
    assert counters.computed_prompt_tokens - before <= 400 + 3  # one prefill, 3 one-token hits
    _assert_idle(radix)


def test_decode_groups_sharing_different_prefixes_match_cache_off(radix_float, off_float,
                                                                  monkeypatch):
    # Two system prompts, three chats each, decoding in one batch: on the PyTorch decode path
    # each trio's prefix is gathered once per step for the trio, and outputs equal the
    # cache-off ones.
    rng = random.Random(21)
    systems = [[rng.randrange(200, 40000) for _ in range(150)] for _ in range(2)]
    prompts = [{"prompt_token_ids": systems[i % 2] + [rng.randrange(200, 40000) for _ in range(4 + i)]}
               for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    radix, off = radix_float, off_float
    for llm in (radix, off):
        use_torch_attention(monkeypatch, llm)
    decode = radix.engine.runner.attention.decode
    seen: list[list[tuple[int, int]]] = []
    original = decode.group_decodes

    def spy(decodes, window=None):
        groups = original(decodes, window)
        seen.append([(len(members), shared) for members, shared, _ in groups])
        return groups

    monkeypatch.setattr(decode, "group_decodes", spy)
    radix.generate(prompts[:2], SamplingParams(max_tokens=1, temperature=0))  # warm both
    got = [r.outputs[0].token_ids for r in radix.generate(prompts, params)]
    assert any(sorted(g) == [(3, 150), (3, 150)] for g in seen), seen
    assert got == [r.outputs[0].token_ids for r in off.generate(prompts, params)]
    _assert_idle(radix)


def test_kv_read_through_slot_runs_matches_cache_off(radix_float, off_float, monkeypatch):
    # Cached prefixes and prompts are allocated as slot runs; with the run threshold lowered,
    # attention reads them as views of the pool (prefill over a cached context, and decode on
    # the PyTorch path) instead of gathering slot by slot. Outputs must not change.
    radix, off = radix_float, off_float
    for llm in (radix, off):
        use_torch_attention(monkeypatch, llm)
    attention = radix.engine.runner.attention
    plans = []
    for backend in (attention.decode, attention.prefill):
        planner = dataclasses.replace(backend.gathers, min_copy_run=16)
        original = planner.plan

        def spy(tables, length, original=original):
            plan = original(tables, length)
            plans.append(plan)
            return plan

        planner.plan = spy  # type: ignore[method-assign]
        monkeypatch.setattr(backend, "gathers", planner)
    rounds = mixed_workload(radix)
    got = run_rounds(radix, rounds)
    assert got == run_rounds(off, rounds)
    assert any(plan.segments and any(s[0] for s in plan.segments) for plan in plans)
    _assert_idle(radix)


def test_max_tokens_0_samples_nothing_when_the_prompt_is_cached(radix, off):
    # A cached prompt leaves one token to compute, which must not be treated as a decode step
    # (a decode samples a token): cache on must give cache off's empty output.
    prompt = radix.tokenizer.encode("Only the prompt is wanted here, nothing after it. " * 4)
    params = SamplingParams(max_tokens=0, temperature=0)
    expected = off.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert expected.outputs[0].token_ids == []
    for _ in range(2):
        result = radix.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert result.outputs[0].token_ids == []
        assert result.outputs[0].finish_reason == expected.outputs[0].finish_reason
    assert result.num_cached_tokens == len(prompt) - 1
    _assert_idle(radix)
