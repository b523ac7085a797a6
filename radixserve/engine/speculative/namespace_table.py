"""What earlier requests of a namespace said after an n-gram: a bounded, least-recently-used
table from (namespace, n-gram) to the tokens that followed it, fed with each finished
request's verified tokens (the sequences the prefix cache was given). A request drafts from its
own namespace's entries only: the namespace is part of every key, so nothing crosses tenants.

Memory: at most `capacity` entries, each a packed n-gram key and a tuple of up to `span`
tokens (about 200 bytes with span 8: 65,536 entries are ~13 MB), whatever the traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from radixserve.engine.speculative.ngram_index import pack


class NamespaceTable:
    def __init__(self, min_n: int, max_n: int, span: int, capacity: int) -> None:
        if not 1 <= min_n <= max_n or span < 1 or capacity < 1:
            raise ValueError("need 1 <= min_n <= max_n, span >= 1 and capacity >= 1")
        self.min_n, self.max_n, self.span, self.capacity = min_n, max_n, span, capacity
        self._entries: OrderedDict[tuple[Hashable, int, int], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def ingest(self, namespace: Hashable, tokens: Sequence[int], start: int) -> None:
        """Records what followed each n-gram ending at positions >= `start` of `tokens` (a
        request's prompt and output; `start` skips what an earlier call already gave)."""
        entries = self._entries
        for end in range(max(start, self.min_n), len(tokens)):
            follow = tuple(tokens[end : end + self.span])
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = (namespace, n, pack(tokens[end - n : end]))
                entries[key] = follow
                entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def continuation(self, namespace: Hashable, tokens: Sequence[int],
                     k: int) -> tuple[int, list[int]]:
        """The longest suffix of `tokens` (up to max_n) this namespace's table knows, and up to
        `k` tokens that followed it: (match length, draft); (0, []) if none."""
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            follow = self._entries.get((namespace, n, pack(tokens[length - n :])))
            if follow is not None:
                return n, list(follow[:k])
        return 0, []
