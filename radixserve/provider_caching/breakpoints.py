"""Anthropic's `cache_control` rules: where breakpoints may sit, how many, in what TTL order.

Errors carry the vendor's HTTP status, error type and message, so a server can return them
verbatim and the linter can quote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.provider_caching.render import CacheControl, RenderedRequest

MAX_BREAKPOINTS = 4
TTLS = ("5m", "1h")
_ORDER_NOTE = "Note that blocks are processed in the following order: `tools`, `system`, `messages`."


class CacheControlError(ValueError):
    """A request the vendor rejects with 400 `invalid_request_error`.

    `rule` names the broken rule for programs ("limit", "ttl_order", "empty_text", "type",
    "ttl_value", "thinking", "inner_block", "automatic_ttl"); `message` is the vendor's text.
    Messages for "limit", "ttl_order" and "empty_text" are the vendor's captured wording; the
    others follow the vendor's validation style.
    """

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message

    def to_anthropic(self) -> dict[str, Any]:
        """The error body as the Messages API sends it (without the request id)."""
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}


@dataclass(frozen=True)
class Breakpoint:
    """A cache breakpoint: the prefix up to and including block `block_index` is cached."""

    block_index: int
    path: str
    ttl: str  # "5m" | "1h"
    automatic: bool = False  # placed by top-level `cache_control`


@dataclass(frozen=True)
class BreakpointCheck:
    """Every breakpoint a request asks for, and every rule it breaks (the first is what the
    vendor reports)."""

    breakpoints: tuple[Breakpoint, ...]
    errors: tuple[CacheControlError, ...]


def check_breakpoints(request: RenderedRequest) -> BreakpointCheck:
    """Collects the request's breakpoints in cache order and all rule violations.

    OpenAI-format requests have no breakpoints (OpenAI caches automatically). Top-level
    (automatic) `cache_control` lands on the last block that may carry a marker; if that block
    already has one with the same TTL it is a no-op, with another TTL an error; if no block
    qualifies, caching is skipped.
    """
    if request.format != "anthropic":
        return BreakpointCheck((), ())
    errors: list[CacheControlError] = []
    marked = []
    for index, block in enumerate(request.blocks):
        for inner in block.inner_marker_paths:
            errors.append(CacheControlError(
                "inner_block",
                f"{inner}.cache_control: cache_control must be specified on the parent "
                "`tool_result` block (or on its last content block)"))
        if block.cache_control is None:
            continue
        field = f"{block.path}.cache_control"
        if block.kind in ("thinking", "redacted_thinking"):
            errors.append(CacheControlError(
                "thinking", f"{block.path}.{block.kind}.cache_control: Extra inputs are not permitted"))
            continue
        if not _valid_marker(block.cache_control, field, errors):
            continue
        if block.kind == "text" and block.text == "":
            errors.append(CacheControlError(
                "empty_text", f"{block.path}.text: cache_control cannot be set for empty text blocks"))
            continue
        marked.append(Breakpoint(index, block.path, block.cache_control.effective_ttl))
    automatic = request.automatic_cache_control
    if automatic is not None and _valid_marker(automatic, "cache_control", errors):
        target = next((i for i in range(len(request.blocks) - 1, -1, -1)
                       if request.blocks[i].may_carry_marker), None)
        existing = next((b for b in marked if b.block_index == target), None)
        if existing is not None and existing.ttl != automatic.effective_ttl:
            errors.append(CacheControlError(
                "automatic_ttl",
                f"cache_control: the automatic cache breakpoint (ttl='{automatic.effective_ttl}') "
                f"conflicts with the cache_control already on {existing.path} "
                f"(ttl='{existing.ttl}')"))
        elif target is not None and existing is None:
            path = request.blocks[target].path
            marked.append(Breakpoint(target, path, automatic.effective_ttl, automatic=True))
    if len(marked) > MAX_BREAKPOINTS:
        errors.append(CacheControlError(
            "limit",
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(marked)}."))
    seen_5m = False
    for bp in marked:
        if bp.ttl == "1h" and seen_5m:
            where = "cache_control" if bp.automatic else f"{bp.path}.cache_control"
            errors.append(CacheControlError(
                "ttl_order",
                f"{where}.ttl: a ttl='1h' cache_control block must not come after a ttl='5m' "
                f"cache_control block. {_ORDER_NOTE}"))
            break
        seen_5m = seen_5m or bp.ttl == "5m"
    return BreakpointCheck(tuple(marked), tuple(errors))


def validate_breakpoints(request: RenderedRequest) -> tuple[Breakpoint, ...]:
    """The request's breakpoints in cache order; raises the vendor's first `CacheControlError`."""
    check = check_breakpoints(request)
    if check.errors:
        raise check.errors[0]
    return check.breakpoints


def _valid_marker(marker: CacheControl, field: str, errors: list[CacheControlError]) -> bool:
    if marker.type != "ephemeral":
        errors.append(CacheControlError("type", f"{field}.type: Input should be 'ephemeral'"))
        return False
    if marker.ttl is not None and marker.ttl not in TTLS:
        errors.append(CacheControlError("ttl_value", f"{field}.ttl: Input should be '5m' or '1h'"))
        return False
    return True
