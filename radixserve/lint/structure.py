"""Prefix-sharing structure of a log: for each request its nearest earlier request, where the
two diverge (tier, block, character), and how many tokens a prefix cache could reuse.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.lint.corpus import Corpus, LintRequest
from radixserve.sequences import common_prefix_len

# Without any shared leading block, the reference is the most similar of this many
# preceding requests (blocks equal at equal positions, weighted by tokens).
_SIMILARITY_WINDOW = 50


@dataclass(frozen=True)
class Divergence:
    """How request `request` relates to its nearest earlier request `reference`.

    `block` is the first block of `request` not shared with the reference and `char_offset`
    the first differing character in it. `extends_reference`: every block of the reference
    is shared (a conversation's next turn). `shared_tokens` is the token-level reusable prefix.
    """

    request: int
    reference: int | None
    block: int
    char_offset: int
    shared_tokens: int
    extends_reference: bool


@dataclass(frozen=True)
class DivergencePoint:
    tier: str
    path: str
    char_offset: int
    requests: int


@dataclass(frozen=True)
class PrefixStructure:
    requests: int
    total_tokens: int
    reusable_tokens: int
    distinct_prefixes: int  # distinct tools+system heads
    divergences: tuple[Divergence, ...]
    divergence_points: tuple[DivergencePoint, ...]  # most common first

    @property
    def reusable_fraction(self) -> float:
        return self.reusable_tokens / self.total_tokens if self.total_tokens else 0.0


def analyse_structure(corpus: Corpus, top: int = 5) -> PrefixStructure:
    requests = corpus.requests
    latest: dict[bytes, int] = {}
    divergences = []
    for r in requests:
        depth = 0
        while depth < len(r.chain) and r.chain[depth] in latest:
            depth += 1
        if depth:
            reference: int | None = latest[r.chain[depth - 1]]
        else:
            reference = _most_similar(r, requests[max(0, r.index - _SIMILARITY_WINDOW):r.index])
        divergences.append(_divergence(corpus, r, reference, depth))
        for h in r.chain:
            latest[h] = r.index
    points = Counter(
        (requests[d.request].rendered.blocks[d.block].tier,
         requests[d.request].rendered.blocks[d.block].path, d.char_offset)
        for d in divergences
        if d.reference is not None and not d.extends_reference
        and d.block < len(requests[d.request].rendered.blocks)
    )
    heads = set()
    for r in requests:
        head = r.rendered.tier_start("messages")
        if head:
            heads.add(r.chain[head - 1])
    return PrefixStructure(
        requests=len(requests),
        total_tokens=corpus.total_tokens,
        reusable_tokens=sum(d.shared_tokens for d in divergences),
        distinct_prefixes=len(heads),
        divergences=tuple(divergences),
        divergence_points=tuple(DivergencePoint(t, p, c, n) for (t, p, c), n in points.most_common(top)),
    )


def _most_similar(r: LintRequest, earlier: Sequence[LintRequest]) -> int | None:
    best, best_score = None, -1
    for q in earlier:
        score = sum(r.block_tokens[i] + 1 for i in range(min(len(r.digests), len(q.digests)))
                    if r.digests[i] == q.digests[i])
        if score >= best_score:  # ties go to the most recent
            best, best_score = q.index, score
    return best


def _divergence(corpus: Corpus, r: LintRequest, reference: int | None, depth: int) -> Divergence:
    if reference is None:
        return Divergence(r.index, None, 0, 0, 0, False)
    q = corpus.requests[reference]
    if depth >= len(q.chain) or depth >= len(r.chain):
        shared = r.start_of(depth) if depth < len(r.chain) else r.total_tokens
        return Divergence(r.index, reference, depth, 0, shared, depth >= len(q.chain))
    a, b = r.rendered.blocks[depth].text, q.rendered.blocks[depth].text
    chars = common_prefix_len(a, b) if r.rendered.blocks[depth].kind == q.rendered.blocks[depth].kind else 0
    shared = r.start_of(depth) + corpus.tokenizer.count_once(a[:chars])
    return Divergence(r.index, reference, depth, chars, shared, False)
