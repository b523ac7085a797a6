"""KV cache events without a model: the block hash (stable, namespaced, chained, as documented),
the msgpack wire form (vLLM's shape), the recorder against the radix tree it watches (a
hypothesis state machine: the events, applied in order, always spell exactly the tree's
blocks), the index a router reads, and the ZMQ publisher and subscriber over TCP (order,
replay, gaps, duplicates, restarts)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable

import msgpack
import pytest
import zmq
from hypothesis import settings
from hypothesis.stateful import invariant
from test_radix_cache import MACHINE_SETTINGS, PrefixCacheMachine

from radixserve.cache import PrefixCache, RadixCache
from radixserve.config import EngineConfig
from radixserve.engine.kv_pool import PageAllocator
from radixserve.kv_events import (
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    KVEventRecorder,
    KVEventSubscriber,
    block_hashes,
    decode_batch,
    encode_batch,
)
from radixserve.kv_events.publisher import END_SEQ
from radixserve.sequences import namespace_bytes

NAMESPACES: list[Hashable] = [None, "", "salt", ("salt",), ("tenant", "ab12", None),
                              ("tenant", "ab12", "salt")]
TOKENS = list(range(1000, 1050))


# ----- the hash -----


def _recipe(tokens: list[int], namespace_json: bytes, size: int) -> list[int]:
    """The module docstring's recipe, written out again from its text."""
    root = hashlib.blake2b(b"radixserve-kv-events-v1" + namespace_json, digest_size=8).digest()
    previous, out = int.from_bytes(root, "big"), []
    for at in range(0, len(tokens) - size + 1, size):
        data = previous.to_bytes(8, "big") + b"".join(
            t.to_bytes(4, "little") for t in tokens[at : at + size])
        previous = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
        out.append(previous)
    return out


def test_hash_follows_the_documented_recipe() -> None:
    assert block_hashes(TOKENS, None, 16) == _recipe(TOKENS, b"", 16)
    assert block_hashes(TOKENS, "salt", 16) == _recipe(TOKENS, b'"salt"', 16)
    assert block_hashes(TOKENS, ("tenant", "ab12", None), 7) == _recipe(
        TOKENS, b'["tenant","ab12",null]', 7)
    assert namespace_bytes(("tenant", "é", None)) == json.dumps(
        ["tenant", "é", None], separators=(",", ":")).encode()
    assert all(0 <= h < 2**64 for h in block_hashes(TOKENS, "salt", 1))


def test_hash_is_the_same_whatever_the_hash_seed() -> None:
    script = ("import json; from radixserve.kv_events import block_hashes; "
              f"print(json.dumps([block_hashes({TOKENS!r}, ns, 8) for ns in {NAMESPACES!r}]))")
    runs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, check=True)
        runs.append(json.loads(done.stdout))
    here = [block_hashes(TOKENS, ns, 8) for ns in NAMESPACES]
    assert runs[0] == runs[1] == here


def test_namespaces_never_share_a_hash() -> None:
    firsts = {block_hashes(TOKENS, ns, 16)[0] for ns in NAMESPACES}
    assert len(firsts) == len(NAMESPACES)


def test_hashes_chain() -> None:
    full = block_hashes(TOKENS, "salt", 8)
    assert len(full) == len(TOKENS) // 8  # the partial tail has no hash
    assert block_hashes(TOKENS[:20], "salt", 8) == full[:2]  # a prefix's hashes are a prefix
    assert block_hashes(TOKENS, "salt", 8, start_block=3, parent=full[2]) == full[3:]
    changed = TOKENS[:]
    changed[35] += 1  # block 4: it and every later block change, earlier ones do not
    other = block_hashes(changed, "salt", 8)
    assert other[:4] == full[:4]
    assert all(a != b for a, b in zip(other[4:], full[4:], strict=True))
    assert block_hashes(TOKENS[:7], None, 8) == []
    with pytest.raises(ValueError, match="parent"):
        block_hashes(TOKENS, None, 8, start_block=1)


# ----- the wire form -----


def _sample_batch() -> EventBatch:
    return EventBatch(1234.5, [
        AllBlocksCleared(),
        BlockStored([1, 2**64 - 1], None, list(range(8)), 4, medium="GPU",
                    extra_keys=[('"salt"',), ('"salt"',)]),
        BlockStored([3], 2**64 - 1, [9, 9, 9, 9], 4),
        BlockRemoved([1, 3], medium="GPU"),
    ], data_parallel_rank=2)


def test_batch_round_trips() -> None:
    batch = _sample_batch()
    assert decode_batch(encode_batch(batch)) == batch
    bare = EventBatch(1.0, [AllBlocksCleared()])
    assert decode_batch(encode_batch(bare)) == bare


def test_wire_form_is_vllms() -> None:
    """A positional batch of tagged maps with vLLM's field names (vLLM >= 0.26)."""
    ts, events, rank = msgpack.unpackb(encode_batch(_sample_batch()))
    assert (ts, rank) == (1234.5, 2)
    assert events[0] == {"type": "AllBlocksCleared"}
    assert events[1] == {"type": "BlockStored", "block_hashes": [1, 2**64 - 1],
                         "parent_block_hash": None, "token_ids": list(range(8)),
                         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
                         "extra_keys": [['"salt"'], ['"salt"']]}
    assert "extra_keys" not in events[2]  # left off when unset, as msgspec's omit_defaults does
    assert events[3] == {"type": "BlockRemoved", "block_hashes": [1, 3], "medium": "GPU"}
    assert len(msgpack.unpackb(encode_batch(EventBatch(1.0, [])))) == 2  # no rank: left off


def test_older_forms_decode() -> None:
    """Tagged arrays (vLLM before 0.26), a batch as a map, and fields we do not know."""
    legacy = msgpack.packb([2.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU"],
                                  ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]]])
    assert decode_batch(legacy).events == [
        BlockStored([5], None, [1, 2], 2, medium="GPU"), BlockRemoved([5], medium="GPU"),
        AllBlocksCleared()]
    as_map = msgpack.packb({"ts": 3.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockRemoved", "block_hashes": [7], "medium": None, "group_idx": 0}]})
    assert decode_batch(as_map) == EventBatch(3.0, [BlockRemoved([7], medium=None)], 0)
    for bad in (b"\xc1", msgpack.packb([1.0]), msgpack.packb([1.0, [{"type": "Nope"}]])):
        with pytest.raises(ValueError):
            decode_batch(bad)


# ----- the recorder against the radix tree -----


def tree_blocks(cache: RadixCache, block_size: int) -> list[int]:
    """Every full block on a root-to-node path of the tree, hashed from the tree's tokens."""
    hashes: list[int] = []
    stack = [(key[0], (), node) for key, node in cache._root.children.items()]
    while stack:
        namespace, prefix, node = stack.pop()
        path = prefix + node.key
        start = len(prefix) // block_size  # blocks ending inside this node's edge
        hashes += block_hashes(path, namespace, block_size)[start:]
        stack.extend((namespace, path, child) for child in node.children.values())
    return hashes


class RecordedRadixMachine(PrefixCacheMachine):
    """The radix cache's state machine with a recorder attached: after every step, the events
    drained so far, sent through the wire form and applied to an index, hold exactly the
    tree's blocks (and the tree never spells one block hash twice)."""

    def make_cache(self, page_size: int, max_pinned: int | None) -> PrefixCache:
        # Blocks of two pages: edges then often end mid-block, the case the recorder must get
        # right (a straddling block is new on insert and gone on eviction).
        self.recorder = KVEventRecorder(2 * page_size, "GPU")
        self.index = BlockIndex()
        return RadixCache(page_size, self._release, clock=self.clock,
                          max_pinned_tokens=max_pinned, observer=self.recorder)

    @invariant()
    def events_spell_the_tree(self) -> None:
        batch = decode_batch(encode_batch(EventBatch(0.0, self.recorder.drain())))
        self.index.apply("replica", batch)
        expected = tree_blocks(self.cache, self.recorder.block_size)
        assert len(expected) == len(set(expected))
        held = {h for h in expected if self.index.holds("replica", h)}
        assert held == set(expected) and self.index.block_count("replica") == len(expected)


TestRecordedRadixMachine = RecordedRadixMachine.TestCase
TestRecordedRadixMachine.settings = settings(MACHINE_SETTINGS, max_examples=100)


def test_recorder_events_one_by_one() -> None:
    pool = PageAllocator(64, 1)
    recorder = KVEventRecorder(4, "CPU")
    cache = RadixCache(1, pool.release, observer=recorder)
    tokens = list(range(10))
    cache.insert("a", tokens, pool.allocate(10))
    assert recorder.drain() == [BlockStored(block_hashes(tokens, "a", 4), None, tokens[:8], 4,
                                            extra_keys=[('"a"',)] * 2)]
    branch = tokens[:6] + [99, 98, 97]  # splits the edge inside block 1
    cache.insert("a", branch, pool.allocate(9))
    parent = block_hashes(tokens, "a", 4)[0]
    assert recorder.drain() == [BlockStored(block_hashes(branch, "a", 4)[1:], parent,
                                            branch[4:8], 4, extra_keys=[('"a"',)])]
    cache.insert(None, [7, 7, 7], pool.allocate(3))
    assert recorder.drain() == []  # no full block
    cache.insert(None, [7] * 5, cache.match_prefix(None, [7] * 3).slots + pool.allocate(2))
    assert [e.block_hashes for e in recorder.drain()] == [block_hashes([7] * 5, None, 4)]
    cache.evict(3)  # the least recently used leaf: tokens 6..9 of the first insert
    assert recorder.drain() == [BlockRemoved([block_hashes(tokens, "a", 4)[1]])]
    handle = cache.match_prefix("a", branch).handle
    cache.lock(handle)
    cache.reset()  # the locked path stays: evictions, not a clear
    assert recorder.drain() == [BlockRemoved(block_hashes([7] * 5, None, 4))]
    cache.unlock(handle)
    cache.insert(None, [1, 2, 3, 4], pool.allocate(4))
    cache.reset()
    assert recorder.drain() == [AllBlocksCleared()]  # what came before no longer matters


def test_recorder_merges_one_chain_grown_twice() -> None:
    pool = PageAllocator(64, 1)
    recorder = KVEventRecorder(2)
    cache = RadixCache(1, pool.release, observer=recorder)
    tokens = list(range(12))
    cache.insert(None, tokens[:5], pool.allocate(5))  # a prefill chunk, then the next one
    slots = cache.match_prefix(None, tokens[:4]).slots
    cache.insert(None, tokens, slots + pool.allocate(8))
    (event,) = recorder.drain()
    assert event == BlockStored(block_hashes(tokens, None, 2), None, tokens, 2)


def test_kv_events_config_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_events_endpoint needs prefix_cache='radix'"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", prefix_cache="hash")
    with pytest.raises(ValueError, match="multiple of page_size"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", page_size=4, kv_events_block_size=6)
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        EngineConfig(kv_events_endpoint="5557")
    EngineConfig(page_size=32)  # the block size only matters when events are on


# ----- the index -----


def test_index_prefix_lengths() -> None:
    index = BlockIndex()
    index.apply("a", EventBatch(0.0, [BlockStored([1, 2, 3], None, [], 1)]))
    index.apply("b", EventBatch(0.0, [BlockStored([1, 2], None, [], 1), BlockStored([9], 2, [], 1)]))
    index.apply("c", EventBatch(0.0, [BlockStored([7], None, [], 1)]))
    assert index.prefix_lengths([1, 2, 3, 4]) == {"a": 3, "b": 2, "c": 0}
    assert index.prefix_lengths([5]) == {"a": 0, "b": 0, "c": 0}
    index.apply("a", EventBatch(0.0, [BlockRemoved([2])]))
    assert index.prefix_lengths([1, 2, 3]) == {"a": 1, "b": 2, "c": 0}  # a prefix, no holes
    index.apply("b", EventBatch(0.0, [AllBlocksCleared(), BlockStored([1], None, [], 1)]))
    assert index.prefix_lengths([1, 2]) == {"a": 1, "b": 1, "c": 0}
    index.drop("c")
    assert sorted(index.sources()) == ["a", "b"]
    assert index.holds("a", 3) and not index.holds("a", 2) and not index.holds("zz", 1)


# ----- publisher and subscriber over TCP -----


class Collected:
    """What a subscriber delivered, with a wait for a given count."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, EventBatch]] = []
        self._changed = threading.Condition()

    def __call__(self, seq: int, batch: EventBatch) -> None:
        with self._changed:
            self.batches.append((seq, batch))
            self._changed.notify_all()

    def wait_for(self, done: Callable[[list[tuple[int, EventBatch]]], bool],
                 timeout: float = 10.0) -> list[tuple[int, EventBatch]]:
        with self._changed:
            assert self._changed.wait_for(lambda: done(self.batches), timeout), self.batches
            return list(self.batches)


def _removed(n: int) -> list[BlockRemoved]:
    return [BlockRemoved([n])]


def test_subscriber_gets_every_batch_in_order() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    got = Collected()
    subscriber = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, got, topic="kv")
    try:
        for n in range(1, 51):
            publisher.publish(_removed(n))
        batches = got.wait_for(lambda b: len(b) >= 51)
        assert [seq for seq, _ in batches] == list(range(51))  # nothing twice, nothing lost
        assert batches[0][1].events == [AllBlocksCleared()]
        assert [b.events for _, b in batches[1:]] == [_removed(n) for n in range(1, 51)]
        assert subscriber.last_seq == 50
    finally:
        subscriber.close()
        publisher.close()


def test_late_subscriber_catches_up_by_replay() -> None:
    """A router that starts beside an idle replica learns everything from seq 0."""
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=100)
    try:
        for n in range(1, 6):
            publisher.publish(_removed(n))
        time.sleep(0.2)  # sent to nobody
        got = Collected()
        subscriber = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, got)
        try:
            batches = got.wait_for(lambda b: len(b) >= 6)
            assert [seq for seq, _ in batches] == list(range(6))
            publisher.publish(_removed(6))
            assert got.wait_for(lambda b: len(b) >= 7)[-1][1].events == _removed(6)
        finally:
            subscriber.close()
    finally:
        publisher.close()


def test_subscriber_skips_what_the_replica_no_longer_buffers() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=3)
    try:
        for n in range(1, 10):  # seqs 0..9; 7, 8, 9 stay buffered
            publisher.publish(_removed(n))
        time.sleep(0.2)
        got = Collected()
        subscriber = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, got)
        try:
            assert [seq for seq, _ in got.wait_for(lambda b: len(b) >= 3)] == [7, 8, 9]
            publisher.publish(_removed(10))
            assert [seq for seq, _ in got.wait_for(lambda b: len(b) >= 4)] == [7, 8, 9, 10]
        finally:
            subscriber.close()
    finally:
        publisher.close()


def test_replay_framing_and_end_marker() -> None:
    """vLLM's replay protocol, spoken with raw ZMQ: [topic, seq, payload] per buffered batch
    from the start seq on, then [b"", -1, b""]; only the last buffer_steps batches are kept."""
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="t",
                                 buffer_steps=4)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        for n in range(1, 7):  # seqs 1..6 after the AllBlocksCleared at 0: 3..6 stay buffered
            publisher.publish(_removed(n))
        time.sleep(0.2)
        dealer.connect(publisher.replay_endpoint)
        for start, seqs in ((5, [5, 6]), (0, [3, 4, 5, 6]), (7, [])):
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replies = []
            while True:
                assert dealer.poll(5000)
                replies.append(dealer.recv_multipart())
                if replies[-1][-1] == b"":
                    break
            assert replies[-1] == [b"", b"", END_SEQ, b""]
            assert [r[1] for r in replies[:-1]] == [b"t"] * len(seqs)
            assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == seqs
            assert [decode_batch(r[3]).events for r in replies[:-1]] == [_removed(s) for s in seqs]
    finally:
        dealer.close(linger=0)
        context.term()
        publisher.close()


class FakePublisher:
    """A publisher under the test's control: it sends live only what it is told to, and
    answers replay requests from everything it published (as vLLM frames both)."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sent: dict[int, bytes] = {}
        self.replay_requests: list[int] = []

    def publish(self, seq: int, live: bool = True, run: int = 0) -> None:
        self.sent[seq] = encode_batch(EventBatch(float(seq), _removed(run + seq)))
        if live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.sent[seq]])

    def serve_replays(self, seconds: float, until_requests: int = 0) -> None:
        """Answers replay requests for `seconds`, or until `until_requests` were answered."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(self.replay_requests) < (until_requests
                                                                            or sys.maxsize):
            if not self.router.poll(20):
                continue
            identity, *_, start_bytes = self.router.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            for seq in sorted(s for s in self.sent if s >= start):
                self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"),
                                            self.sent[seq]])
            self.router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.context.term()


def test_gap_is_filled_by_replay_and_duplicates_dropped() -> None:
    fake = FakePublisher()
    got = Collected()
    subscriber = KVEventSubscriber(fake.endpoint, fake.replay_endpoint, got)
    try:
        fake.serve_replays(5.0, until_requests=1)  # its first request, from 0: nothing yet
        time.sleep(0.3)  # the SUB socket connects too
        fake.publish(0, live=False)  # missed live before the subscriber joined
        fake.publish(1)
        fake.publish(2, live=False)  # lost live
        fake.publish(3, live=False)
        fake.publish(4)
        fake.serve_replays(1.0)
        batches = got.wait_for(lambda b: len(b) >= 5)
        assert [seq for seq, _ in batches] == [0, 1, 2, 3, 4]
        assert [b.events for _, b in batches] == [_removed(s) for s in range(5)]
        assert fake.replay_requests[:2] == [0, 0]  # at start, then for the gap before 1
        fake.publish(5)
        fake.serve_replays(0.2)
        assert [seq for seq, _ in got.wait_for(lambda b: len(b) >= 6)] == list(range(6))
    finally:
        subscriber.close()
        fake.close()


def test_replay_overlap_reveals_a_restart() -> None:
    """A restarted publisher whose first live batch looks like the old run's future: the
    replay, asked from the last delivered seq, shows other bytes under that seq."""
    fake = FakePublisher()
    got = Collected()
    subscriber = KVEventSubscriber(fake.endpoint, fake.replay_endpoint, got)
    try:
        for seq in range(6):
            fake.publish(seq, live=False)
        fake.serve_replays(5.0, until_requests=1)
        got.wait_for(lambda b: len(b) >= 6)
        time.sleep(0.3)  # the SUB socket connects too
        fake.sent = {}
        for seq in range(9):  # the new run, seen live only from seq 8
            fake.publish(seq, live=seq == 8, run=100)
        fake.serve_replays(2.0, until_requests=3)  # from 5 (shows the restart), then from 0
        batches = got.wait_for(lambda b: len(b) >= 15)
        assert [seq for seq, _ in batches] == [*range(6), *range(9)]
        assert [b.events for _, b in batches[6:]] == [_removed(100 + s) for s in range(9)]
        assert fake.replay_requests[1:3] == [5, 0]
    finally:
        subscriber.close()
        fake.close()


def test_subscriber_starts_over_when_the_publisher_restarts() -> None:
    """The new run is told apart whatever live batch of it arrives first, as long as its seq
    is not exactly the old run's next (the protocol has no run id: see subscriber.py)."""
    first = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    endpoint, replay = first.endpoint, first.replay_endpoint
    got = Collected()
    subscriber = KVEventSubscriber(endpoint, replay, got)
    try:
        for n in range(1, 31):
            first.publish(_removed(n))
        got.wait_for(lambda b: len(b) >= 31)
        first.close()
        second = KVEventPublisher(endpoint, replay)  # the same ports, seq 0 again
        try:
            # A subscriber learns of what it missed from the next live batch: the engine
            # publishes every step that changes its cache, so keep publishing until one lands.
            for n in range(100, 150):
                second.publish(_removed(n))
                if len(got.batches) > 31:
                    break
                time.sleep(0.2)
            batches = got.wait_for(lambda b: b[-1][1].events == _removed(n))
            assert [seq for seq, _ in batches] == [*range(31), *range(n - 99 + 1)]
            assert [b.events for _, b in batches[31:]] == [
                [AllBlocksCleared()], *(_removed(k) for k in range(100, n + 1))]
        finally:
            second.close()
    finally:
        subscriber.close()


def test_publisher_never_blocks_and_binds_wildcards(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sender thread is held inside its first batch: publishing must not wait for it. A
    # publish that waited would hang the publishing thread, which the join below would catch;
    # 10,000 queue puts take milliseconds, so no load could make its bound a false failure.
    held, release = threading.Event(), threading.Event()

    def held_encode(batch: EventBatch) -> bytes:
        held.set()
        release.wait()
        return encode_batch(batch)

    monkeypatch.setattr("radixserve.kv_events.publisher.encode_batch", held_encode)
    publisher = KVEventPublisher("tcp://*:0", advertise_host="10.1.2.3")
    try:
        assert publisher.endpoint.startswith("tcp://10.1.2.3:")
        assert publisher.replay_endpoint is None
        assert held.wait(60), "the sender never took the first batch"

        def publish_all() -> None:  # nobody listens; the engine thread must not wait
            for n in range(10_000):
                publisher.publish(_removed(n))

        engine = threading.Thread(target=publish_all)
        engine.start()
        engine.join(300)
        assert not engine.is_alive(), "publish waited for the sender"
    finally:
        release.set()
        publisher.close()
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish([])
