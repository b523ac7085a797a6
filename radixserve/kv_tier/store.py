"""A tier directory: the index of its entries, capacity (LRU, pins last), TTL pins, and the
writer thread that puts entries on disk without ever holding up the engine.

Layout: DIR/radixserve-kv-v1/<fingerprint>/<2 hex>/<key>.kv, with <key>.pin beside a pinned
entry (its expiry, wall-clock seconds), and fingerprint.json naming what the fingerprint is.
Entries of other fingerprints sit in sibling directories: never read, never counted, never
deleted (`radixserve cache clear` removes them).

The index lives in memory and is rebuilt at start by a scan of the directory (names and
stats only: the headers are checked when an entry is read). The directory is the truth:
several processes may share it. Each writes through atomic renames, adopts entries it did not
write when a lookup finds them on disk, and treats an entry another process deleted as a miss.
Each enforces the capacity on the entries it knows, so two processes sharing one directory can
together hold up to twice it; there is no shared index file to corrupt or to lock.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from radixserve.kv_tier.blocks import ModelFingerprint
from radixserve.kv_tier.entry import (
    ERROR_KINDS,
    EntryError,
    EntryHeader,
    entry_bytes,
    payload_bytes,
    read_entry,
    write_entry,
)

logger = logging.getLogger(__name__)

LAYOUT_DIR = "radixserve-kv-v1"
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_NOT_PINNED = -math.inf
# Errors that mean "this directory takes no more writes": stop writing, keep serving.
_FATAL_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                       errno.EFBIG}
_WRITER_NICE = 10  # where SCHED_IDLE is refused
STALE_TEMP_S = 600.0  # a temporary file this old is a crashed write, not one in progress


@dataclass
class TierCounters:
    """Cumulative figures, as the metrics report them."""

    bytes_written: int = 0
    bytes_read: int = 0
    dropped_writes: int = 0  # writes refused because the queue was full
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    load_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_BUCKETS))
    load_count: int = 0
    load_seconds: float = 0.0


@dataclass(frozen=True)
class TierStats:
    entries: int
    bytes: int
    pinned_entries: int
    capacity_bytes: int
    writable: bool
    counters: TierCounters


@dataclass
class _Write:
    key: bytes
    header: EntryHeader
    payload: Callable[[], memoryview]  # made on the writer thread: the copy costs no step time
    nbytes: int
    forced: bool
    on_done: Callable[[], None] | None


@dataclass
class _Pin:
    keys: list[bytes]
    until: float


class TierStore:
    def __init__(self, root: str, fingerprint: ModelFingerprint, capacity_bytes: int,
                 queue_bytes: int, wall_clock: Callable[[], float] = time.time) -> None:
        self.fingerprint = fingerprint
        self.fingerprint_hex = fingerprint.name
        self.capacity_bytes = capacity_bytes
        self.queue_bytes = queue_bytes
        self.wall_clock = wall_clock
        self.dir = os.path.join(root, LAYOUT_DIR, self.fingerprint_hex)
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._pins: dict[bytes, float] = {}  # key -> wall-clock expiry
        self._used = 0
        self._pending: set[bytes] = set()
        self._queued_bytes = 0
        self._queue: queue.Queue[_Write | _Pin | None] = queue.Queue()
        self.writable = self._prepare()
        started = time.perf_counter()
        self._scan()
        self.scan_seconds = time.perf_counter() - started
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)
        self._writer.start()

    # ----- lookups (engine thread) -----

    def path(self, key: bytes) -> str:
        hexkey = key.hex()
        return os.path.join(self.dir, hexkey[:2], hexkey + ".kv")

    def contains(self, key: bytes, queued: bool = True) -> bool:
        """Whether the tier holds the block (or, with `queued`, is about to write it); adopts
        an entry another process wrote, with its pin. Refreshes nothing: only a read counts as
        use."""
        with self._lock:
            if key in self._index or (queued and key in self._pending):
                return True
        path = self.path(key)
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        pin = _read_pin(path[: -len(".kv")] + ".pin")
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._index.move_to_end(key, last=False)  # another's: least recent we know of
                self._used += size
                if pin is not None:
                    self._pins[key] = max(pin, self._pins.get(key, _NOT_PINNED))
        return True

    def touch(self, key: bytes) -> None:
        """Marks a block as just used (its LRU place; a restart keeps the order it had)."""
        with self._lock:
            if key not in self._index:
                return
            self._index.move_to_end(key)

    def run_length(self, keys: list[bytes], first: int) -> int:
        """How many consecutive blocks from `keys[first]` on the tier holds."""
        n = 0
        while first + n < len(keys) and self.contains(keys[first + n], queued=False):
            n += 1
        return n

    def pinned_until(self, key: bytes) -> float:
        """The block's pin expiry (wall clock), or -inf."""
        with self._lock:
            until = self._pins.get(key, _NOT_PINNED)
        return until if until > self.wall_clock() else _NOT_PINNED

    # ----- writes (queued; the writer thread does the work) -----

    def has_room(self, nbytes: int) -> bool:
        """Whether an unforced write of `nbytes` would be queued now."""
        with self._lock:
            return self.writable and self._queued_bytes + nbytes <= self.queue_bytes

    def count_dropped(self, writes: int) -> None:
        with self._lock:
            self.counters.dropped_writes += writes

    def put(self, key: bytes, header: EntryHeader, payload: Callable[[], memoryview],
            nbytes: int, forced: bool = False,
            on_done: Callable[[], None] | None = None) -> bool:
        """Queues a block's write; whether the tier has or will have the block. Unforced
        writes are dropped (and counted) when the queue is full or the directory takes no
        writes; forced ones (pinned prefixes) never are. `on_done` is called once the payload
        is no longer needed: by the writer after the job, or at once when nothing was queued."""
        with self._lock:
            queued = False
            if key in self._index or key in self._pending:
                held = True
            elif not self.writable:
                held = False
            elif not forced and self._queued_bytes + nbytes > self.queue_bytes:
                self.counters.dropped_writes += 1
                held = False
            else:
                self._pending.add(key)
                self._queued_bytes += nbytes
                held = queued = True
        if queued:
            self._queue.put(_Write(key, header, payload, nbytes, forced, on_done))
        elif on_done is not None:
            on_done()
        return held

    def pin(self, keys: list[bytes], until: float) -> None:
        """Pins blocks until the wall-clock time `until` (extending, never shortening), after
        any of their writes already queued."""
        if keys and self.writable:
            self._queue.put(_Pin(list(keys), until))

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued job is done; whether that happened within `timeout`."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finishes queued writes (up to `timeout`), then stops the writer. Idempotent."""
        if not self._writer.is_alive():
            return
        if not self.flush(timeout):
            logger.warning("KV tier: %d writes still queued at shutdown were not written",
                           len(self._pending))
        self._queue.put(None)
        self._writer.join(timeout=5.0)

    # ----- reads (loader thread) -----

    def read(self, key: bytes,
             into: Callable[[EntryHeader], list[memoryview] | None] | None = None,
             ) -> tuple[EntryHeader, memoryview | None]:
        """Reads a block (straight into buffers `into` names: see read_entry); refreshes its
        LRU place. A bad entry is deleted, counted and raised as EntryError (the caller
        computes instead)."""
        path = self.path(key)
        try:
            header, payload = read_entry(path, key.hex(), self.fingerprint_hex, into)
        except EntryError as exc:
            logger.warning("KV tier: %s entry: %s", exc.kind, exc)
            with self._lock:
                self.counters.errors[exc.kind] += 1
            self._forget(key, delete=exc.kind in ("truncated", "corrupt", "foreign"))
            raise
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.counters.bytes_read += payload_bytes(header)
        try:
            os.utime(path)  # keeps the LRU order across restarts
        except OSError:
            pass
        return header, payload

    def advise(self, key: bytes) -> None:
        """Asks the OS to start reading a block into the page cache (a prefetch)."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)

    def record_load(self, seconds: float) -> None:
        """Counts one request's load (its blocks, read and copied into the pool)."""
        with self._lock:
            c = self.counters
            c.load_count += 1
            c.load_seconds += seconds
            i = bisect.bisect_left(LOAD_BUCKETS, seconds)
            if i < len(c.load_buckets):
                c.load_buckets[i] += 1

    def stats(self) -> TierStats:
        now = self.wall_clock()
        with self._lock:
            c = self.counters
            counters = TierCounters(c.bytes_written, c.bytes_read,
                                    c.dropped_writes, dict(c.errors), list(c.load_buckets),
                                    c.load_count, c.load_seconds)
            return TierStats(entries=len(self._index), bytes=self._used,
                             pinned_entries=sum(1 for k, t in self._pins.items()
                                                if t > now and k in self._index),
                             capacity_bytes=self.capacity_bytes, writable=self.writable,
                             counters=counters)

    # ----- the writer thread -----

    def _write_loop(self) -> None:
        _below_the_engine()
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                if isinstance(job, _Write):
                    self._write(job)
                else:
                    self._write_pins(job)
            except Exception:  # pragma: no cover - a bug; the tier must not take serving down
                logger.exception("KV tier writer failed on a job")
                with self._lock:
                    self.counters.errors["write"] += 1
                    if isinstance(job, _Write):
                        self._pending.discard(job.key)
                        self._queued_bytes -= job.nbytes
            finally:
                if isinstance(job, _Write) and job.on_done is not None:
                    job.on_done()
                self._queue.task_done()

    def _write(self, job: _Write) -> None:
        written = 0
        try:
            if self.writable and self._make_room(job):
                os.makedirs(os.path.dirname(self.path(job.key)), exist_ok=True)
                written = write_entry(self.path(job.key), job.header, job.payload())
        except OSError as exc:
            self._write_failed(exc)
        with self._lock:
            self._pending.discard(job.key)
            self._queued_bytes -= job.nbytes
            if written:
                # The key may have been adopted meanwhile (another process wrote it first).
                self._used += written - self._index.get(job.key, 0)
                self._index[job.key] = written
                self.counters.bytes_written += written

    def _make_room(self, job: _Write) -> bool:
        """Deletes entries (LRU, pinned last) until the new one fits the capacity."""
        # Exact: a header of a long block's token ids can outweigh any fixed allowance.
        need = entry_bytes(job.header, job.nbytes)
        if need > self.capacity_bytes:
            return False
        while True:
            with self._lock:
                if self._used + need <= self.capacity_bytes:
                    return True
                victim = self._victim()
                if victim is None:
                    return False
            self._forget(victim, delete=True)

    def _victim(self) -> bytes | None:
        now = self.wall_clock()
        pinned = None
        for key in self._index:
            if self._pins.get(key, _NOT_PINNED) <= now:
                return key
            pinned = pinned or key
        return pinned

    def _write_pins(self, job: _Pin) -> None:
        for key in job.keys:
            with self._lock:
                if not self.writable:
                    return
                if key not in self._index:
                    continue  # its write failed or was dropped: nothing to pin
                until = max(self._pins.get(key, _NOT_PINNED), job.until)
                self._pins[key] = until
            pin_path = self.path(key)[: -len(".kv")] + ".pin"
            tmp = _temp_name(pin_path)
            try:
                with open(tmp, "w") as f:
                    f.write(repr(until))
                os.replace(tmp, pin_path)
            except OSError as exc:
                self._write_failed(exc)
                return

    def _write_failed(self, exc: OSError) -> None:
        with self._lock:
            self.counters.errors["write"] += 1
            fatal = exc.errno in _FATAL_WRITE_ERRNOS and self.writable
            if fatal:
                self.writable = False
        if fatal:
            logger.warning("KV tier: %s: %s; serving on without writing to the tier "
                           "(entries already there are still read)", self.dir, exc)
        else:
            logger.warning("KV tier: a write failed: %s", exc)

    # ----- the directory -----

    def _prepare(self) -> bool:
        """Creates the directory and checks it takes writes; warns once if not."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe.{os.getpid()}.tmp")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
            described = os.path.join(self.dir, "fingerprint.json")
            if not os.path.exists(described):
                tmp = f"{described}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(asdict(self.fingerprint), f, indent=1)
                os.replace(tmp, described)
        except OSError as exc:
            logger.warning("KV tier: %s takes no writes (%s); serving on without writing to "
                           "the tier (entries already there are still read)", self.dir, exc)
            return False
        return True

    def _scan(self) -> None:
        """Rebuilds the index from the directory: entries in LRU order (by mtime), pins; drops
        stale temporary files."""
        found: list[tuple[float, bytes, int]] = []
        pins: dict[bytes, float] = {}
        now = time.time()
        for sub in list_dir(self.dir):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for item in list_dir(sub.path):
                name = item.name
                try:
                    if name.endswith(".kv"):
                        stat = item.stat()
                        found.append((stat.st_mtime, bytes.fromhex(name[:-3]), stat.st_size))
                    elif name.endswith(".pin"):
                        pin = _read_pin(item.path)
                        if pin is not None:
                            pins[bytes.fromhex(name[:-4])] = pin
                    elif name.endswith(".tmp") and now - item.stat().st_mtime > STALE_TEMP_S:
                        os.unlink(item.path)
                except (OSError, ValueError):
                    continue  # vanished meanwhile, or not ours: ignored
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        self._pins = {k: t for k, t in pins.items() if k in self._index}

    def _forget(self, key: bytes, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            self._pins.pop(key, None)
        base = self.path(key)[: -len(".kv")]
        for path in (base + ".kv", base + ".pin") if delete else (base + ".pin",):
            try:
                os.unlink(path)
            except OSError:
                pass


def _temp_name(path: str) -> str:
    """A temporary name no other writer uses: processes by pid, stores in one process by
    their writer thread."""
    return f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"


def _read_pin(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def list_dir(path: str) -> Iterable[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _below_the_engine() -> None:
    """Puts the calling (writer) thread below the engine's threads: SCHED_IDLE, so it runs only
    on a core nothing else wants. A time slice taken from one of the engine's torch threads
    stalls the other at the next barrier too, so even a low nice value costs the steps twice
    what it takes; a writer that falls behind drops (and counts) writes instead."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, _WRITER_NICE)
    except (AttributeError, OSError):  # normal priority, then
        pass
