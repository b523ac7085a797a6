"""Common-prefix length of two sequences (token ids or KV slots), at C speed."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0,
                      limit: int | None = None) -> int:
    """Length of the common prefix of a and b (at most `limit`), given they agree on [0, start)."""
    lo, hi = start, min(len(a), len(b), limit if limit is not None else len(a))
    # Binary search on slice equality: each comparison runs in C, so this is fast in Python.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
