"""The disk KV tier without a model: block keys, the entry format's checks, and the store's
index, capacity, pins, write queue, restarts, shared directories, and directories that stop
taking writes (read-only, full). Entries are small hand-made float32 blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from radixserve.kv_tier.blocks import ModelFingerprint, chain_keys
from radixserve.kv_tier.entry import ERROR_KINDS, EntryError, EntryHeader
from radixserve.kv_tier.store import TierStore
from radixserve.model.config import RopeConfig
from radixserve.model.rope import rope_table, rotary_identity
from radixserve.sequences import namespace_bytes
from tests.support.tier import FINGERPRINT, run_command

SHAPE = (2, 2, 1, 4, 8)  # [layers, K/V, kv heads, block tokens, head dim]: 512 bytes
BIG_SHAPE = (2, 2, 4, 16, 64)  # 64 KiB: fills a small filesystem in a few writes
LONG_SHAPE = (1, 2, 1, 2048, 1)  # a long block: its header (2048 token ids) outweighs 4 KiB
STORE_LOGGER = "radixserve.kv_tier.store"
MiB = 1 << 20


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass(frozen=True)
class Block:
    key: bytes
    header: EntryHeader
    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def file_bytes(self) -> int:
        """The entry's size on disk, from the documented format: magic, header length, header,
        K/V, XXH3-64."""
        return len(b"RSKVTIER") + 4 + len(self.header.encode()) + self.nbytes + 8


def make_blocks(count: int, seed: int, shape: tuple[int, ...] = SHAPE,
                fingerprint: ModelFingerprint = FINGERPRINT) -> list[Block]:
    """`count` first blocks of distinct prompts (so every entry has the same size), the same
    for the same seed in every process."""
    rng = np.random.default_rng(seed)
    block_tokens = shape[3]
    blocks = []
    for _ in range(count):
        tokens = [int(t) for t in rng.integers(100_000, 150_000, block_tokens)]  # 6 digits
        (key,) = chain_keys(fingerprint.digest, namespace_bytes(None), tokens, block_tokens)
        header = EntryHeader(
            key=key.hex(), parent=fingerprint.digest.hex(), fingerprint=fingerprint.name,
            namespace=namespace_bytes(None).decode(), start=0, tokens=tuple(tokens), dtype="float32",
            shape=shape, created=1.0e9,
        )
        payload = rng.standard_normal(shape, dtype=np.float32).tobytes()
        blocks.append(Block(key, header, payload))
    return blocks


def put(store: TierStore, block: Block, forced: bool = False,
        payload: Callable[[], memoryview] | None = None) -> bool:
    return store.put(block.key, block.header, payload or (lambda: memoryview(block.payload)),
                     block.nbytes, forced=forced)


def put_flushed(store: TierStore, block: Block) -> None:
    put(store, block)
    assert store.flush(10)


def entry_files(store: TierStore) -> dict[bytes, int]:
    """The entries on disk (key -> bytes), read from the directory, not the index."""
    files = {}
    for path in Path(store.dir).glob("*/*.kv"):
        files[bytes.fromhex(path.name[: -len(".kv")])] = path.stat().st_size
    return files


def temp_files(store: TierStore) -> list[Path]:
    return list(Path(store.dir).rglob("*.tmp"))


def reads_back(store: TierStore, block: Block) -> bool:
    header, payload = store.read(block.key)
    return header == block.header and bytes(payload) == block.payload


@pytest.fixture
def open_store() -> Iterator[Callable[..., TierStore]]:
    """Opens stores that are closed at the end of the test (those still running)."""
    stores: list[TierStore] = []

    def open_(root: Path | str, capacity_bytes: int = 64 * MiB, queue_bytes: int = 64 * MiB,
              fingerprint: ModelFingerprint = FINGERPRINT,
              wall_clock: Callable[[], float] = time.time) -> TierStore:
        store = TierStore(str(root), fingerprint, capacity_bytes, queue_bytes, wall_clock)
        stores.append(store)
        return store

    yield open_
    for store in stores:
        if store._writer.is_alive():
            store.close(timeout=10)


def steady_entries(root: Path, capacity_bytes: int, open_store) -> int:
    """How many entries of SHAPE a store of this capacity keeps, found by filling one, so the
    tests hold however the store reckons an entry's size against the capacity."""
    store = open_store(root, capacity_bytes=capacity_bytes)
    for block in make_blocks(30, seed=99):
        put_flushed(store, block)
    return store.stats().entries


# ----- keys -----


def documented_keys(fingerprint: bytes, namespace: bytes, tokens: list[int],
                    block_tokens: int) -> list[bytes]:
    """blocks.py's docstring, followed to the letter: what an outside consumer computes."""
    keys, previous, ns = [], fingerprint, namespace
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        data = previous + len(ns).to_bytes(4, "little") + ns
        data += b"".join(t.to_bytes(4, "little") for t in tokens[start : start + block_tokens])
        previous = hashlib.blake2b(data, digest_size=16).digest()
        keys.append(previous)
    return keys


_KEYS_SCRIPT = """
import json
from radixserve.kv_tier.blocks import ModelFingerprint, chain_keys
from radixserve.sequences import namespace_bytes
fingerprint = ModelFingerprint(**json.loads({fields!r}))
keys = chain_keys(fingerprint.digest, namespace_bytes(("tenant", None)), list(range(40)), 4)
print(json.dumps({{"keys": [k.hex() for k in keys], "hash": hash("tenant")}}))
"""


def test_keys_are_the_same_in_every_process_and_follow_the_documented_formula() -> None:
    script = _KEYS_SCRIPT.format(fields=json.dumps(dataclasses.asdict(FINGERPRINT)))
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
            for seed in ("1", "2")]
    outputs = [json.loads(run.communicate(timeout=60)[0]) for run in runs]
    assert outputs[0]["hash"] != outputs[1]["hash"]  # the seeds did change Python's hash()
    ns = namespace_bytes(("tenant", None))
    keys = [k.hex() for k in chain_keys(FINGERPRINT.digest, ns, list(range(40)), 4)]
    assert len(keys) == 10
    assert outputs[0]["keys"] == outputs[1]["keys"] == keys
    assert keys == [k.hex() for k in documented_keys(FINGERPRINT.digest, ns, list(range(40)), 4)]


def test_keys_differ_by_namespace_fingerprint_and_every_token() -> None:
    tokens = list(range(1000, 1012))  # three blocks
    digest = FINGERPRINT.digest
    base = chain_keys(digest, b"None", tokens, 4)

    namespaces = [None, "None", "a", ("a",), ("a", None), ("a", "b"), 0, ""]
    first_keys = {chain_keys(digest, namespace_bytes(ns), tokens, 4)[0] for ns in namespaces}
    assert len(first_keys) == len(namespaces)

    # Any one field of the fingerprint changes every key.
    changed = {"weights": "f" * 32, "dtype": "bfloat16", "quantization": "q8_0",
               "projections": "avx512", "attention": "paged", "num_layers": 3,
               "num_kv_heads": 2, "head_dim": 16, "page_size": 8, "block_tokens": 8,
               "layout_version": FINGERPRINT.layout_version + 1, "software": "other",
               "rotary": "e" * 32}
    assert set(changed) == {f.name for f in dataclasses.fields(ModelFingerprint)}
    for name, value in changed.items():
        other = dataclasses.replace(FINGERPRINT, **{name: value})
        assert other.name != FINGERPRINT.name, name
        keys = chain_keys(other.digest, b"None", tokens, 4)
        assert all(a != b for a, b in zip(keys, base, strict=True)), name

    # A token changes its block's key and every later one, never an earlier one.
    for position in range(len(tokens)):
        edited = list(tokens)
        edited[position] += 1
        keys = chain_keys(digest, b"None", edited, 4)
        block = position // 4
        assert keys[:block] == base[:block]
        assert all(a != b for a, b in zip(keys[block:], base[block:], strict=True))


def test_parents_are_extended_not_recomputed() -> None:
    tokens = list(range(500, 518))  # four full blocks and two tokens
    digest = FINGERPRINT.digest
    whole = chain_keys(digest, b"None", tokens, 4)
    assert len(whole) == 4  # the partial block has no key
    for known in range(5):
        assert chain_keys(digest, b"None", tokens, 4, parents=whole[:known]) == whole
    fake = [b"\x01" * 16]
    extended = chain_keys(digest, b"None", tokens, 4, parents=fake)
    assert extended[0] == fake[0] and extended[1] != whole[1]


def test_namespace_bytes_are_compact_json_of_plain_values_and_refuse_the_rest() -> None:
    assert namespace_bytes(None) == b""  # the shared namespace, as KV events spell it
    for namespace in ("salt", 7, ("tenant", None, ("nested", 3)), ()):
        assert namespace_bytes(namespace) == json.dumps(namespace, separators=(",", ":")).encode()
    for unstable in (object(), frozenset({"a", "b"}), ("tenant", object()), ["a"], b"salt",
                     1.5):
        with pytest.raises(TypeError, match="stable text"):
            namespace_bytes(unstable)


# ----- writing, reading, restarting -----


def test_round_trip_and_dedupe(tmp_path: Path, open_store) -> None:
    store = open_store(tmp_path)
    blocks = make_blocks(3, seed=1)
    calls: dict[bytes, int] = dict.fromkeys((b.key for b in blocks), 0)

    def counted(block: Block) -> Callable[[], memoryview]:
        def make() -> memoryview:
            calls[block.key] += 1
            return memoryview(block.payload)
        return make

    for block in blocks:
        assert put(store, block, payload=counted(block))
    assert put(store, blocks[0], payload=counted(blocks[0]))  # still queued
    assert store.flush(10)
    assert put(store, blocks[0], payload=counted(blocks[0]))  # on disk
    assert store.flush(10)
    assert calls == dict.fromkeys(calls, 1)

    files = entry_files(store)
    assert files == {b.key: b.file_bytes for b in blocks}
    for block in blocks:  # byte for byte the documented format, checksum included
        head = block.header.encode()
        body = b"RSKVTIER" + struct.pack("<I", len(head)) + head + block.payload
        expected = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        assert Path(store.path(block.key)).read_bytes() == expected
    stats = store.stats()
    assert stats.entries == 3 and stats.writable
    assert stats.bytes == stats.counters.bytes_written == sum(files.values())
    for block in blocks:
        assert store.contains(block.key)
        header, payload = store.read(block.key)
        assert header == block.header
        assert bytes(payload) == block.payload
        assert not payload.readonly  # the loader may hand it to torch.frombuffer
    assert store.stats().counters.bytes_read == 3 * blocks[0].nbytes
    assert not temp_files(store)


def test_restart_rebuilds_the_index_and_pins(tmp_path: Path, open_store) -> None:
    blocks = make_blocks(4, seed=2)
    first = open_store(tmp_path)
    for block in blocks:
        put(first, block)
    until = time.time() + 3600
    first.pin([blocks[2].key], until)
    assert first.flush(10)
    before = first.stats()
    first.close()
    stale = Path(first.path(blocks[0].key) + ".999.tmp")  # a crashed write
    stale.write_bytes(b"x")
    os.utime(stale, (1.0e9, 1.0e9))
    in_progress = Path(first.path(blocks[1].key) + ".998.tmp")  # another process's write
    in_progress.write_bytes(b"x")
    orphan_pin = Path(first.path(make_blocks(1, seed=21)[0].key)).with_suffix(".pin")
    orphan_pin.parent.mkdir(exist_ok=True)
    orphan_pin.write_text(repr(until))

    second = open_store(tmp_path)
    assert not stale.exists() and in_progress.exists()
    after = second.stats()
    assert (after.entries, after.bytes, after.pinned_entries) == (4, before.bytes, 1)
    assert second.pinned_until(blocks[2].key) == until
    assert second.pinned_until(blocks[0].key) == -math.inf
    assert all(reads_back(second, block) for block in blocks)

    # Another model's entries live beside these, unseen, and do not displace them.
    other_fingerprint = dataclasses.replace(FINGERPRINT, dtype="bfloat16")
    other = open_store(tmp_path, fingerprint=other_fingerprint)
    assert other.dir != second.dir
    assert other.stats().entries == 0
    assert not any(other.contains(block.key) for block in blocks)
    for block in make_blocks(2, seed=3, fingerprint=other_fingerprint):
        put(other, block)
    assert other.flush(10)
    assert other.stats().entries == 2
    assert len(entry_files(second)) == 4
    third = open_store(tmp_path)
    assert third.stats().entries == 4


def test_restart_keeps_the_lru_order_of_the_files_mtimes(tmp_path: Path, open_store) -> None:
    capacity = 12 * make_blocks(1, seed=0)[0].file_bytes
    held = steady_entries(tmp_path / "probe", capacity, open_store)
    assert held >= 4
    tier = tmp_path / "tier"
    old = make_blocks(held, seed=4)
    first = open_store(tier, capacity_bytes=capacity)
    for block in old:
        put_flushed(first, block)
    assert set(entry_files(first)) == {b.key for b in old}
    first.close()

    # An order unlike the write order and the names' order.
    order = [old[i] for i in np.random.default_rng(5).permutation(held)]
    for age, block in enumerate(order):
        os.utime(first.path(block.key), (1.0e9 + age, 1.0e9 + age))
    reader = open_store(tier, capacity_bytes=capacity)
    assert reads_back(reader, order[0])  # the oldest, now the most recently used
    reader.close()

    last = open_store(tier, capacity_bytes=capacity)
    evicted = []
    for block in make_blocks(held, seed=6):
        kept = set(entry_files(last))
        put_flushed(last, block)
        gone = kept - set(entry_files(last))
        assert len(gone) == 1
        evicted.append(gone.pop())
    assert evicted == [b.key for b in order[1:] + order[:1]]


# ----- capacity -----


@pytest.mark.parametrize("shape", [SHAPE, LONG_SHAPE], ids=["short-blocks", "long-blocks"])
def test_disk_usage_never_exceeds_the_capacity(tmp_path: Path, open_store,
                                               shape: tuple[int, ...]) -> None:
    fingerprint = dataclasses.replace(FINGERPRINT, block_tokens=shape[3])
    blocks = make_blocks(12, seed=7, shape=shape, fingerprint=fingerprint)
    size = blocks[0].file_bytes
    for step, fraction in enumerate((0.0, 0.2, 0.4, 0.6, 0.8, 0.99)):
        capacity = int((10 + fraction) * size)
        store = open_store(tmp_path / str(step), capacity_bytes=capacity,
                           fingerprint=fingerprint)
        for block in blocks:
            put_flushed(store, block)
            on_disk = sum(entry_files(store).values())
            assert on_disk <= capacity, (capacity, on_disk)
            assert store.stats().bytes == on_disk
        assert store.stats().entries >= 1


def test_eviction_is_least_recently_used(tmp_path: Path, open_store) -> None:
    capacity = 12 * make_blocks(1, seed=0)[0].file_bytes
    held = steady_entries(tmp_path / "probe", capacity, open_store)
    assert held >= 3
    store = open_store(tmp_path / "tier", capacity_bytes=capacity)
    model: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
    rng = np.random.default_rng(8)
    fresh = iter(make_blocks(60, seed=9))
    for _ in range(80):
        if model and rng.random() < 0.4:
            key = list(model)[int(rng.integers(len(model)))]
            assert reads_back(store, model[key])
            model.move_to_end(key)
        else:
            block = next(fresh)
            put_flushed(store, block)
            if len(model) == held:
                model.popitem(last=False)
            model[block.key] = block
        assert set(entry_files(store)) == set(model)
        assert sum(entry_files(store).values()) <= capacity


def test_pinned_entries_go_last_until_their_pin_expires(tmp_path: Path, open_store) -> None:
    clock = FakeClock(1.0e9)
    capacity = 12 * make_blocks(1, seed=0)[0].file_bytes
    held = steady_entries(tmp_path / "probe", capacity, open_store)
    store = open_store(tmp_path / "tier", capacity_bytes=capacity, wall_clock=clock)
    pinned, *others = make_blocks(held + 4, seed=10)
    put(store, pinned)
    store.pin([pinned.key], clock.now + 100)
    store.pin([pinned.key], clock.now + 50)  # extends, never shortens
    assert store.flush(10)
    assert store.pinned_until(pinned.key) == clock.now + 100

    for i, block in enumerate(others):
        put_flushed(store, block)
        expected = {pinned.key} | {b.key for b in others[max(0, i + 2 - held) : i + 1]}
        assert set(entry_files(store)) == expected
    assert store.stats().pinned_entries == 1

    clock.now += 101  # the pin has expired: the oldest entry is evicted like any other
    assert store.pinned_until(pinned.key) == -math.inf
    assert store.stats().pinned_entries == 0
    newest = make_blocks(1, seed=11)[0]
    put_flushed(store, newest)
    assert set(entry_files(store)) == {b.key for b in others[-(held - 1) :]} | {newest.key}


def test_when_every_entry_is_pinned_capacity_still_wins(tmp_path: Path, open_store) -> None:
    capacity = 12 * make_blocks(1, seed=0)[0].file_bytes
    held = steady_entries(tmp_path / "probe", capacity, open_store)
    store = open_store(tmp_path / "tier", capacity_bytes=capacity)
    blocks = make_blocks(held + 1, seed=12)
    for block in blocks[:held]:
        put_flushed(store, block)
    store.pin([b.key for b in blocks[:held]], time.time() + 3600)
    put_flushed(store, blocks[held])
    assert set(entry_files(store)) == {b.key for b in blocks[1:]}  # the oldest pinned went
    assert sum(entry_files(store).values()) <= capacity


def test_a_put_larger_than_the_capacity_is_not_written(tmp_path: Path, open_store) -> None:
    small = make_blocks(2, seed=13)
    huge = make_blocks(1, seed=14, shape=BIG_SHAPE)[0]
    capacity = huge.nbytes // 2
    store = open_store(tmp_path, capacity_bytes=capacity)
    for block in small:
        put_flushed(store, block)
    written = store.stats().counters.bytes_written
    put_flushed(store, huge)
    assert not store.contains(huge.key)
    assert set(entry_files(store)) == {b.key for b in small}  # and nothing was evicted for it
    assert store.stats().counters.bytes_written == written


# ----- the write queue -----


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_writer_runs_below_the_engine(tmp_path: Path, open_store) -> None:
    # SCHED_IDLE: the writer only takes a core nothing else wants (a slice taken from one of
    # the engine's torch threads would stall both at the next barrier).
    store = open_store(tmp_path)
    put_flushed(store, make_blocks(1, seed=3)[0])  # the writer thread has started and written
    writer = store._writer
    assert writer.is_alive() and writer.native_id is not None
    assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE


def test_a_full_queue_drops_unforced_writes_only(tmp_path: Path, open_store) -> None:
    blocks = make_blocks(5, seed=15)
    size = blocks[0].nbytes
    store = open_store(tmp_path, queue_bytes=2 * size)
    gate = threading.Event()

    def held_payload() -> memoryview:
        gate.wait(10)  # the writer is stuck on this block until the test lets it go
        return memoryview(blocks[0].payload)

    try:
        assert put(store, blocks[0], payload=held_payload)
        assert put(store, blocks[1])
        assert not store.has_room(size)
        assert not put(store, blocks[2])
        assert not put(store, blocks[3])
        assert store.stats().counters.dropped_writes == 2
        assert put(store, blocks[4], forced=True)  # a pinned prefix: queued beyond the bound
        assert not store.flush(0.05)
    finally:
        gate.set()
    assert store.flush(10)
    written = {b.key for b in (blocks[0], blocks[1], blocks[4])}
    assert set(entry_files(store)) == written
    assert not store.contains(blocks[2].key) and not store.contains(blocks[3].key)
    assert store.has_room(2 * size)
    assert store.stats().counters.dropped_writes == 2


# ----- damaged entries -----


def _flip(offset_from: Callable[[int, int], int]) -> Callable[[Path, Path, Block], None]:
    def damage(path: Path, other: Path, block: Block) -> None:
        data = bytearray(path.read_bytes())
        offset = offset_from(len(data), len(block.header.encode()))
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
    return damage


def _truncate(keep: Callable[[int], int]) -> Callable[[Path, Path, Block], None]:
    def damage(path: Path, other: Path, block: Block) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: keep(len(data))])
    return damage


DAMAGES = {
    # name: (damage(path, another entry's path, block), the kind a read reports)
    "payload-byte": (_flip(lambda size, head: size - 8 - 100), "corrupt"),
    "checksum-byte": (_flip(lambda size, head: size - 1), "corrupt"),
    "magic-byte": (_flip(lambda size, head: 0), "corrupt"),
    "header-json": (_flip(lambda size, head: 12), "corrupt"),  # '{' -> 'z'
    "header-key": (_flip(lambda size, head: 12 + 10), "corrupt"),  # still JSON: the checksum says
    "truncated-by-one": (_truncate(lambda size: size - 1), "truncated"),
    "truncated-in-header": (_truncate(lambda size: 40), "truncated"),
    "truncated-to-nothing": (_truncate(lambda size: 0), "truncated"),
    "garbage-appended": (lambda path, other, block: path.write_bytes(path.read_bytes() + b"xx"),
                         "corrupt"),
    "another-entry": (lambda path, other, block: shutil.copyfile(other, path), "foreign"),
    "deleted": (lambda path, other, block: path.unlink(), "missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_entry_is_refused_counted_and_forgotten(tmp_path: Path, open_store,
                                                         damage: str) -> None:
    make_damage, kind = DAMAGES[damage]
    store = open_store(tmp_path)
    target, bystander = make_blocks(2, seed=16)
    for block in (target, bystander):
        put(store, block)
    store.pin([target.key], time.time() + 3600)
    assert store.flush(10)
    path = Path(store.path(target.key))
    pin_path = path.with_suffix(".pin")
    assert pin_path.exists()
    make_damage(path, Path(store.path(bystander.key)), target)

    with pytest.raises(EntryError) as refused:
        store.read(target.key)
    assert refused.value.kind == kind
    stats = store.stats()
    assert stats.counters.errors == {k: int(k == kind) for k in ERROR_KINDS}
    assert (stats.entries, stats.bytes, stats.pinned_entries) == (1, bystander.file_bytes, 0)
    assert not path.exists()
    assert not pin_path.exists()  # a bad or vanished entry's pin goes too
    assert not store.contains(target.key)
    assert reads_back(store, bystander)
    # Written again, it is whole again.
    put_flushed(store, target)
    assert reads_back(store, target)


# ----- directories shared, read-only, full -----


ROUNDS = 10


def share_directory_worker(root: str, index: int, barrier, results) -> None:
    """One of two processes on one directory: every round both write the same new blocks at
    once (plus small blocks of their own), reading the shared ones while they are written."""
    store = TierStore(root, FINGERPRINT, 1 << 30, 1 << 30)
    problems: list[str] = []

    def check(block: Block) -> None:
        try:
            if not reads_back(store, block):
                problems.append(f"{block.key.hex()}: different bytes")
        except EntryError as exc:
            problems.append(f"{block.key.hex()}: {exc.kind}: {exc}")

    for round_ in range(ROUNDS):
        shared = make_blocks(8, seed=1000 + round_, shape=BIG_SHAPE)
        own = make_blocks(8, seed=2000 + 100 * index + round_)
        barrier.wait(60)
        for block in shared + own:
            put(store, block)
        while not store.flush(0.001):
            for block in shared:
                if os.path.exists(store.path(block.key)):
                    check(block)  # whoever wrote it, it is whole
        for block in shared + own:
            check(block)
    barrier.wait(60)
    entries = store.stats().entries
    theirs = [b for r in range(ROUNDS) for b in make_blocks(8, seed=2000 + 100 * (1 - index) + r)]
    seen = sum(store.contains(b.key) for b in theirs)
    adopted = store.stats().entries - entries
    for block in theirs:
        check(block)
    store.close()
    results.put((index, problems, seen, adopted))


def test_two_processes_share_one_directory(tmp_path: Path, open_store) -> None:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=share_directory_worker,
                               args=(str(tmp_path), index, barrier, results))
               for index in range(2)]
    for worker in workers:
        worker.start()
    try:
        reports = sorted(results.get(timeout=90) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    assert [w.exitcode for w in workers] == [0, 0]
    theirs = 8 * ROUNDS
    assert reports == [(0, [], theirs, theirs), (1, [], theirs, theirs)]

    store = open_store(tmp_path)
    every = [b for r in range(ROUNDS) for b in (make_blocks(8, seed=1000 + r, shape=BIG_SHAPE)
                                                 + make_blocks(8, seed=2000 + r)
                                                 + make_blocks(8, seed=2100 + r))]
    assert store.stats().entries == len(every) == 3 * 8 * ROUNDS
    assert all(reads_back(store, block) for block in every)
    assert not temp_files(store)


@contextlib.contextmanager
def read_only(root: Path) -> Iterator[Path]:
    """A read-only view of `root`: a read-only bind mount for root (whom permissions do not
    stop), the directories' permissions otherwise."""
    if os.geteuid() == 0:
        view = root.with_name(root.name + "-ro")
        view.mkdir()
        why = run_command("mount", "--bind", str(root), str(view))
        if why:
            pytest.skip(f"running as root and cannot bind-mount ({why}): no read-only directory")
        try:
            why = run_command("mount", "-o", "remount,bind,ro", str(view))
            if why:
                pytest.skip(f"running as root and cannot remount read-only ({why})")
            yield view
        finally:
            run_command("umount", str(view))
        return
    directories = [root] + [p for p in root.rglob("*") if p.is_dir()]
    for directory in directories:
        directory.chmod(0o555)
    try:
        try:
            (root / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("permissions do not stop this user from writing: no read-only directory")
        yield root
    finally:
        for directory in directories:
            directory.chmod(0o755)


def test_a_read_only_directory_is_read_and_never_written(tmp_path: Path, open_store,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "tier"
    blocks = make_blocks(6, seed=17)
    writer = open_store(root)
    for block in blocks[:3]:
        put(writer, block)
    assert writer.flush(10)
    writer.close()

    with read_only(root) as view:
        caplog.set_level(logging.WARNING, logger=STORE_LOGGER)
        before = sorted(p.relative_to(view) for p in view.rglob("*"))
        store = open_store(view)
        assert not store.writable and not store.stats().writable
        assert not store.has_room(1)
        for block in blocks[3:] * 4:
            assert not put(store, block)
            assert not put(store, block, forced=True)
        store.pin([b.key for b in blocks], time.time() + 60)
        assert store.flush(10)
        assert all(reads_back(store, block) for block in blocks[:3])
        assert not any(store.contains(block.key) for block in blocks[3:])
        assert sorted(p.relative_to(view) for p in view.rglob("*")) == before
        assert store.stats().counters.errors["write"] == 0
        warnings = [r for r in caplog.records if r.name == STORE_LOGGER]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert "takes no writes" in warnings[0].getMessage()
        store.close()


class _LogCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.levels: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.levels.append(record.levelno)


def fill_the_disk(root: str) -> dict[str, object]:
    """Queues small blocks, then big ones past what the filesystem takes, each followed by a
    pin of the prefix so far (as the engine queues a pinned request): what the store did.
    Runs here or in a process with a file-size limit, so it reports rather than asserts."""
    counter = _LogCounter()
    logging.getLogger(STORE_LOGGER).addHandler(counter)
    try:
        store = TierStore(root, FINGERPRINT, 1 << 30, 1 << 30)
        small = make_blocks(4, seed=18)
        big = make_blocks(32, seed=19, shape=BIG_SHAPE)
        blocks = small + big
        for i, block in enumerate(blocks):
            put(store, block)
            store.pin([b.key for b in blocks[: i + 1]], time.time() + 60)
        flushed = store.flush(10)
        refused = not put(store, make_blocks(1, seed=20)[0], forced=True)
        kept = [b for b in blocks if store.contains(b.key)]
        report = {
            "writable": store.writable,
            "warnings": counter.levels.count(logging.WARNING),
            "worse": sum(level > logging.WARNING for level in counter.levels),
            "write_errors": store.stats().counters.errors["write"],
            "small_kept": sum(b in kept for b in small),
            "big_kept": sum(b in kept for b in big),
            "read_back": all(reads_back(store, block) for block in kept),
            "refused_at_the_end": refused,
            "flushed": flushed,
            "writer_alive": store._writer.is_alive(),
            "entries_match_files": store.stats().entries == len(entry_files(store)),
            "temp_files": len(temp_files(store)),
        }
        store.close()
        return report
    finally:
        logging.getLogger(STORE_LOGGER).removeHandler(counter)


_FILE_SIZE_LIMIT_SCRIPT = """
import json, resource, signal, sys
from test_kv_tier_store import fill_the_disk
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
print(json.dumps(fill_the_disk(sys.argv[1])))
"""


@pytest.mark.parametrize("how", ["small-tmpfs", "file-size-limit"])
def test_a_full_disk_stops_writes_and_keeps_reads(tmp_path: Path, how: str) -> None:
    root = tmp_path / "tier"
    root.mkdir()
    if how == "small-tmpfs":
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root (the file-size-limit case runs)")
        why = run_command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root))
        if why:
            pytest.skip(f"cannot mount a small tmpfs ({why})")
        try:
            report = fill_the_disk(str(root))
        finally:
            run_command("umount", str(root))
    else:
        pytest.importorskip("resource", reason="no RLIMIT_FSIZE on this platform")
        done = subprocess.run(
            [sys.executable, "-c", _FILE_SIZE_LIMIT_SCRIPT, str(root)], capture_output=True,
            text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
    assert report["write_errors"] >= 1
    assert report == {
        "writable": False, "warnings": 1, "worse": 0, "write_errors": report["write_errors"],
        "small_kept": 4, "big_kept": report["big_kept"], "read_back": True,
        "refused_at_the_end": True, "flushed": True, "writer_alive": True,
        "entries_match_files": True, "temp_files": 0,
    }
    # 1 MiB holds some 64 KiB entries before it is full; 16 KiB per file holds none.
    assert (report["big_kept"] > 0) == (how == "small-tmpfs")


def test_read_into_caller_buffers_checks_like_a_plain_read(tmp_path: Path, open_store) -> None:
    # The engine reads a block straight into the KV pool's memory, one buffer per run: in
    # more pieces than one preadv call takes, and a damaged file must still be refused.
    store = open_store(tmp_path)
    block = make_blocks(1, seed=77)[0]
    put(store, block)
    assert store.flush(10)
    size = len(block.payload)
    pieces = 700  # more than the 512 buffers one call is given
    cuts = sorted({0, size, *(size * i // pieces for i in range(1, pieces))})
    targets = [memoryview(bytearray(b - a)) for a, b in zip(cuts, cuts[1:], strict=False)]
    header, payload = store.read(block.key, into=lambda header: targets)
    assert payload is None and header.key == block.key.hex()
    assert b"".join(bytes(t) for t in targets) == bytes(block.payload)
    path = Path(store.path(block.key))
    data = bytearray(path.read_bytes())
    data[-10] ^= 1  # in the payload's last bytes
    path.write_bytes(bytes(data))
    with pytest.raises(EntryError) as refused:
        store.read(block.key, into=lambda header: targets)
    assert refused.value.kind == "corrupt"


def test_longrope_served_at_two_context_lengths_has_two_fingerprints() -> None:
    # LongRoPE picks its long factors when the engine's context exceeds the pretraining length
    # (4,096 here): the same file rotates a prefix's keys two ways, which must not share
    # entries. Any other rotary setting that changes the angles changes the identity too.
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 4096,
               "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}
    rope = RopeConfig(10000.0, scaling)
    short = rotary_identity([rope_table(rope, 8, 4096)])
    assert rotary_identity([rope_table(rope, 8, 4096)]) == short  # stable
    assert rotary_identity([rope_table(rope, 8, 131072)]) != short
    assert rotary_identity([rope_table(RopeConfig(10000.0, None), 8, 4096)]) != short
    assert rotary_identity([rope_table(RopeConfig(500000.0, None), 8, 4096)]) != rotary_identity(
        [rope_table(RopeConfig(10000.0, None), 8, 4096)])
