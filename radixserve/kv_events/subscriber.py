"""Follows one replica's KV cache events (publisher.py's framing, which is vLLM's) and hands
every batch to a callback exactly once, in sequence order, with nothing missing that the
replica still buffers. The router runs one per replica and applies the batches to its
BlockIndex.

Live batches come over SUB. The subscriber asks the replay endpoint (DEALER) for what it has
not seen: everything from seq 0 as soon as it starts (so a router that comes up beside an idle
replica still learns what it caches), the missing range whenever a live seq skips ahead, and
what is new whenever nothing has arrived for `replay_timeout` seconds (a PUB socket drops
what it sends before a subscriber's connection is up, and only the next batch would show the
loss). Live batches that arrive meanwhile wait and are delivered after the gap; duplicates (a
batch seen live and in a replay) are dropped. A gap the replica no longer buffers is skipped
with a warning.

A restarted replica counts from seq 0 again, and its batches must not be taken for the old
run's. The subscriber remembers a digest of the last few thousand batches it delivered, and
takes as a restart a live seq not above the last live one (one PUB stream only counts up), a
live seq it delivered with other bytes or too long ago to be a late duplicate, and a replayed
batch whose bytes differ from the one it delivered under that seq (replays are asked from the
last delivered seq, not the next, so that one always overlaps). Delivery then starts over
from the new run's seq 0, its `AllBlocksCleared`. What no subscriber can tell (the protocol
has no run id) is a new run whose first batch to arrive is exactly the old run's next seq,
until the idle check's replay shows the new run's batch under the last delivered seq.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from radixserve.kv_events.events import EventBatch, decode_batch
from radixserve.kv_events.publisher import END_SEQ

logger = logging.getLogger(__name__)

BatchHandler = Callable[[int, EventBatch], None]
_POLL_MS = 50  # how soon close() is noticed
# Delivered batches whose digests are kept: far more than can be in flight between a replay
# and the live stream, so an older live seq can only be a restarted publisher's.
_RECENT = 4096


class KVEventSubscriber:
    """Calls `on_batch(seq, batch)` from its own daemon thread; see the module docstring.
    Without a replay endpoint, gaps are skipped (live batches only). `replay_timeout`: how
    long a replay reply may take, and how long without news before asking what is new."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, on_batch: BatchHandler,
                 topic: str = "", replay_timeout: float = 2.0) -> None:
        self._on_batch = on_batch
        self._replay_timeout = replay_timeout
        self._last_seq = -1
        self._recent: dict[int, int] = {}  # seq -> hash() of the payload delivered under it
        self._last_live_seq = -1
        self._held: dict[int, bytes] = {}  # received out of order, waiting for a gap to fill
        self._replay_asked_at: float | None = None  # a replay request is in flight since then
        self._heard_at = time.monotonic()  # the last live batch or finished replay
        # What the last request asked from, and the highest seq the replica had when it
        # answered (held when the request went out, or replied): a gap between the two still
        # open after the reply is lost, not late.
        self._replay_start = 0
        self._replay_covers = -1
        self._stop = threading.Event()
        self._context = zmq.Context()
        # Created here so that a bad endpoint raises in the caller; from the thread's start on,
        # only the thread touches them.
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.DEALER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.connect(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber",
                                        daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """The seq of the last batch delivered; -1 before the first."""
        return self._last_seq

    def close(self, timeout: float = 5.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    # ----- the subscriber thread -----

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
            self._ask_replay()
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._sub in ready:
                while self._sub.poll(0):
                    self._on_live(self._sub.recv_multipart())
            if self._replay is not None and self._replay in ready:
                while self._replay.poll(0):
                    self._on_replay(self._replay.recv_multipart())
            if self._replay is None:
                continue
            now, asked = time.monotonic(), self._replay_asked_at
            if asked is not None and now - asked > self._replay_timeout:
                self._replay_asked_at = None  # lost (the replica restarted, or is down)
                if self._held:
                    self._ask_replay()
            elif asked is None and now - self._heard_at > self._replay_timeout:
                self._ask_replay()  # quiet for a while: anything sent before we could hear it?

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            logger.warning("ignoring a malformed KV event message (%d frames)", len(frames))
            return
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        self._heard_at = time.monotonic()
        if seq <= self._last_live_seq:
            self._start_over(f"live seq {seq} after {self._last_live_seq}")
            self._held = {}
        elif seq <= self._last_seq and self._recent.get(seq) != hash(payload):
            self._start_over(f"live seq {seq} is not the batch delivered as {seq}")
            self._held = {}
        self._last_live_seq = seq
        if seq <= self._last_seq:
            return  # a replay delivered it already
        self._held[seq] = payload
        self._deliver_held()
        if self._held and self._replay is None:
            self._skip_gap()
        elif self._held and self._replay_asked_at is None:
            self._ask_replay()

    def _on_replay(self, frames: list[bytes]) -> None:
        if frames and frames[0] == b"":  # the delimiter we sent, echoed back
            frames = frames[1:]
        # [topic, seq, payload] since vLLM v0.26; [seq, payload] before.
        if len(frames) not in (2, 3) or len(frames[-2]) != 8:
            logger.warning("ignoring a malformed KV event replay reply (%d frames)", len(frames))
            return
        seq_bytes, payload = frames[-2], frames[-1]
        if seq_bytes == END_SEQ or not payload:
            self._replay_asked_at = None
            self._heard_at = time.monotonic()
            if (self._held and self._last_seq + 1 >= self._replay_start
                    and min(self._held) <= self._replay_covers):
                self._skip_gap()
            elif self._held:
                self._ask_replay()  # what we hold arrived after the request: ask again
            return
        seq = int.from_bytes(seq_bytes, "big")
        if seq <= self._last_seq and self._recent.get(seq, hash(payload)) != hash(payload):
            self._start_over(f"replayed batch {seq} is not the one delivered as {seq}")
        self._replay_covers = max(self._replay_covers, seq)
        if seq > self._last_seq:
            self._held[seq] = payload
            self._deliver_held()

    def _start_over(self, why: str) -> None:
        if self._last_seq >= 0:
            logger.info("KV event publisher restarted (%s): starting over from seq 0", why)
        self._last_seq = -1
        self._recent.clear()

    def _ask_replay(self) -> None:
        assert self._replay is not None
        # From the last delivered batch, not the next one: its copy tells a restart apart.
        self._replay_start = max(self._last_seq, 0)
        self._replay.send_multipart((b"", self._replay_start.to_bytes(8, "big")))
        self._replay_asked_at = time.monotonic()
        self._replay_covers = max(self._held, default=-1)

    def _skip_gap(self) -> None:
        """Gives up on the batches before the oldest held one: the replica no longer has them."""
        oldest = min(self._held)
        logger.warning("KV event batches %d..%d are lost; the index may be stale until the "
                       "replica's cache turns over", self._last_seq + 1, oldest - 1)
        self._last_seq = oldest - 1
        self._deliver_held()

    def _deliver_held(self) -> None:
        while self._last_seq + 1 in self._held:
            seq = self._last_seq + 1
            payload = self._held.pop(seq)
            self._last_seq = seq
            self._recent[seq] = hash(payload)
            self._recent.pop(seq - _RECENT, None)
            try:
                batch = decode_batch(payload)
            except ValueError:
                logger.warning("skipping undecodable KV event batch %d", seq, exc_info=True)
                continue
            try:
                self._on_batch(seq, batch)
            except Exception:  # the callback's bug must not stop the stream
                logger.exception("KV event handler failed on batch %d", seq)
