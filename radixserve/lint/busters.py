"""Explains why a request stops sharing its prefix with its nearest earlier request: a date,
an id, reordered JSON keys, a different tool list, a known client's per-request preamble
(Claude Code's billing header), or per-request text in front of shared text.

Cost: the shared tokens after the changing part, which a cache cannot reuse while that part
sits in front of them: the rest of the block, then the later blocks both requests have, in order.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from radixserve.lint.corpus import Corpus, LintRequest
from radixserve.lint.findings import Instance
from radixserve.lint.patterns import volatile_spans
from radixserve.lint.repairs import (
    AddBreakpoint,
    MoveMatches,
    MoveSpan,
    Repair,
    SortAllJson,
    SortJson,
    UnifyTools,
)
from radixserve.lint.structure import Divergence, PrefixStructure
from radixserve.provider_caching.breakpoints import check_breakpoints
from radixserve.provider_caching.preambles import KNOWN_PREAMBLES, match_preamble
from radixserve.provider_caching.render import canonical_json
from radixserve.sequences import common_prefix_len

_WORD_CHARS = frozenset("-:_./+")
# Smaller losses are noise: two different questions often share a final "?".
MIN_TOKENS_LOST = 32
_MAX_JSON_TRIES = 200


def divergence_instances(
    corpus: Corpus, structure: PrefixStructure, minimum: Callable[[LintRequest], int]
) -> list[Instance]:
    """Cache-busters at each request's divergence from its reference request.

    `minimum(request)` is the model's minimum cacheable length (for the breakpoint check)."""
    all_tools = _tool_union(corpus)
    instances = []
    for d in structure.divergences:
        if d.reference is None or d.extends_reference:
            continue
        r, q = corpus.requests[d.request], corpus.requests[d.reference]
        if d.block >= len(r.rendered.blocks) or d.block >= len(q.rendered.blocks):
            continue
        found = _explain(corpus, r, q, d, all_tools)
        if found is not None:
            instances.append(found)
        volatile = _volatile_breakpoint(r, d, minimum(r))
        if volatile is not None:
            instances.append(volatile)
    return instances


def _explain(corpus: Corpus, r: LintRequest, q: LintRequest, d: Divergence,
             all_tools: dict[str, tuple[str, ...]]) -> Instance | None:
    block, other = r.rendered.blocks[d.block], q.rendered.blocks[d.block]
    a, b = block.text, other.text
    start, end = _changed_span(a, b) if block.kind == other.kind else (0, len(a))
    other_end = len(b) - (len(a) - end)
    base = dict(request=r.index, location=r.logged.location, tier=block.tier, path=block.path,
                char_offset=start, line_in_block=a.count("\n", 0, start) + 1, reference=q.index)
    found: Instance
    json_span = _reordered_json(a, b, d.char_offset)
    if json_span is not None:
        text_block = block.kind == "text"
        end = json_span[1]
        at = {"char_offset": json_span[0], "line_in_block": a.count("\n", 0, json_span[0]) + 1}
        found = Instance(
            "key_order", detail=_excerpt(a, json_span[0], end), **(base | at),
            repair=SortJson(block.path, at["line_in_block"]) if text_block else SortAllJson())
    elif block.tier == "tools" or other.tier == "tools":
        end = len(a)  # a tool is one unit: nothing after the change inside it is reusable
        same = sorted(_tool_texts(r)) == sorted(_tool_texts(q))
        fmt = r.rendered.format
        found = Instance("tool_list", detail="same tools in another order" if same else "different tools",
                         repair=UnifyTools(fmt, all_tools[fmt]),
                         **(base | {"line_in_block": None, "path": "tools", "tier": "tools"}))
    elif block.tier == "system" and (preamble := match_preamble(a, KNOWN_PREAMBLES)):
        # A known client's per-request line: named, and moved whole (what a strip does).
        end = len(a) - len(a.lstrip()) + len(a.lstrip().split("\n", 1)[0])
        found = Instance("client_preamble", detail=_excerpt(a, 0, end), subject=preamble.client,
                         **(base | {"char_offset": 0, "line_in_block": 1}),
                         repair=MoveSpan(block.path, 0, end) if block.kind == "text" else None)
    else:
        kind, subject = _classify(a, start, end)
        text_block = block.kind == "text"
        if kind == "per_request_content":
            repair: Repair | None = MoveSpan(block.path, start, end) if text_block else None
            other_repair = MoveSpan(other.path, start, other_end) if other.kind == "text" else None
        else:  # dates and ids are moved wherever that line of that block has one, log-wide
            repair = MoveMatches(block.path, base["line_in_block"], kind) if text_block else None
            other_repair = None
        found = Instance(kind, detail=_excerpt(a, start, end), subject=subject, **base,
                         repair=repair, reference_repair=other_repair)
    after, moved_whole = _aligned_tokens(r, q, d.block)
    lost = after + (0 if moved_whole else corpus.tokenizer.count_once(a[end:]))
    return replace(found, tokens_lost=lost) if lost >= MIN_TOKENS_LOST else None


def _changed_span(a: str, b: str) -> tuple[int, int]:
    """Where `a` differs from `b` (common prefix and suffix removed), widened to whole words
    so a date or id is reported and moved whole."""
    start = common_prefix_len(a, b)
    suffix = common_prefix_len(a[start:][::-1], b[start:][::-1])
    while start > 0 and (a[start - 1].isalnum() or a[start - 1] in _WORD_CHARS):
        start -= 1
    end = len(a) - suffix
    while end < len(a) and (a[end].isalnum() or a[end] in _WORD_CHARS):
        end += 1
    while end > start and a[end - 1] in ".:" and (end == len(a) or not a[end].isalnum()):
        end -= 1  # sentence punctuation after a date or id is not part of it
    return start, end


def _classify(text: str, start: int, end: int) -> tuple[str, str]:
    """The kind of a changing span by what its line holds there: a date/time, an id, or
    (neither) per-request content."""
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    line = text[line_start: line_end if line_end >= 0 else len(text)]
    for kind, subject in (("timestamp", "the date/time"), ("request_id", "the id")):
        if any(m_start + line_start < end and m_end + line_start > start
               for m_start, m_end in volatile_spans(line, kind)):
            return kind, subject
    return "per_request_content", ""


def _volatile_breakpoint(r: LintRequest, d: Divergence, minimum: int) -> Instance | None:
    """The vendor's classic mistake: the only breakpoints sit at or after a block that changes
    between requests, so every request writes and none reads, though a stable prefix exists."""
    if r.rendered.format != "anthropic" or d.block == 0:
        return None
    marks = [bp.block_index for bp in check_breakpoints(r.rendered).breakpoints]
    stable = r.start_of(d.block)
    if not marks or min(marks) < d.block or stable < minimum:
        return None
    previous = r.rendered.blocks[d.block - 1]
    return Instance("volatile_breakpoint", r.index, r.logged.location, tier=previous.tier,
                    path=r.rendered.blocks[min(marks)].path, tokens_lost=stable,
                    detail=f"the prefix changes at {r.rendered.blocks[d.block].path}",
                    subject=previous.path, repair=AddBreakpoint(previous.path),
                    reference=d.reference, reference_repair=AddBreakpoint(previous.path))


def _aligned_tokens(r: LintRequest, q: LintRequest, block: int) -> tuple[int, bool]:
    """Tokens of r's blocks from `block` on that q also has from `block` on, in the same order
    (so an inserted or a dropped block does not hide the shared content after it); and
    whether r's block `block` itself is among them."""
    positions: dict[bytes, list[int]] = defaultdict(list)
    for i in range(block, len(q.digests)):
        positions[q.digests[i]].append(i)
    total, cursor, first_found = 0, block, False
    for i in range(block, len(r.digests)):
        found = positions.get(r.digests[i])
        if not found:
            continue
        k = bisect_left(found, cursor)
        if k < len(found):
            total += r.block_tokens[i]
            cursor = found[k] + 1
            first_found = first_found or i == block
    return total, first_found


def _reordered_json(a: str, b: str, offset: int) -> tuple[int, int] | None:
    """(start, end) in `a` of the innermost JSON value around `offset` that decodes in both
    texts to equal values, i.e. differs only in key order; None if there is none."""
    decoder = json.JSONDecoder()
    starts = [i for i in range(min(offset, len(a) - 1, len(b) - 1), -1, -1) if a[i] in "{["]
    for start in starts[:_MAX_JSON_TRIES]:
        try:
            va, end_a = decoder.raw_decode(a, start)
            vb, end_b = decoder.raw_decode(b, start)
        except ValueError:
            continue
        if end_a <= offset or end_b <= offset:
            continue
        return (start, end_a) if canonical_json(va) == canonical_json(vb) else None
    return None


def _tool_texts(r: LintRequest) -> list[str]:
    return [b.text for b in r.rendered.blocks if b.tier == "tools"]


def _tool_union(corpus: Corpus) -> dict[str, tuple[str, ...]]:
    """Per API format, every tool seen in the log once (by name, latest definition), sorted
    by name."""
    by_format: dict[str, dict[str, str]] = defaultdict(dict)
    for r in corpus.requests:
        for text in _tool_texts(r):
            tool = json.loads(text)
            name = tool.get("name") or (tool.get("function") or {}).get("name") or text
            by_format[r.rendered.format][str(name)] = canonical_json(tool)
    return {fmt: tuple(tools[n] for n in sorted(tools)) for fmt, tools in by_format.items()}


def _excerpt(text: str, start: int, end: int, limit: int = 60) -> str:
    snippet = text[start:end]
    return snippet if len(snippet) <= limit else snippet[: limit - 1] + "…"
