"""Test helpers for prompt caching: assertions on cached tokens in OpenAI and Anthropic
responses (from the vendors or radixserve) that explain a miss, and a pytest fixture that
checks a prompt builder renders a byte-identical prefix.

Use it as a plugin: `pytest_plugins = ["radixserve.testing"]` in your top-level conftest.py
gives tests the `stable_prefix` fixture.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date
from typing import Any, Literal

from radixserve.lint.patterns import volatile_kind
from radixserve.provider_caching.breakpoints import check_breakpoints
from radixserve.provider_caching.profiles import profile_for_model
from radixserve.provider_caching.render import render_request
from radixserve.sequences import common_prefix_len

_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_NO_USAGE = (
    "the response carries no usage. For a stream pass the final usage chunk (OpenAI: request "
    "with stream_options={'include_usage': True}) or the accumulated message (Anthropic: "
    "stream.get_final_message())"
)


@dataclass(frozen=True)
class CacheReport:
    """A response's prompt-cache numbers, whatever API produced them."""

    api: Literal["anthropic", "openai"]
    model: str | None
    prompt_tokens: int  # total input, cached or not
    cached_tokens: int  # read from cache
    cache_write_tokens: int  # written (Anthropic; OpenAI's 2026 cache_write_tokens)


def cache_report(response: Any) -> CacheReport:
    """Reads the cache numbers of an SDK response object or its dict: OpenAI ChatCompletion,
    final ChatCompletionChunk, Responses Response, CompletionUsage; Anthropic Message,
    message_start / message_delta events, Usage."""
    data = response.model_dump() if hasattr(response, "model_dump") else response
    if not isinstance(data, Mapping):
        raise TypeError(f"not a response object or dict: {type(response).__name__}")
    if data.get("type") == "message_start":
        data = data.get("message") or {}
    model = data.get("model")
    usage = data.get("usage") if "usage" in data else data
    if not isinstance(usage, Mapping):
        raise AssertionError(_NO_USAGE)
    if "prompt_tokens" in usage:  # Chat Completions
        details = usage.get("prompt_tokens_details") or {}
        return CacheReport("openai", model, usage["prompt_tokens"], details.get("cached_tokens") or 0,
                           details.get("cache_write_tokens") or 0)
    if "input_tokens_details" in usage:  # Responses
        details = usage.get("input_tokens_details") or {}
        return CacheReport("openai", model, usage["input_tokens"], details.get("cached_tokens") or 0,
                           details.get("cache_write_tokens") or 0)
    if "input_tokens" in usage or "cache_read_input_tokens" in usage:  # Anthropic
        read = usage.get("cache_read_input_tokens") or 0
        written = usage.get("cache_creation_input_tokens") or 0
        return CacheReport("anthropic", model, (usage.get("input_tokens") or 0) + read + written,
                           read, written)
    raise AssertionError(_NO_USAGE)


def explain_miss(report: CacheReport, expected: int, min_cacheable_tokens: int | None = None) -> str:
    """Why `report` has fewer than `expected` cached tokens, most likely cause first."""
    minimum = min_cacheable_tokens or profile_for_model(report.model, report.api).min_cacheable_tokens
    got, total = report.cached_tokens, report.prompt_tokens
    if got == 0 and total < minimum:
        return (f"0 cached tokens: the prefix is {total:,} tokens, below this model's "
                f"{minimum:,} minimum (shorter prompts are never cached, and no error is returned)")
    if got == 0 and report.api == "anthropic" and report.cache_write_tokens:
        return (f"0 cached tokens, {report.cache_write_tokens:,} written: this request created "
                "the cache entry instead of reading one. It is the first with this prefix, the "
                "entry expired (5 minutes idle; 1 hour with ttl '1h'), the prefix changed since "
                "the last request (a timestamp, an id, reordered JSON keys, another tool list), "
                "or an identical request was still in flight (entries become readable once its "
                "response starts)")
    if got == 0 and report.api == "anthropic":
        return ("0 cached and 0 written: no cache_control breakpoint took effect. Anthropic "
                "caches nothing without one: put cache_control on the last block of the shared "
                "prefix (or a top-level cache_control); a breakpoint whose prefix is below the "
                f"model's {minimum:,}-token minimum is silently ignored")
    if got == 0:
        return (f"0 cached tokens of {total:,}: OpenAI caches automatically from {minimum:,} "
                "tokens, so the first tokens differed from every recent request (a timestamp, "
                "an id, reordered JSON keys or another tool list early in the prompt), this is "
                "the first request with the prefix, the cache expired (5 to 10 minutes idle), or "
                "the request reached another machine (over ~15 requests a minute per prefix, or "
                "another prompt_cache_key)")
    how = ("OpenAI counts cached tokens in 128-token increments" if report.api == "openai" else
           "a read stops at the longest entry an earlier request wrote at a breakpoint, found "
           "within 20 blocks of each breakpoint")
    return (f"{got:,} cached tokens, expected at least {expected:,}: the prefix matched an "
            f"earlier request only up to token {got:,} ({how}); something changes after that point")


def assert_cached(response: Any, at_least: int = 1, *,
                  min_cacheable_tokens: int | None = None) -> CacheReport:
    """Fails unless at least `at_least` prompt tokens were read from cache, saying why."""
    report = cache_report(response)
    if report.cached_tokens < at_least:
        raise AssertionError(explain_miss(report, at_least, min_cacheable_tokens))
    return report


def assert_cache_written(response: Any, at_least: int = 1) -> CacheReport:
    """Fails unless at least `at_least` tokens were written to cache (Anthropic)."""
    report = cache_report(response)
    if report.cache_write_tokens < at_least:
        cause = (f"{report.cached_tokens:,} were read instead: an earlier request already wrote "
                 "this prefix" if report.cached_tokens else explain_miss(report, at_least))
        raise AssertionError(f"{report.cache_write_tokens:,} tokens written to cache, expected at "
                             f"least {at_least:,}; {cause}")
    return report


def assert_not_cached(response: Any) -> CacheReport:
    report = cache_report(response)
    if report.cached_tokens:
        raise AssertionError(f"{report.cached_tokens:,} of {report.prompt_tokens:,} prompt tokens "
                             "were read from cache; expected none")
    return report


def rendered_prefix(prompt: Any) -> str:
    """The part of a prompt meant to be cached, as text: for a request body, every block (in
    cache order, keys as sent) up to the last breakpoint, or, without breakpoints, all but the
    final message, plus prompt-shaping settings; a string is taken whole."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"[{label}]\n{text}" for label, text in _prefix_parts(prompt))


def _prefix_parts(prompt: Any) -> list[tuple[str, str]]:
    if isinstance(prompt, str):
        return [("prompt", prompt)]
    request = render_request(prompt, sort_keys=False)
    marks = check_breakpoints(request).breakpoints
    if marks:
        end = marks[-1].block_index + 1
    else:
        last = request.blocks[-1].message_index if request.blocks else None
        end = next((i for i, b in enumerate(request.blocks)
                    if last is not None and b.message_index == last), len(request.blocks))
    return ([(s.name, s.value) for s in request.settings]
            + [(b.path, b.text) for b in request.blocks[:end]])


def assert_stable_prefix(build: Callable[[], Any], *, calls: int = 2,
                         allow_volatile: bool = False) -> str:
    """Calls `build` `calls` times and fails unless the rendered prefix is byte-identical, or
    (unless `allow_volatile`) if it holds today's date or a UUID, which change between runs
    even when two quick calls agree. Returns the prefix as `rendered_prefix` shows it."""
    prompt = build()
    first = _prefix_parts(prompt)
    for _ in range(calls - 1):
        again = _prefix_parts(build())
        if again != first:
            raise AssertionError("the prompt prefix is not byte-identical between two builds: "
                                 + _describe_difference(first, again))
    text = rendered_prefix(prompt)
    if not allow_volatile:
        found = _volatile_text(text)
        if found:
            raise AssertionError(f"the prompt prefix holds {found}, which changes between "
                                 "requests; move it after the cached part (allow_volatile=True "
                                 "to accept it)")
    return text


def _describe_difference(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> str:
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
    if index >= len(a) or index >= len(b):
        return f"one build has {len(a)} prefix parts, the other {len(b)}"
    (label, left), (other_label, right) = a[index], b[index]
    if label != other_label:
        return f"part {index} is [{label}] in one build and [{other_label}] in the other"
    at = common_prefix_len(left, right)
    kind = volatile_kind(left[max(0, at - 20): at + 40])
    hint = f" (looks like a {kind.replace('_', ' ')})" if kind else ""
    return (f"[{label}] line {left.count(chr(10), 0, at) + 1}, char {at}: "
            f"{left[at: at + 40]!r} vs {right[at: at + 40]!r}{hint}")


def _volatile_text(text: str) -> str | None:
    today = date.today()
    for fmt in ("%Y-%m-%d", "%B %d, %Y", "%d %B %Y", "%m/%d/%Y", "%Y/%m/%d"):
        if today.strftime(fmt) in text:
            return f"today's date ({today.strftime(fmt)})"
    for found in _UUID.finditer(text):
        return f"a UUID ({found.group()})"
    return None


try:  # the fixture exists only where pytest does; the assertions work without it
    import pytest
except ImportError:  # pragma: no cover
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def stable_prefix() -> Callable[..., str]:
        """`stable_prefix(build, calls=2, allow_volatile=False)`: fails the test unless the
        prompt `build()` returns has a byte-identical cached prefix on every call."""
        return assert_stable_prefix
