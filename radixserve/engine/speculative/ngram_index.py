"""An incremental n-gram index over one growing token sequence: for each n-gram length, where
that n-gram last ended. Looking up the sequence's own suffix gives the most recent earlier
place it occurred, and so the tokens that followed it there (prompt lookup / n-gram drafting).

Memory: one dict entry per (position, length), so O(sequence length x number of lengths),
bounded by the context length; a step indexes only the tokens added since the last one.
"""

from __future__ import annotations

from collections.abc import Sequence

# Bits per token in a packed n-gram key: room for vocabularies up to a million ids.
TOKEN_BITS = 20


def pack(tokens: Sequence[int]) -> int:
    """One int naming an n-gram (cheaper to hash and hold than a tuple)."""
    key = 0
    for token in tokens:
        key = (key << TOKEN_BITS) | token
    return key


class NgramIndex:
    """Where each n-gram of lengths `min_n..max_n` of one sequence last ended (the index of
    the token after it), for ends up to the sequence's length - 1."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # ends below this are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Indexes the n-grams ending before the last token of `tokens` (the last is the suffix
        being matched: an n-gram ending there has nothing after it yet)."""
        stop = len(tokens)  # ends e < stop: tokens[e] exists to follow the n-gram
        for end in range(max(self._indexed, self.min_n), stop):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[pack(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, stop)

    def continuation(self, tokens: Sequence[int], k: int) -> tuple[int, list[int]]:
        """The longest suffix of `tokens` (up to max_n) seen earlier, and up to `k` tokens that
        followed its latest earlier occurrence: (match length, draft); (0, []) if none."""
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._ends[n].get(pack(tokens[length - n :]))
            if end is not None:
                return n, list(tokens[end : min(end + k, length)])
        return 0, []

    @property
    def entries(self) -> int:
        return sum(len(ends) for ends in self._ends.values())
