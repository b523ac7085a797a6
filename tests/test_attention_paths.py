"""The fast paths under attention, checked against plain references on random tensors.

- The blocked causal prefill attention (bfloat16 on CPU) against float32 softmax attention,
  for chunks that start at 0 and mid-context, lengths off the block size, and GQA.
- KV reads through a gather plan (views of slot runs + one index_select) against reading
  every slot one by one.
- The attention backend chooser: auto takes the first backend that runs here, per role.
- The page allocator's contiguous first-fit: fresh and freed runs come back as one run, a
  fragmented pool gives its lowest pages in order, and the books always balance.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine.kv_pool import KVPool, OutOfSlots, PageAllocator
from radixserve.layers.attention import BACKENDS, AttentionEnv, choose_attention, choose_backend
from radixserve.layers.attention.blocked_prefill import BlockedPrefill
from radixserve.layers.attention.gather import GatherPlanner, KVGather, slot_run


def _env(dtype: torch.dtype = torch.bfloat16, heads: int = 6, kv_heads: int = 2,
         head_dim: int = 32, native_bf16: bool = True) -> AttentionEnv:
    # native_bf16 states the CPU kind, so both kinds' choices are checked on either machine.
    return AttentionEnv(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, window=None,
                        num_slots=4096, device=torch.device("cpu"), dtype=dtype,
                        native_bf16=native_bf16)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int,
               scale: float) -> torch.Tensor:
    """Float32 causal attention of queries at positions first.. over keys 0..first+n-1."""
    n, heads, _ = q.shape
    groups = heads // keys.shape[0]
    k = keys.float().repeat_interleave(groups, 0)  # [H, ctx, D]
    v = values.float().repeat_interleave(groups, 0)
    scores = torch.einsum("nhd,hcd->hnc", q.float(), k) * scale
    ctx = keys.shape[1]
    allowed = torch.arange(ctx)[None, :] <= (torch.arange(n)[:, None] + first)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,hcd->nhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize(("first", "n"), [(0, 7), (0, 300), (0, 512), (100, 1), (333, 290)])
def test_blocked_prefill_attention_matches_reference(first, n):
    torch.manual_seed(first + n)
    env = _env()
    attn = BlockedPrefill(env)
    # The cases' random data as first written: it followed two projections' initialisation.
    torch.nn.Linear(192, 320, bias=False), torch.nn.Linear(192, 192, bias=False)
    q = torch.randn(n, 6, 32, dtype=torch.bfloat16)
    keys = torch.randn(2, first + n, 32, dtype=torch.bfloat16)
    values = torch.randn(2, first + n, 32, dtype=torch.bfloat16)
    assert BlockedPrefill.unavailable(env) is None
    got = attn.causal(q, keys, values, first).float()
    want = _reference(q, keys, values, first, env.scale)
    # bfloat16 probabilities and outputs: a few units in the last place of values ~1.
    assert (got - want).abs().max().item() < 0.03
    # A future key leaking in would move outputs by far more than that: the check can fail.
    leaky = _reference(q, keys, values, first + 1, env.scale) if n > 1 else None
    if leaky is not None:
        assert (leaky - want).abs().max().item() > 0.1


def test_float32_and_cuda_keep_sdpa():
    assert BlockedPrefill.unavailable(_env(torch.float32)) is not None
    cuda = AttentionEnv(6, 2, 32, None, 4096, torch.device("cuda"), torch.bfloat16)
    assert BlockedPrefill.unavailable(cuda) is not None


def test_cpus_that_emulate_bfloat16_keep_sdpa():
    # Without native bfloat16 dot products the blocked attention's matmuls are emulated: some
    # 30x slower than SDPA, so it is not offered there (its arithmetic is checked above on
    # every machine).
    assert "AVX512-BF16" in BlockedPrefill.unavailable(_env(native_bf16=False))
    assert choose_backend("prefill", "sdpa", _env(native_bf16=False)).name == "sdpa"


class _Planned:
    """A one-layer pool of random keys and a gather planner over it."""

    def __init__(self, min_copy_run: int) -> None:
        self.pool = KVPool(1, 400, 1, 2, 4, torch.float32, "cpu")
        self.pool.layers[0].k.copy_(torch.randn(2, 400, 4))
        self.planner = GatherPlanner(2, 400, torch.device("cpu"), min_copy_run)


def test_a_fresh_pool_zeroes_the_padding_slot_only():
    # Gathers pad with slot 0 and mask it: its values get weight 0, and 0 * NaN would not be 0.
    pool = KVPool(2, 64, 1, 2, 4, torch.float32, "cpu")
    for layer in pool.layers:
        assert not layer.k[:, 0].any() and not layer.v[:, 0].any()


def test_gather_plan_reads_the_same_rows_as_slot_by_slot():
    rng = random.Random(0)
    tables = [
        list(range(10, 60)) + [300, 7, 8],  # a run of 50, then scattered
        [5, 90, 91, 92],  # no run at its start
        list(range(200, 232)),  # exactly one run
        [rng.randrange(400) for _ in range(20)],
    ]
    length = max(len(t) for t in tables) + 3  # padding too
    for min_run in (8, 10**9):
        runner = _Planned(min_run)
        cache = runner.pool.layers[0].k
        plan = runner.planner.plan(tables, length)
        flat = [s for t in tables for s in t + [0] * (length - len(t))]
        want = cache.index_select(1, torch.tensor(flat))
        got = plan.take(cache)
        assert got.shape == want.shape
        assert torch.equal(got, want)
        runs = [seg for seg in plan.segments or [] if seg[0]]
        assert (len(runs) == 2) if min_run == 8 else not runs  # tables 0 and 2 have long runs


def test_gather_plan_without_runs_is_one_index_select():
    runner = _Planned(512)
    plan = runner.planner.plan([[3, 4, 5], [9]], 4)
    assert plan.segments is None
    slots = [3, 4, 5, 0, 9, 0, 0, 0]
    # Rows of the [heads * slots, dim] view: head 1's copy of slot s is row 400 + s.
    assert plan.gathered is not None
    assert plan.gathered.tolist() == slots + [400 + s for s in slots]
    cache = runner.pool.layers[0].k
    assert torch.equal(plan.take(cache), cache[:, slots])
    assert isinstance(plan, KVGather)


def test_slot_run():
    assert slot_run([4, 5, 6, 9, 10], 5) == 3
    assert slot_run([4, 5, 6, 7], 2) == 2
    assert slot_run([4], 0) == 0
    assert slot_run([8, 2], 2) == 1


def test_allocator_hands_out_contiguous_runs():
    pool = PageAllocator(100, 1)
    a = pool.allocate(30)
    b = pool.allocate(30)
    assert a == list(range(30)) and b == list(range(30, 60))
    pool.release(a)
    # 40 pages: 0-29 are free but too short; the lowest run of 40 is 60-99.
    assert pool.allocate(40) == list(range(60, 100))
    # Fragmented: no run of 31 left, so the lowest free pages, in order.
    pool.release(b[::2])
    got = pool.allocate(31)
    assert got == sorted(got) and got[:30] == list(range(30))
    assert got[30] == 30
    with pytest.raises(OutOfSlots):
        pool.allocate(pool.free_slots + 1)


def test_allocator_books_balance_under_random_use():
    rng = random.Random(1)
    pool = PageAllocator(64, 4)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.5:
            pool.release(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 9)
            if n * 4 <= pool.free_slots:
                slots = pool.allocate(n)
                assert len(slots) == 4 * n and slots == sorted(slots)
                assert all(s % 4 == i % 4 for i, s in enumerate(slots))  # whole pages
                held.append(slots)
        used = [s for slots in held for s in slots]
        assert len(used) == len(set(used))
        assert pool.free_slots + len(used) == pool.num_slots
    slots = pool.allocate(1)
    pool.release(slots)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(slots)


def test_one_chooser_picks_each_role_by_setting_and_place():
    # auto takes the first backend of its role that runs here; a named one that cannot run is
    # refused with the setting's name, never swapped for another.
    cpu_bf16, cpu_f32 = _env(torch.bfloat16), _env(torch.float32)
    cuda = AttentionEnv(6, 2, 32, None, 4096, torch.device("cuda"), torch.bfloat16)
    # On the CPU the kernel takes both roles (a row's bits then never depend on chunking).
    assert choose_backend("prefill", "auto", cpu_bf16).name == "kernel"
    assert choose_backend("prefill", "auto", cpu_f32).name == "kernel"
    assert choose_backend("decode", "auto", cpu_f32).name == "kernel"
    assert choose_backend("prefill", "blocked", cpu_bf16).name == "blocked"
    assert choose_backend("prefill", "auto", cuda).name == "sdpa"
    assert choose_backend("prefill", "auto", _env(torch.float16)).name == "blocked"
    assert choose_backend("decode", "auto", cuda).name == "torch"
    assert choose_backend("decode", "torch", cpu_f32).name == "torch"
    with pytest.raises(ValueError, match="attention_backend='kernel' needs a CPU device"):
        choose_backend("decode", "kernel", cuda, "attention_backend")
    with pytest.raises(ValueError, match="prefill_attention_backend='blocked' needs"):
        choose_attention(cpu_f32, prefill="blocked")
    with pytest.raises(ValueError, match="unknown decode attention backend 'flash'"):
        choose_backend("decode", "flash", cpu_f32)
    assert {b.role for b in BACKENDS} == {"decode", "prefill"}
    assert choose_attention(cpu_f32, "torch", "sdpa").name == "decode torch, prefill sdpa"


def test_a_kernel_with_every_row_of_the_step_returns_them_and_otherwise_writes_its_rows():
    from radixserve.layers.attention import LayerKV
    from radixserve.layers.attention.paged_kernel import PagedDecodeKernel, PagedRows

    env = _env(torch.float32)
    if PagedDecodeKernel.unavailable(env):
        pytest.skip("the attention kernel cannot be built here")
    kernel = PagedDecodeKernel(env)
    torch.manual_seed(0)
    cache = LayerKV(torch.randn(2, 4096, 32), torch.randn(2, 4096, 32))
    q = torch.randn(3, 6, 32)
    every = PagedRows(0, 3, torch.arange(30, dtype=torch.int32), torch.tensor([0, 10, 20]),
                      torch.tensor([10, 10, 10]))
    whole = kernel.attend_all(q, q, q, cache, every, env.scale, None)
    out = torch.full_like(q, float("nan"))
    kernel.forward(q, q, q, cache, every, out, env.scale, None)
    assert whole is not None and torch.equal(whole, out)
    # Rows 1 and 2 of the step only: not all of it, so the step's buffer takes them.
    some = PagedRows(1, 2, torch.arange(20, dtype=torch.int32), torch.tensor([0, 10]),
                     torch.tensor([10, 10]))
    assert kernel.attend_all(q, q, q, cache, some, env.scale, None) is None
    kernel.forward(q, q, q, cache, some, out, env.scale, None)
    alone = kernel.attend_all(q[1:], q, q, cache, PagedRows(0, 2, some.slots, some.begins,
                                                            some.lengths), env.scale, None)
    assert torch.equal(out[1:], alone) and torch.equal(out[:1], whole[:1])  # row 0 untouched
    assert not torch.equal(out[1:], whole[1:])  # the other contexts: other results
