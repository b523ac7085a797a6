"""KV cache events from a real engine (the default model, a small pool), read the way an outside
router reads them: raw ZMQ sockets and plain msgpack, none of radixserve's decoding. The stream
starts with AllBlocksCleared, a generate stores its prompt's blocks under the documented
hashes (per tenant), pool pressure removes them, replay hands a late reader every batch, and
the events, applied in order, spell exactly the blocks of the engine's radix tree."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from radixserve import LLM, SamplingParams
from radixserve.kv_events import block_hashes

pytestmark = [pytest.mark.model]

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
Batch = tuple[int, bytes, list[dict[str, Any]]]  # seq, raw payload, events


class RawReader:
    """A router's view of one replica: a SUB socket on the live stream and a DEALER for
    replay, decoding with msgpack alone."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.live: list[Batch] = []

    @staticmethod
    def batch(seq_bytes: bytes, payload: bytes) -> Batch:
        wire = msgpack.unpackb(payload)
        assert isinstance(wire, list) and isinstance(wire[0], float)  # [ts, events(, rank)]
        return int.from_bytes(seq_bytes, "big"), payload, wire[1]

    def read_until(self, done: Callable[[list[Batch]], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.live):
            assert time.monotonic() < deadline, f"{len(self.live)} live batches, not done"
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == b""
                self.live.append(self.batch(seq, payload))

    def replay(self, start: int) -> list[Batch]:
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replies = []
            while True:
                assert dealer.poll(10_000), "no end marker"
                _, topic, seq, payload = dealer.recv_multipart()
                if not payload:
                    assert seq == (-1).to_bytes(8, "big", signed=True)
                    return replies
                replies.append(self.batch(seq, payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def llm(model_path) -> Iterator[LLM]:
    with LLM(str(model_path), kv_cache_tokens=256, show_progress=False, debug_invariants=True,
             kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0",
             kv_events_block_size=BLOCK) as engine:
        yield engine


@pytest.fixture(scope="module")
def reader(llm: LLM) -> Iterator[RawReader]:
    publisher = llm.engine.kv_events
    assert publisher is not None and publisher.replay_endpoint is not None
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    raw = RawReader(publisher.endpoint, publisher.replay_endpoint)
    time.sleep(0.3)  # the SUB connection is up before the first generate
    yield raw
    raw.close()


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40_000) for _ in range(length)]


def _medium(llm: LLM) -> str:
    return "GPU" if llm.engine.device.type == "cuda" else "CPU"


def _events(batches: list[Batch], kind: str) -> list[dict[str, Any]]:
    return [e for _, _, events in batches for e in events if e["type"] == kind]


def _stored(batches: list[Batch]) -> set[int]:
    return {h for e in _events(batches, "BlockStored") for h in e["block_hashes"]}


def test_stream_starts_with_all_blocks_cleared(reader: RawReader) -> None:
    seq, _, events = reader.replay(0)[0]
    assert (seq, events) == (0, [{"type": "AllBlocksCleared"}])


def test_generate_stores_the_prompt_blocks(llm: LLM, reader: RawReader) -> None:
    prompt = _prompt(1, 70)  # 4 full blocks and a partial one
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    shared = block_hashes(prompt, None, BLOCK)
    reader.read_until(lambda live: set(shared) <= _stored(live))
    (first,) = [e for e in _events(reader.live, "BlockStored") if shared[0] in e["block_hashes"]]
    assert first["parent_block_hash"] is None and first["block_hashes"][:4] == shared
    assert first["token_ids"][: 4 * BLOCK] == prompt[:64]
    assert len(first["token_ids"]) == BLOCK * len(first["block_hashes"])
    assert (first["block_size"], first["medium"], first["lora_id"]) == (BLOCK, _medium(llm), None)
    assert "extra_keys" not in first  # the shared namespace

    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, cache_salt="tenant-x")
    salted = block_hashes(prompt, "tenant-x", BLOCK)
    assert not set(salted) & set(shared)  # tenants never share a block
    reader.read_until(lambda live: set(salted) <= _stored(live))
    (event,) = [e for e in _events(reader.live, "BlockStored") if salted[0] in e["block_hashes"]]
    assert event["extra_keys"] == [['"tenant-x"']] * len(event["block_hashes"])


def test_pool_pressure_removes_blocks(llm: LLM, reader: RawReader) -> None:
    prompt = _prompt(2, 48)
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    hashes = block_hashes(prompt, None, BLOCK)
    reader.read_until(lambda live: set(hashes) <= _stored(live))
    fillers = [{"prompt_token_ids": _prompt(100 + i, 150)} for i in range(2)]  # > the pool
    llm.generate(fillers, GREEDY, use_tqdm=False)
    reader.read_until(lambda live: set(hashes) <= {
        h for e in _events(live, "BlockRemoved") for h in e["block_hashes"]})
    assert _events(reader.live, "BlockRemoved")[0]["medium"] == _medium(llm)


def test_replay_returns_what_a_late_reader_missed(llm: LLM, reader: RawReader) -> None:
    llm.generate({"prompt_token_ids": _prompt(3, 40)}, GREEDY, use_tqdm=False)
    time.sleep(0.3)  # published by the engine's publisher thread
    replayed = reader.replay(0)
    assert [seq for seq, _, _ in replayed] == list(range(len(replayed)))
    reader.read_until(lambda live: live[-1][0] >= replayed[-1][0])
    by_seq = {seq: payload for seq, payload, _ in replayed}
    assert all(by_seq[seq] == payload for seq, payload, _ in reader.live)  # the same bytes
    assert reader.replay(replayed[-1][0]) == replayed[-1:]


def test_events_spell_the_engine_tree(llm: LLM, reader: RawReader) -> None:
    llm.generate([{"prompt_token_ids": _prompt(4, 60)}, {"prompt_token_ids": _prompt(4, 30)}],
                 GREEDY, use_tqdm=False, cache_salt="tenant-y")
    time.sleep(0.3)
    held: set[int] = set()
    for _, _, events in reader.replay(0):  # nothing was dropped from the 10,000-batch buffer
        for event in events:
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                held.difference_update(event["block_hashes"])
            else:
                held.clear()
    tree: list[int] = []
    stack = [(key[0][1], (), node) for key, node in llm.engine.cache._root.children.items()]
    while stack:  # the cache keys by (model, tenant); events hash the tenant
        tenant, prefix, node = stack.pop()
        path = prefix + node.key
        tree += block_hashes(path, tenant, BLOCK)[len(prefix) // BLOCK :]
        stack.extend((tenant, path, child) for child in node.children.values())
    assert tree and len(tree) == len(set(tree))
    assert held == set(tree)
