"""Pure functions over token sequences and cache namespaces, shared by the engine, the caches,
the tier, the KV events, the linter and the benchmarks. Standard library only: anything in
the package may import this module, and it imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Sequence
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
