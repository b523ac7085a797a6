"""The hit rate a workload implies: what an unbounded, token-granular prefix cache would reuse.

Each prompt is matched against every token sequence the server had seen before it (earlier
prompts, and prompt + reply for requests already finished), within its cache_salt namespace.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.sequences import common_prefix_len


@dataclass
class PrefixOracle:
    """Longest prefix of a sequence that any inserted sequence starts with, per namespace."""

    # Sorted per namespace: the inserted sequence sharing the longest prefix with a query is
    # always one of its two neighbours in lexicographic order.
    _sorted: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)

    def insert(self, tokens: Sequence[int], namespace: str = "") -> None:
        seqs = self._sorted.setdefault(namespace, [])
        key = tuple(tokens)
        at = bisect.bisect_left(seqs, key)
        if at == len(seqs) or seqs[at] != key:
            seqs.insert(at, key)

    def longest_prefix(self, tokens: Sequence[int], namespace: str = "") -> int:
        seqs = self._sorted.get(namespace, [])
        key = tuple(tokens)
        at = bisect.bisect_left(seqs, key)
        best = 0
        for neighbour in seqs[max(0, at - 1): at + 1]:
            best = max(best, common_prefix_len(key, neighbour))
        return best


@dataclass(frozen=True)
class SentPrompt:
    """What the oracle needs of one request: when it went out and came back, and its tokens."""

    start: float
    end: float | None  # None: it never finished
    prompt_ids: list[int]
    reply_ids: list[int]
    namespace: str = ""


def ideal_cached_tokens(prompts: Sequence[SentPrompt]) -> list[int]:
    """Per prompt (same order as given): tokens an unbounded token-granular cache would have
    reused. At least one prompt token is always computed, so it is at most prompt length - 1."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].start)
    finished = sorted(
        (p.end, i) for i, p in enumerate(prompts) if p.end is not None
    )
    oracle = PrefixOracle()
    result = [0] * len(prompts)
    next_finished = 0
    for i in order:
        prompt = prompts[i]
        # Replies of requests that finished before this one was sent are in the cache too.
        while next_finished < len(finished) and finished[next_finished][0] <= prompt.start:
            done = prompts[finished[next_finished][1]]
            oracle.insert(done.prompt_ids + done.reply_ids, done.namespace)
            next_finished += 1
        hit = oracle.longest_prefix(prompt.prompt_ids, prompt.namespace)
        result[i] = max(0, min(hit, len(prompt.prompt_ids) - 1))
        oracle.insert(prompt.prompt_ids, prompt.namespace)
    return result


def page_aligned(tokens: int, page_size: int) -> int:
    """`tokens` rounded down to whole pages: what a paged cache can reuse of a match."""
    return tokens // page_size * page_size
