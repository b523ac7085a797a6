"""The log as rendered, tokenised requests in time order: what every lint check reads.

Blocks are tokenised one by one (memoised, since logs repeat the same blocks), rendered with
the keys in the order the client sent them, because that is what a vendor caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.lint.logs import LogContents, LoggedRequest, MalformedLine
from radixserve.provider_caching.layout import prefix_hashes
from radixserve.provider_caching.render import BodyError, RenderedRequest, render_request

# Lines without a timestamp are placed this long after the previous request.
UNTIMED_GAP_S = 1.0


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class BlockTokenizer:
    """Token ids per block text, memoised: a log repeats its shared blocks on every line."""

    encoder: Encoder
    _memo: dict[str, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False)

    def ids(self, text: str) -> tuple[int, ...]:
        found = self._memo.get(text)
        if found is None:
            found = self._memo[text] = tuple(self.encoder.encode(text, add_special_tokens=False))
        return found

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def count_once(self, text: str) -> int:
        """Token count of a one-off fragment, not memoised."""
        return len(self.encoder.encode(text, add_special_tokens=False)) if text else 0


@dataclass(frozen=True)
class LintRequest:
    """A logged request, rendered in cache order, with per-block token counts and hashes.

    `chain[i]` identifies the prefix through block i (settings left out: they are checked
    separately); `digests[i]` identifies block i's content wherever it sits.
    """

    index: int
    logged: LoggedRequest
    time: float
    rendered: RenderedRequest
    block_tokens: tuple[int, ...]
    block_ends: tuple[int, ...]
    chain: tuple[bytes, ...]
    digests: tuple[bytes, ...]

    @property
    def total_tokens(self) -> int:
        return self.block_ends[-1] if self.block_ends else 0

    def start_of(self, block: int) -> int:
        """Token offset where block `block` starts."""
        return self.block_ends[block - 1] if block > 0 else 0

    def token_ids(self, tokenizer: BlockTokenizer) -> tuple[int, ...]:
        return tuple(t for b in self.rendered.blocks for t in tokenizer.ids(b.text))


@dataclass(frozen=True)
class Corpus:
    requests: tuple[LintRequest, ...]
    malformed: tuple[MalformedLine, ...]
    files: tuple[str, ...]
    tokenizer: BlockTokenizer

    @property
    def total_tokens(self) -> int:
        return sum(r.total_tokens for r in self.requests)


def prepare_request(
    logged: LoggedRequest, index: int, time: float, tokenizer: BlockTokenizer
) -> LintRequest:
    """Renders and tokenises one request; raises BodyError if the body cannot be rendered."""
    rendered = render_request(logged.body, logged.format, sort_keys=False)
    counts = tuple(tokenizer.count(b.text) for b in rendered.blocks)
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    return LintRequest(index, logged, time, rendered, counts, tuple(ends),
                       prefix_hashes(rendered, settings=()),
                       tuple(b.digest for b in rendered.blocks))


def build_corpus(
    contents: LogContents, encoder: Encoder, tokenizer: BlockTokenizer | None = None
) -> Corpus:
    """Renders every request and orders them by time (file order breaks ties); bodies that
    cannot be rendered join the malformed lines. Pass `tokenizer` to reuse its memo."""
    tokenizer = tokenizer or BlockTokenizer(encoder)
    timed = _times(contents.requests)
    order = sorted(range(len(timed)), key=lambda i: (timed[i], i))
    requests: list[LintRequest] = []
    malformed = list(contents.malformed)
    for i in order:
        logged = contents.requests[i]
        try:
            requests.append(prepare_request(logged, len(requests), timed[i], tokenizer))
        except (BodyError, TypeError, KeyError) as exc:
            malformed.append(MalformedLine(logged.source, logged.line, f"cannot render: {exc}"))
    malformed.sort(key=lambda m: (m.source, m.line))
    return Corpus(tuple(requests), tuple(malformed), contents.files, tokenizer)


def _times(requests: Sequence[LoggedRequest]) -> list[float]:
    times, previous = [], 0.0
    for request in requests:
        previous = request.timestamp if request.timestamp is not None else previous + UNTIMED_GAP_S
        times.append(previous)
    return times
