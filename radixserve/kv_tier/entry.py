"""One tier entry: a block's KV in one file, self-describing and checksummed.

    magic "RSKVTIER" | u32 header length | header (JSON) | payload | u64 XXH3-64 of all before

The header names the block (key, parent key, fingerprint, namespace, first position, tokens)
and the payload's dtype and shape ([layers, 2 (K, V), kv heads, tokens, head dim], C order).
A reader checks the length, the checksum and that the header is the block it asked for, so a
truncated, corrupted, renamed or foreign file is refused, never read as KV. Files appear by
atomic rename of a complete temporary file, so a reader never sees a half-written one.

The checksum is XXH3-64 (seed 0, little-endian in the file): a 64-bit non-cryptographic hash
(damage of any shape slips through with odds of about 2^-64) that runs at memory speed, many
times CRC-32's rate. Speed matters twice: a load checks every byte before the request
may use its slots, and every write hashes every byte on a thread that shares the cores with
the engine.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import xxhash

MAGIC = b"RSKVTIER"
_PREFIX = len(MAGIC) + 4
_SUM = 8  # the checksum's bytes
_HEAD_READ = 64 * 1024  # the first read: the prefix and (almost always) the whole header
_IOV_MAX = 512  # buffers per preadv call, under every kernel's limit
# The kinds of failed reads, as counted by the tier's error metric.
ERROR_KINDS = ("missing", "truncated", "corrupt", "foreign", "io", "write")


class EntryError(Exception):
    """A tier entry that cannot be used; `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class EntryHeader:
    key: str  # hex
    parent: str  # hex; the fingerprint digest for a prompt's first block
    fingerprint: str  # hex
    namespace: str
    start: int  # position of the block's first token in its prompt
    tokens: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    created: float  # wall-clock seconds

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> EntryHeader:
        fields = json.loads(bytes(raw))
        fields["tokens"] = tuple(fields["tokens"])
        fields["shape"] = tuple(fields["shape"])
        return cls(**fields)


def write_entry(path: str, header: EntryHeader, payload: memoryview) -> int:
    """Writes the entry to `path` through a temporary file and an atomic rename; returns the
    bytes written. Raises OSError (a full disk, a read-only directory) with nothing left."""
    head = header.encode()
    prefix = MAGIC + struct.pack("<I", len(head)) + head
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # unique per writer thread
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            f.write(payload)
            f.write(struct.pack("<Q", _checksum([prefix, payload])))
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(prefix) + payload.nbytes + _SUM


def read_entry(path: str, key: str, fingerprint: str,
               into: Callable[[EntryHeader], list[memoryview] | None] | None = None,
               ) -> tuple[EntryHeader, memoryview | None]:
    """Reads and checks the entry of block `key`; returns its header and payload (a writable
    buffer). Raises EntryError saying what was wrong.

    `into(header)` may name buffers that together take the payload in order (the KV pool's
    own memory): it is then read straight into them (one copy instead of two, no allocation)
    and None is returned as the payload. The buffers are written before the checks end, so
    they must be ones that may hold garbage when this raises."""
    try:
        with open(path, "rb", buffering=0) as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            head = os.pread(fd, min(size, _HEAD_READ), 0)
            header, start = _parse(head, size, path)
            if start > len(head):  # a header longer than the first read
                head = os.pread(fd, start, 0)
            targets = into(header) if into is not None else None
            if targets is None:
                data = bytearray(size - start)
                f.seek(start)
                got = f.readinto(data)
                if got != len(data):
                    raise EntryError("truncated", f"{path}: payload cut short")
                payload: memoryview | None = memoryview(data)[: got - _SUM]
                parts: list[memoryview] = [payload]
                stored_raw = bytes(data[got - _SUM : got])
            else:
                if _read_into(fd, targets, start) != size - start - _SUM:
                    raise EntryError("truncated", f"{path}: payload cut short")
                payload, parts = None, targets
                stored_raw = os.pread(fd, _SUM, size - _SUM)
    except FileNotFoundError as exc:
        raise EntryError("missing", f"{path}: no such entry") from exc
    except OSError as exc:
        raise EntryError("io", f"{path}: {exc}") from exc
    if len(stored_raw) != _SUM:
        raise EntryError("truncated", f"{path}: checksum cut short")
    if _checksum([head[:start], *parts]) != struct.unpack("<Q", stored_raw)[0]:
        raise EntryError("corrupt", f"{path}: checksum mismatch")
    if header.key != key or header.fingerprint != fingerprint:
        raise EntryError("foreign", f"{path}: holds block {header.key[:12]} of model "
                         f"{header.fingerprint[:12]}, not {key[:12]} of {fingerprint[:12]}")
    return header, payload


def read_header(path: str) -> EntryHeader:
    """The header alone (no checksum check): for listing a tier directory."""
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX)
        if len(prefix) < _PREFIX or prefix[: len(MAGIC)] != MAGIC:
            raise EntryError("corrupt", f"{path}: not a tier entry")
        (length,) = struct.unpack_from("<I", prefix, len(MAGIC))
        raw = f.read(length)
    if len(raw) < length:
        raise EntryError("truncated", f"{path}: header cut short")
    try:
        return EntryHeader.decode(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise EntryError("corrupt", f"{path}: bad header ({exc})") from exc


def entry_bytes(header: EntryHeader, payload_nbytes: int) -> int:
    """The size of the entry's file, as write_entry writes it."""
    return _PREFIX + len(header.encode()) + payload_nbytes + _SUM


def payload_bytes(header: EntryHeader) -> int:
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[header.dtype]
    count = 1
    for dim in header.shape:
        count *= dim
    return count * itemsize


def _checksum(parts: list[bytes | memoryview]) -> int:
    """XXH3-64 of the parts in order, as one stream."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def _read_into(fd: int, targets: list[memoryview], offset: int) -> int:
    """Fills the buffers in order from `offset` (preadv, within the kernel's IOV_MAX per
    call, resuming after short reads); returns the bytes read."""
    total = 0
    pending = [t for t in targets if t.nbytes]
    while pending:
        got = os.preadv(fd, pending[:_IOV_MAX], offset + total)
        if got == 0:
            break  # end of file
        total += got
        while pending and got >= pending[0].nbytes:
            got -= pending[0].nbytes
            pending.pop(0)
        if got:
            pending[0] = pending[0][got:]
    return total


def _parse(head: bytes, size: int, path: str) -> tuple[EntryHeader, int]:
    """The header, from the file's first bytes and its size; and where the payload starts."""
    if size < _PREFIX + _SUM or head[: len(MAGIC)] != MAGIC:
        raise EntryError("truncated" if size < _PREFIX + _SUM else "corrupt",
                         f"{path}: not a tier entry")
    (length,) = struct.unpack_from("<I", head, len(MAGIC))
    start = _PREFIX + length
    if start + _SUM > size:
        raise EntryError("truncated", f"{path}: {size} bytes, shorter than its header says")
    if start > len(head):
        raise EntryError("corrupt", f"{path}: a header of {length} bytes")
    try:
        header = EntryHeader.decode(head[_PREFIX:start])
        expected = start + payload_bytes(header) + _SUM
    except (ValueError, TypeError, KeyError) as exc:
        raise EntryError("corrupt", f"{path}: bad header ({exc})") from exc
    if size != expected:
        raise EntryError("truncated" if size < expected else "corrupt",
                         f"{path}: {size} bytes, expected {expected}")
    return header, start
