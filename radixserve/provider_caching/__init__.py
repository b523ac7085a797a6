"""Prompt caching as the vendors define it: cache blocks in render order, `cache_control`
breakpoints, their token offsets, vendor accounting and prices. Pure functions over token
offsets; the server, the linter and `radixserve.testing` share them.
"""

from radixserve.provider_caching.breakpoints import (
    Breakpoint,
    BreakpointCheck,
    CacheControlError,
    check_breakpoints,
    validate_breakpoints,
)
from radixserve.provider_caching.layout import (
    LayoutBreakpoint,
    PromptLayout,
    build_layout,
    prefix_hashes,
)
from radixserve.provider_caching.prices import (
    Cost,
    ModelPrice,
    PriceTable,
    break_even_reuses,
    default_prices,
    load_prices,
    request_cost,
)
from radixserve.provider_caching.profiles import (
    PROFILES,
    ModelProfile,
    get_profile,
    profile_for_model,
)
from radixserve.provider_caching.render import (
    BodyError,
    CacheBlock,
    CacheControl,
    RenderedRequest,
    block_end_offsets,
    block_token_counts,
    canonical_json,
    detect_format,
    render_request,
)
from radixserve.provider_caching.template import (
    ChatPrompt,
    RenderedPrompt,
    breakpoint_token_offsets,
    chat_prompt,
    render_prompt,
)
from radixserve.provider_caching.usage import CacheUsage
from radixserve.provider_caching.vendor_rules import Accounting, VendorCache

__all__ = [
    "PROFILES", "Accounting", "BodyError", "Breakpoint", "BreakpointCheck", "CacheBlock",
    "CacheControl", "CacheControlError", "CacheUsage", "ChatPrompt", "Cost", "LayoutBreakpoint",
    "ModelPrice", "ModelProfile", "PriceTable", "PromptLayout", "RenderedPrompt",
    "RenderedRequest", "VendorCache", "block_end_offsets", "block_token_counts",
    "break_even_reuses", "breakpoint_token_offsets", "build_layout", "canonical_json",
    "chat_prompt", "check_breakpoints", "default_prices", "detect_format", "get_profile",
    "load_prices", "prefix_hashes", "profile_for_model", "render_prompt", "render_request",
    "request_cost", "validate_breakpoints",
]
