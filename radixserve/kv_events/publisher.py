"""Publishes KV cache event batches over ZMQ, framed as vLLM's ZmqEventPublisher frames them, so
that llm-d, NVIDIA Dynamo or our own router (subscriber.py) can follow a replica's cache.

- PUB socket: one multipart message per batch, `[topic, seq, payload]`; seq is the batch's
  number (0, 1, 2, ... from the publisher's start) as 8 bytes big-endian, payload the msgpack
  batch (events.py). Batch 0 is always `AllBlocksCleared`: a subscriber that sees seq 0 knows
  the replica (re)started empty.
- ROUTER socket (optional) for replay: a client (REQ, or DEALER sending an empty delimiter
  frame first) sends a start seq as 8 bytes big-endian; the reply is one message
  `[topic, seq, payload]` per buffered batch from that seq on (the last `buffer_steps`
  batches are kept), then the end marker `[b"", seq -1 as 8 bytes signed, b""]`. This is
  vLLM's layout since v0.26 (vllm-project/vllm#45177 added the topic frame to replies).

Unlike vLLM, which binds wildcard addresses and connects to others, both sockets always bind:
the engine is the stable end and routers come and go. Port 0 binds a free port; `endpoint`
and `replay_endpoint` give the bound addresses, with a wildcard host replaced by one a router
can reach (`advertise_host`, e.g. the node's IP).

The engine thread only enqueues (`publish` never blocks it); a background thread owns both
sockets (ZMQ sockets are not thread-safe), encodes, sends and answers replay requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from radixserve.kv_events.events import AllBlocksCleared, EventBatch, KVCacheEvent, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
# How often the thread looks at the replay socket while no batch arrives.
_REPLAY_POLL_S = 0.01


class KVEventPublisher:
    """See the module docstring. `close()` publishes what is queued, then stops."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, advertise_host: str = "127.0.0.1",
                 data_parallel_rank: int | None = None) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # Unbounded on purpose: a bounded queue would block the engine thread (or lose events,
        # which would corrupt every subscriber's view) when the sender falls behind.
        self._queue: queue.SimpleQueue[tuple[float, list[KVCacheEvent]] | None] = (
            queue.SimpleQueue())
        self._context = zmq.Context()
        # Created and bound here so that a bad endpoint raises in the caller; from the thread's
        # start on (a full memory barrier, which is what ZMQ asks to move a socket), only the
        # thread touches them.
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._endpoint = _connectable(self._pub, advertise_host)
        self._replay_endpoint = (None if self._replay is None
                                 else _connectable(self._replay, advertise_host))
        self._closed = False
        self.publish([AllBlocksCleared()])  # seq 0: subscribers start from an empty cache
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """Where a subscriber connects its SUB socket, e.g. tcp://10.0.0.5:5557."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queues one batch (the events of one step) for sending; never blocks."""
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        self._queue.put((time.time(), events))

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, stops the thread and closes the sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV event publisher did not stop within %.1f s", timeout)
            return  # the daemon thread still owns the sockets; the process exit ends it
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    # ----- the publisher thread -----

    def _run(self) -> None:
        seq = 0
        wait = None if self._replay is None else _REPLAY_POLL_S
        while True:
            self._serve_replays()
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(EventBatch(ts, events, self._rank))
            except Exception:  # a bug, not a transient: keep the thread (and the seqs) going
                logger.exception("encoding KV event batch %d failed; sending it empty", seq)
                payload = encode_batch(EventBatch(ts, [], self._rank))
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                # PUB drops rather than blocks when a subscriber is slow; an error here is the
                # socket itself failing. The batch stays in the replay buffer.
                logger.exception("sending KV event batch %d failed", seq)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            # [identity, b"" (from REQ, or a DEALER that sends it), start seq]
            if len(frames) < 2 or len(frames[-1]) != 8:
                logger.warning("ignoring a malformed KV event replay request (%d frames)",
                               len(frames))
                continue
            envelope, start = frames[:-1], int.from_bytes(frames[-1], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart(
                        (*envelope, self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((*envelope, b"", END_SEQ, b""))


def _connectable(socket: zmq.Socket[bytes], host: str) -> str:
    """The socket's bound address with a wildcard host replaced by `host`."""
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    scheme, sep, rest = bound.partition("://")
    if scheme != "tcp" or not sep:
        return bound
    address, _, port = rest.rpartition(":")
    if address in _WILDCARD_HOSTS:
        address = f"[{host}]" if ":" in host else host
    return f"{scheme}://{address}:{port}"
