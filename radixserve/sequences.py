"""Pure functions over token sequences and cache namespaces, shared by the engine, the caches,
the tier, the KV events, the linter and the benchmarks. Standard library only: anything in
the package may import this module, and it imports nothing of the package.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from typing import Any


def common_prefix_len(a: Sequence[Any], b: Sequence[Any], start: int = 0,
                      limit: int | None = None) -> int:
    """Length of the common prefix of a and b (token ids, KV slots, or strings), at most
    `limit`, given they agree on [0, start)."""
    lo, hi = start, min(len(a), len(b), limit if limit is not None else len(a))
    # Binary search on slice equality: each comparison runs in C, so this is fast in Python.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def namespace_bytes(namespace: Hashable) -> bytes:
    """The canonical bytes of a cache namespace, the same in every process and on every
    machine: b"" for None (the shared cache); for a cache_salt string, an int, or a tuple of
    those (nested or not), its compact JSON (tuples as arrays), UTF-8 encoded. The disk
    tier's keys and the KV events' block hashes both start from these bytes. TypeError for
    any other value: it has no form that stays the same across processes."""
    if not _plain(namespace):
        raise TypeError(f"namespace {namespace!r} has no stable text form")
    if namespace is None:
        return b""
    value = list(namespace) if isinstance(namespace, tuple) else namespace
    return json.dumps(value, separators=(",", ":")).encode()


def _plain(value: object) -> bool:
    if value is None or isinstance(value, (str, int)):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)
