"""The disk KV tier inside the engine, on the real default model: blocks loaded from disk give
the same output as computing them (cache on with the tier == cache off), under eviction,
corruption, two engines writing one directory, and restarts; tenants never read each other's
blocks; pins outlive a restart and expire on schedule; an aborted load frees everything."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.kv_offload import KVOffload
from radixserve.engine.kv_pool import KVPool
from radixserve.kv_tier.store import TierStore
from radixserve.model.rope import rotary_identity
from radixserve.server.accounting import OffsetClock
from tests.support.tier import FINGERPRINT, run_command
from tests.support.workloads import mixed_workload, run_rounds

pytestmark = [pytest.mark.model]

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _settings(**overrides) -> dict:
    settings = dict(dtype="float32", kv_cache_tokens=8192, show_progress=False,
                    debug_invariants=True, kv_offload_block_tokens=16)
    settings.update(overrides)
    return settings


@pytest.fixture(scope="module")
def off(model_path) -> LLM:
    return LLM(str(model_path), **_settings(prefix_cache="off"))


@pytest.fixture(scope="module")
def rounds(off) -> list[list[list[int]]]:
    return mixed_workload(off)


@pytest.fixture(scope="module")
def expected(off, rounds) -> list[list[int]]:
    return run_rounds(off, rounds)


def _tier_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kv"))


def _assert_idle(llm: LLM) -> None:
    stats = llm.pool_stats()
    assert stats.balanced and stats.private == 0 and stats.protected == 0, stats


@pytest.mark.parametrize("mode, page_size, block", [("radix", 1, 16), ("hash", 16, 32)])
def test_tier_under_eviction_equals_cache_off(model_path, tmp_path, rounds, expected, mode,
                                              page_size, block):
    # A pool that holds little more than one round: every round evicts the one before, and the
    # second pass finds its prefixes on disk only.
    longest = max(len(p) for r in rounds for p in r)
    with LLM(str(model_path), **_settings(
            prefix_cache=mode, page_size=page_size, kv_cache_tokens=longest * 2,
            kv_offload_dir=str(tmp_path), kv_offload_block_tokens=block)) as llm:
        assert run_rounds(llm, rounds) == expected
        llm.engine.offload.store.flush()
        assert run_rounds(llm, rounds) == expected
        counters = llm.engine.scheduler.counters
        assert llm.engine.cache.stats().evicted_tokens_total > 0
        assert counters.kv_tier_hits > 0, counters
        assert counters.kv_tier_hits <= counters.prefix_cache_hits
        stats = llm.engine.offload.store.stats()
        assert stats.counters.bytes_read > 0 and sum(stats.counters.errors.values()) == 0
        _assert_idle(llm)


def test_restart_reads_the_tier_and_usage_counts_it(model_path, tmp_path, off):
    tok = off.tokenizer
    prefix = tok.encode("Notes on the harbour town: " + "ships, nets and gulls; " * 60)
    first, second = prefix + tok.encode(" What is sold?"), prefix + tok.encode(" Who lives here?")
    with LLM(str(model_path), **_settings(kv_offload_dir=str(tmp_path))) as llm:
        llm.generate({"prompt_token_ids": first}, GREEDY, use_tqdm=False)
    with LLM(str(model_path), **_settings(kv_offload_dir=str(tmp_path))) as llm:
        result = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
        counters = llm.engine.scheduler.counters
        assert llm.engine.offload is not None  # its fingerprint names the rotary tables used
        assert llm.engine.offload.store.fingerprint.rotary == rotary_identity(
            llm.engine.model.rope_tables)
    reference = off.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    assert result.outputs[0].token_ids == reference.outputs[0].token_ids
    # Every full block of the shared prefix came from disk, and usage says so.
    assert result.num_cached_tokens == len(prefix) // 16 * 16
    assert counters.kv_tier_hits == result.num_cached_tokens == counters.prefix_cache_hits


def test_corrupted_truncated_and_deleted_entries_are_computed(model_path, tmp_path, rounds,
                                                              expected):
    with LLM(str(model_path), **_settings(kv_offload_dir=str(tmp_path))) as llm:
        assert run_rounds(llm, rounds) == expected
        store = llm.engine.offload.store
        store.flush()
        files = _tier_files(tmp_path)
        rng = random.Random(7)
        rng.shuffle(files)
        damaged = files[: len(files) // 2]
        for i, path in enumerate(damaged):
            data = bytearray(path.read_bytes())
            if i % 3 == 0:
                data[rng.randrange(len(data))] ^= 0x40  # one flipped bit
                path.write_bytes(bytes(data))
            elif i % 3 == 1:
                path.write_bytes(bytes(data[: rng.randrange(len(data))]))
            else:
                path.unlink()
        llm.engine.cache.reset()  # the pool forgets: everything must come from the tier
        assert run_rounds(llm, rounds) == expected
        errors = store.stats().counters.errors
        assert errors["corrupt"] + errors["truncated"] + errors["missing"] > 0, errors
        assert llm.engine.scheduler.counters.kv_tier_hits > 0
        _assert_idle(llm)
    # Bad files were deleted, not left to fail again (a few may have been rewritten since).
    assert all(not p.exists() or p.stat().st_size > 0 for p in damaged)


def test_tenants_never_read_each_others_blocks(model_path, tmp_path, off):
    prompt = off.tokenizer.encode("A private memo about the quarterly figures. " * 20)
    with LLM(str(model_path), **_settings(kv_offload_dir=str(tmp_path))) as llm:
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, cache_salt="alice")
        llm.engine.offload.store.flush()
        llm.engine.cache.reset()
        bob = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                           cache_salt="bob")[0]
        assert bob.num_cached_tokens == 0
        assert llm.engine.scheduler.counters.kv_tier_hits == 0
        llm.engine.cache.reset()
        alice = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                             cache_salt="alice")[0]
        assert alice.num_cached_tokens > 0
        assert llm.engine.scheduler.counters.kv_tier_hits == alice.num_cached_tokens


def test_two_engines_writing_one_directory(model_path, tmp_path, rounds, expected):
    engines = [LLM(str(model_path), **_settings(kv_offload_dir=str(tmp_path)))
               for _ in range(2)]
    outputs: list[list[list[int]]] = [[], []]

    def run(i: int) -> None:
        outputs[i] = run_rounds(engines[i], rounds if i == 0 else rounds[::-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for llm in engines:
        llm.close()
    assert outputs[0] == expected
    assert outputs[1] == [t for r in rounds[::-1] for t in _expected_round(rounds, expected, r)]
    with LLM(str(model_path), **_settings(kv_offload_dir=str(tmp_path))) as reader:
        assert run_rounds(reader, rounds) == expected
        stats = reader.engine.offload.store.stats()
        assert sum(stats.counters.errors.values()) == 0, stats.counters.errors
        assert reader.engine.scheduler.counters.kv_tier_hits > 0


def _expected_round(rounds, expected, wanted) -> list[list[int]]:
    start = 0
    for r in rounds:
        if r is wanted:
            return expected[start : start + len(r)]
        start += len(r)
    raise AssertionError("round not found")


def _engine(model_path, directory, clock, **overrides) -> LLMEngine:
    config = EngineConfig(model=str(model_path), **_settings(kv_offload_dir=str(directory),
                                                             **overrides))
    return LLMEngine(config, clock=clock)


def _run(engine: LLMEngine, ids: list[int], pins=None) -> None:
    engine.add_request(ids, GREEDY, pins=pins)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_pin_outlives_a_restart_and_expires_on_schedule(model_path, tmp_path, off):
    tok = off.tokenizer
    prefix = tok.encode("Standing instructions for the night shift. " * 12)
    tail = tok.encode(" A first question, asked at some length, about the rota?" * 3)
    pinned = len(prefix) // 16 * 16
    clock = OffsetClock()
    engine = _engine(model_path, tmp_path, clock)
    _run(engine, prefix + tail, pins=[(len(prefix), 3600.0)])
    engine.close()
    assert engine.offload.store.stats().pinned_entries == pinned // 16

    clock = OffsetClock()
    clock.advance(1800)  # half an hour later, a new process
    engine = _engine(model_path, tmp_path, clock)
    store = engine.offload.store
    assert store.stats().pinned_entries == pinned // 16
    # The load runs past the pinned prefix (the tail's blocks are on disk too) ...
    _run(engine, prefix + tail + tok.encode(" And a second one?"))
    assert engine.scheduler.counters.kv_tier_hits == (len(prefix) + len(tail)) // 16 * 16
    # ... and the pinned part is pinned in the pool too, for the half hour it has left.
    assert engine.pool_stats().pinned == pinned
    clock.advance(1700)  # (real seconds pass too: a margin for them)
    assert engine.pool_stats().pinned > 0 and store.stats().pinned_entries > 0
    clock.advance(200)
    assert engine.pool_stats().pinned == 0
    assert store.stats().pinned_entries == 0
    assert all(store.pinned_until(k) == float("-inf") for k in list(store._index))
    engine.close()


def test_loading_requests_count_against_max_num_seqs(model_path, tmp_path, off):
    prompts = [off.tokenizer.encode(f"Chapter {i} of the almanac, on tides and moons. " * 6)
               for i in range(3)]
    engine = _engine(model_path, tmp_path, OffsetClock())
    for prompt in prompts:
        _run(engine, prompt)
    engine.close()
    engine = _engine(model_path, tmp_path, OffsetClock(), max_num_seqs=1)
    for prompt in prompts:
        engine.add_request(prompt + [13], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) + len(engine.scheduler.loading) <= 1
    assert engine.scheduler.counters.kv_tier_hits >= 3 * 16
    engine.close()


def test_pinned_prefixes_are_written_even_when_the_queue_is_full(model_path, tmp_path, off):
    tok = off.tokenizer
    prefix = tok.encode("Terms and conditions of the loyalty scheme. " * 12)
    engine = _engine(model_path, tmp_path, OffsetClock(), kv_offload_queue_mb=1e-6)
    _run(engine, prefix + tok.encode(" Question?") * 20, pins=[(len(prefix), 300.0)])
    engine.close()
    stats = engine.offload.store.stats()
    assert stats.entries == len(prefix) // 16  # the pinned blocks, and only those
    assert stats.pinned_entries == stats.entries
    assert stats.counters.dropped_writes > 0


def test_aborting_a_request_while_it_loads_frees_everything(model_path, tmp_path, off,
                                                            monkeypatch):
    prompt = off.tokenizer.encode("The long story of the lighthouse keeper. " * 20)
    engine = _engine(model_path, tmp_path, OffsetClock())
    _run(engine, prompt)
    engine.offload.store.flush()
    engine.cache.reset()
    release = threading.Event()
    real_read = engine.offload.store.read

    def slow_read(key, *args):
        release.wait(10)
        return real_read(key, *args)

    monkeypatch.setattr(engine.offload.store, "read", slow_read)
    request_id = engine.add_request(prompt + [13], GREEDY)
    engine.step()  # admitted: its load is held up
    assert len(engine.scheduler.loading) == 1 and engine.pool_stats().private > 0
    engine.abort_request(request_id)
    assert engine.pool_stats().private > 0  # the loader may still write those slots
    release.set()
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.pool_stats()
    assert stats.balanced and stats.private == 0 and stats.protected == 0, stats
    engine.close()
    assert os.path.isdir(engine.offload.store.dir)


def test_a_full_disk_leaves_serving_untouched(model_path, tmp_path, rounds, expected, caplog):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (tests/test_kv_tier_store.py covers a "
                    "full disk by a file-size limit too)")
    root = tmp_path / "small"
    root.mkdir()
    why = run_command("mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(root))
    if why:
        pytest.skip(f"cannot mount a small tmpfs ({why})")
    try:
        with caplog.at_level(logging.WARNING, logger="radixserve.kv_tier.store"):
            with LLM(str(model_path), **_settings(kv_offload_dir=str(root))) as llm:
                assert run_rounds(llm, rounds) == expected
                llm.engine.offload.store.flush()
                assert run_rounds(llm, rounds) == expected  # still serving, and the same
                stats = llm.engine.offload.store.stats()
                _assert_idle(llm)
    finally:
        run_command("umount", str(root))
    assert not stats.writable and stats.counters.errors["write"] >= 1
    assert stats.entries > 0  # what fitted was written, and is still read
    stopped = [r for r in caplog.records if "without writing" in r.getMessage()]
    assert len(stopped) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_loader_copies_blocks_into_the_pool_on_its_own_thread(tmp_path):
    """A block read from disk lands in its slots (a run or scattered, whole or after the
    positions the pool had), copied on the loader thread alone: no OpenMP team starts there,
    since a second team in the process slows every engine step (`async_engine` says why). The
    shapes are a real-size model's, where torch's own copy of one layer's K would run in
    parallel."""
    layers, heads, tokens, dim = 2, 8, 64, 128
    shape = (layers, 2, heads, tokens, dim)
    fingerprint = dataclasses.replace(FINGERPRINT, num_layers=layers, num_kv_heads=heads,
                                      head_dim=dim, page_size=1, block_tokens=tokens)
    pool = KVPool(layers, 512, 1, heads, dim, torch.float32, "cpu")
    offload = KVOffload(TierStore(str(tmp_path), fingerprint, 1 << 30, 1 << 30), pool, tokens,
                        time.monotonic)
    data = torch.randn(shape)
    scattered = random.Random(0).sample(range(200, 512), tokens - 8)
    try:
        for skip, slots in [(0, list(range(10, 10 + tokens))), (16, list(range(100, 148))),
                            (8, scattered)]:
            started: list[int] = []

            def load(skip=skip, slots=slots, started=started) -> None:
                before = len(os.listdir("/proc/self/task"))
                offload._copy_in(data.numpy().tobytes(), skip, slots)
                started.append(len(os.listdir("/proc/self/task")) - before)

            loader = threading.Thread(target=load)
            loader.start()
            loader.join()
            assert started == [0], f"the copy started {started} threads"
            for i, layer in enumerate(pool.layers):
                assert torch.equal(layer.k[:, slots], data[i, 0, :, skip:])
                assert torch.equal(layer.v[:, slots], data[i, 1, :, skip:])
    finally:
        offload.close()
