"""Drafters: propose up to k next tokens for a request from text already seen, no draft model.

`ngram` matches the request's own prompt and output (the longest recent suffix seen earlier:
code re-emitted with an edit, a quoted passage, tool arguments copied from a result). `suffix`
also looks in what earlier requests of the same namespace said (NamespaceTable), where the
request's own tokens know no continuation. Both are plain lookups: a step costs a few dict
probes per request plus indexing the tokens it added.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from radixserve.engine.speculative.namespace_table import NamespaceTable
from radixserve.engine.speculative.ngram_index import NgramIndex

# n-gram lengths matched, longest first: 1-grams draft noise, beyond 4 matches rarely grow.
MIN_NGRAM = 2
MAX_NGRAM = 4


class DraftSource(Protocol):
    """What a drafter reads of a request (radixserve.engine.request.Request satisfies it)."""

    namespace: Hashable
    token_ids: list[int]
    prompt_token_ids: list[int]
    draft_index: NgramIndex | None


class Drafter(Protocol):
    def propose(self, request: DraftSource, k: int) -> list[int]:
        """Up to `k` tokens likely to follow the request's tokens; [] when nothing matches."""
        ...


def _own(request: DraftSource, k: int) -> tuple[int, list[int]]:
    if request.draft_index is None:
        request.draft_index = NgramIndex(MIN_NGRAM, MAX_NGRAM)
    return request.draft_index.continuation(request.token_ids, k)


class NgramDrafter:
    """Drafts from the request's own prompt and output only."""

    def propose(self, request: DraftSource, k: int) -> list[int]:
        return _own(request, k)[1]


class SuffixDrafter:
    """Drafts from the request's own tokens and, where those know no longer match, from its
    namespace's earlier requests (fed by `learn` as requests finish)."""

    def __init__(self, table: NamespaceTable) -> None:
        self.table = table

    def propose(self, request: DraftSource, k: int) -> list[int]:
        own_n, own = _own(request, k)
        if own_n == MAX_NGRAM and len(own) == k:
            return own
        shared_n, shared = self.table.continuation(request.namespace, request.token_ids, k)
        # The request's own text is trusted first: the shared table wins only a longer match.
        return shared if shared_n > own_n else own

    def learn(self, namespace: Hashable, tokens: Sequence[int], prompt_len: int) -> None:
        """Records a finished request's verified tokens: its output, with the prompt's tail
        as the output's first n-grams' context (its prompt is in the cache for later hits;
        the table keeps what was said)."""
        self.table.ingest(namespace, tokens, max(prompt_len - 1, 0))
