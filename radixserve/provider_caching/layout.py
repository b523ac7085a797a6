"""What vendor accounting needs of one prompt: cumulative block hashes, breakpoint token
offsets and the total length, independent of how the prompt was tokenised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.provider_caching.breakpoints import Breakpoint
from radixserve.provider_caching.render import TIERS, RenderedRequest, Setting


@dataclass(frozen=True)
class LayoutBreakpoint:
    """A breakpoint at block `block_index`, whose cached prefix is `tokens` long."""

    block_index: int
    tokens: int
    ttl: str  # "5m" | "1h"


@dataclass(frozen=True)
class PromptLayout:
    """One prompt as vendor accounting sees it.

    `block_hashes[i]` identifies the whole prefix through block i (namespace, the settings
    rendered in front of each tier, and every block's kind and text), so equal hashes mean
    identical prefixes. `token_ids` is needed only for automatic (OpenAI/Gemini) caching,
    whose hashes start from `namespace` (the model and the request's prompt-shaping settings).
    """

    block_hashes: tuple[bytes, ...]
    breakpoints: tuple[LayoutBreakpoint, ...]
    total_tokens: int
    token_ids: tuple[int, ...] | None = None
    namespace: str = ""

    def __post_init__(self) -> None:
        offsets = [bp.tokens for bp in self.breakpoints]
        assert offsets == sorted(offsets), "breakpoints must be in cache order"
        assert all(0 <= t <= self.total_tokens for t in offsets), "offset beyond the prompt"


def prefix_hashes(
    request: RenderedRequest, namespace: str | None = None,
    settings: Sequence[Setting] | None = None,
) -> tuple[bytes, ...]:
    """Cumulative hashes of the request's blocks in cache order.

    A setting is folded in at the first block of the tier it invalidates, so changing it
    changes that tier's hashes and everything after (the vendor's invalidation hierarchy).
    `namespace` defaults to the model name: caches are per model.
    """
    if namespace is None:
        namespace = request.model or ""
    settings = request.settings if settings is None else settings
    by_tier = {tier: sorted(f"{s.name}={s.value}" for s in settings if s.invalidates == tier)
               for tier in TIERS}
    state = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    hashes = []
    pending = set(TIERS)
    for block in request.blocks:
        mix = hashlib.blake2b(state, digest_size=16)
        for tier in TIERS[: TIERS.index(block.tier) + 1]:
            if tier in pending:  # a tier's settings sit in front of its first block
                pending.discard(tier)
                mix.update("\0".join(by_tier[tier]).encode() + b"\1")
        mix.update(block.digest)
        state = mix.digest()
        hashes.append(state)
    return tuple(hashes)


def build_layout(
    request: RenderedRequest,
    breakpoints: Sequence[Breakpoint],
    breakpoint_offsets: Sequence[int],
    total_tokens: int,
    *,
    namespace: str | None = None,
    token_ids: Sequence[int] | None = None,
) -> PromptLayout:
    """Pairs validated breakpoints with their token offsets in the rendered prompt.

    `breakpoint_offsets[i]` is where breakpoint i's cached prefix ends, from
    `template.breakpoint_token_offsets` (the server) or blockwise counts (the linter).
    """
    assert len(breakpoints) == len(breakpoint_offsets)
    if namespace is None:
        namespace = request.model or ""
    return PromptLayout(
        block_hashes=prefix_hashes(request, namespace),
        breakpoints=tuple(LayoutBreakpoint(bp.block_index, tokens, bp.ttl)
                          for bp, tokens in zip(breakpoints, breakpoint_offsets, strict=True)),
        total_tokens=total_tokens,
        token_ids=tuple(token_ids) if token_ids is not None else None,
        namespace="\0".join([namespace, *sorted(f"{s.name}={s.value}" for s in request.settings)]),
    )
