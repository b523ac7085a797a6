"""Request bodies (OpenAI chat completions or Anthropic messages) as ordered cache blocks.

Vendors cache in one order, tools then system then messages; each block here carries its tier,
its text as rendered, its field path in the body and any `cache_control` marker on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from radixserve.provider_caching.detect import ApiFormat, BodyError, detect_format

Tier = Literal["tools", "system", "messages"]
Ttl = Literal["5m", "1h"]
TIERS: tuple[Tier, ...] = ("tools", "system", "messages")


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class CacheControl:
    """A `cache_control` marker as given; `ttl` None means the vendor default, 5 minutes."""

    type: Any
    ttl: Any = None

    @property
    def effective_ttl(self) -> Any:
        return "5m" if self.ttl is None else self.ttl


@dataclass(frozen=True)
class CacheBlock:
    """One unit of the prompt in cache order.

    `path` is the vendor's field path ("tools.2", "system.0", "messages.3.content.1"), the
    prefix its error messages use. `message_index` is set for blocks that come from a message.
    `inner_marker_paths` lists markers on inner tool_result blocks other than the last one,
    which the vendor rejects (a marker on the last inner block is hoisted onto this block).
    """

    tier: Tier
    path: str
    kind: str
    text: str
    role: str | None = None
    message_index: int | None = None
    cache_control: CacheControl | None = None
    inner_marker_paths: tuple[str, ...] = ()

    @property
    def may_carry_marker(self) -> bool:
        """Thinking blocks have no cache_control field; empty text blocks are rejected."""
        return self.kind not in ("thinking", "redacted_thinking") and not (
            self.kind == "text" and self.text == ""
        )

    @property
    def digest(self) -> bytes:
        """Identity of the block's content (kind and text), independent of its position."""
        return hashlib.blake2b(f"{self.kind}\0{self.text}".encode(), digest_size=16).digest()


@dataclass(frozen=True)
class Setting:
    """A non-text request setting that the vendor renders into the prompt at `invalidates`."""

    name: str
    value: str  # canonical JSON
    invalidates: Tier


@dataclass(frozen=True)
class RenderedRequest:
    """A request in cache order, ready for breakpoint checks, token offsets and accounting."""

    format: ApiFormat
    model: str | None
    blocks: tuple[CacheBlock, ...]
    settings: tuple[Setting, ...] = ()
    automatic_cache_control: CacheControl | None = None

    def tier_start(self, tier: Tier) -> int:
        """Index of the first block at or after `tier` in cache order (len(blocks) if none)."""
        rank = TIERS.index(tier)
        return next(
            (i for i, b in enumerate(self.blocks) if TIERS.index(b.tier) >= rank), len(self.blocks)
        )


# Settings that change the rendered prompt, and the first tier whose cache they invalidate.
# Anthropic: the invalidation table (tool_choice, thinking and effort break the messages
# cache). OpenAI: tools, text.format, reasoning effort and verbosity shape the whole prefix;
# a structured-output schema sits in front of the system message.
_SETTING_TIERS: dict[ApiFormat, dict[str, Tier]] = {
    "anthropic": {
        "tool_choice": "messages",
        "thinking": "messages",
        "output_config": "messages",
        "output_format": "messages",
    },
    "openai": {
        "reasoning_effort": "tools",
        # Open-weight servers take the effort as a template argument; gpt-oss's template
        # writes it at the head of its system message ("Reasoning: high").
        "chat_template_kwargs.reasoning_effort": "tools",
        "reasoning": "tools",
        "parallel_tool_calls": "tools",
        "verbosity": "tools",
        "response_format": "system",
    },
}

def render_request(
    body: Mapping[str, Any], fmt: ApiFormat | None = None, *, sort_keys: bool = True
) -> RenderedRequest:
    """Renders `body` into cache blocks in the vendor's cache order.

    `sort_keys=True` serialises tool schemas and tool inputs with sorted keys, so the same
    request always renders to the same text (what our engine does). The linter passes False
    to see the key order a vendor would see. Raises `BodyError` on a malformed body.
    """
    fmt = fmt or detect_format(body)
    render = _render_anthropic if fmt == "anthropic" else _render_openai
    blocks = tuple(render(body, sort_keys))
    settings = tuple(
        Setting(name, _json(value, True), tier)
        for name, tier in _SETTING_TIERS[fmt].items()
        if (value := _setting_value(body, name)) is not None
    )
    automatic = _cache_control(body.get("cache_control")) if fmt == "anthropic" else None
    model = body.get("model")
    return RenderedRequest(fmt, model if isinstance(model, str) else None, blocks, settings,
                           automatic)


def _setting_value(body: Mapping[str, Any], name: str) -> Any:
    """`body[name]`, where a dotted name reaches into an object (None where absent)."""
    value: Any = body
    for part in name.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def block_token_counts(request: RenderedRequest, tokenizer: TextTokenizer) -> list[int]:
    """Tokens in each block, each block tokenised on its own.

    Blockwise counts are exact at block boundaries by construction (no token spans two
    blocks), which is what vendor-style block accounting needs. Chat-template framing tokens
    are not counted; for offsets in a model's real prompt use `provider_caching.template`.
    """
    return [len(tokenizer.encode(b.text, add_special_tokens=False)) for b in request.blocks]


def block_end_offsets(counts: Sequence[int]) -> list[int]:
    """Cumulative token offsets where each block ends."""
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    return ends


def canonical_json(value: Any) -> str:
    """The deterministic serialisation used for tool schemas and inputs: sorted keys."""
    return _json(value, True)


def _json(value: Any, sort_keys: bool) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=sort_keys)


def _cache_control(value: Any) -> CacheControl | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return CacheControl(type=value)
    return CacheControl(type=value.get("type"), ttl=value.get("ttl"))


def _without_marker(value: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if k != "cache_control"}


def _need_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise BodyError("expected a list", path)
    return value


def _need_dict(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise BodyError("expected an object", path)
    return value


def _short_hash(value: Any) -> str:
    return hashlib.sha256(_json(value, True).encode()).hexdigest()[:16]


def _render_anthropic(body: Mapping[str, Any], sort_keys: bool) -> list[CacheBlock]:
    blocks = []
    for i, tool in enumerate(_need_list(body.get("tools") or [], "tools")):
        tool = _need_dict(tool, f"tools.{i}")
        blocks.append(CacheBlock("tools", f"tools.{i}", "tool", _json(_without_marker(tool), sort_keys),
                                 cache_control=_cache_control(tool.get("cache_control"))))
    system = body.get("system")
    if isinstance(system, str):
        if system:
            blocks.append(CacheBlock("system", "system", "text", system))
    elif system is not None:
        for j, part in enumerate(_need_list(system, "system")):
            blocks.append(_anthropic_part(_need_dict(part, f"system.{j}"), "system", f"system.{j}",
                                          None, None, sort_keys))
    for i, message in enumerate(body["messages"]):
        message = _need_dict(message, f"messages.{i}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise BodyError("missing role", f"messages.{i}.role")
        if isinstance(content, str):
            blocks.append(CacheBlock("messages", f"messages.{i}.content", "text", content, role, i))
            continue
        for j, part in enumerate(_need_list(content, f"messages.{i}.content")):
            path = f"messages.{i}.content.{j}"
            blocks.append(_anthropic_part(_need_dict(part, path), "messages", path, role, i,
                                          sort_keys))
    return blocks


def _anthropic_part(part: Mapping[str, Any], tier: Tier, path: str, role: str | None,
                    index: int | None, sort_keys: bool) -> CacheBlock:
    kind = str(part.get("type"))
    marker = _cache_control(part.get("cache_control"))
    inner_markers: tuple[str, ...] = ()
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise BodyError("text block without a string 'text'", path)
    elif kind == "tool_use":
        call = {"id": part.get("id"), "name": part.get("name")}
        text = f"[tool_use {_json(call, True)}] {_json(part.get('input'), sort_keys)}"
    elif kind == "tool_result":
        text, inner_markers, hoisted = _tool_result_text(part, path)
        marker = marker or hoisted
    elif kind in ("thinking", "redacted_thinking"):
        text = str(part.get("thinking") or f"[redacted {_short_hash(part.get('data'))}]")
    elif kind == "image":
        text = f"[image {_short_hash(part.get('source'))}]"
    elif kind == "document":
        source = part.get("source") or {}
        body_text = source.get("data") if isinstance(source, Mapping) else None
        text = f"[document {part.get('title') or ''}]\n" + (
            body_text if isinstance(body_text, str) and source.get("type") == "text"
            else _short_hash(source))
    else:
        text = _json(_without_marker(part), sort_keys)
    return CacheBlock(tier, path, kind, text, role, index, marker, inner_markers)


def _tool_result_text(
    part: Mapping[str, Any], path: str
) -> tuple[str, tuple[str, ...], CacheControl | None]:
    content = part.get("content")
    head = f"[tool_result {part.get('tool_use_id')}{' error' if part.get('is_error') else ''}]"
    if content is None or isinstance(content, str):
        return f"{head}\n{content or ''}", (), None
    inner = _need_list(content, f"{path}.content")
    texts, markers = [], []
    for k, item in enumerate(inner):
        item = _need_dict(item, f"{path}.content.{k}")
        texts.append(item["text"] if item.get("type") == "text" and isinstance(item.get("text"), str)
                     else f"[{item.get('type')} {_short_hash(_without_marker(item))}]")
        if item.get("cache_control") is not None:
            markers.append(k)
    # The vendor hoists a marker on the last inner block onto the tool_result itself.
    hoisted = _cache_control(inner[-1].get("cache_control")) if markers[-1:] == [len(inner) - 1] else None
    rejected = tuple(f"{path}.content.{k}" for k in markers if k != len(inner) - 1)
    return head + "\n" + "\n".join(texts), rejected, hoisted


def _render_openai(body: Mapping[str, Any], sort_keys: bool) -> list[CacheBlock]:
    blocks = []
    for i, tool in enumerate(_need_list(body.get("tools") or [], "tools")):
        blocks.append(CacheBlock("tools", f"tools.{i}", "tool",
                                 _json(_need_dict(tool, f"tools.{i}"), sort_keys)))
    leading_system = True
    for i, message in enumerate(body["messages"]):
        message = _need_dict(message, f"messages.{i}")
        role = message.get("role")
        if not isinstance(role, str):
            raise BodyError("missing role", f"messages.{i}.role")
        # The leading run of system/developer messages is OpenAI's counterpart of `system`.
        leading_system = leading_system and role in ("system", "developer")
        tier: Tier = "system" if leading_system else "messages"
        content = message.get("content")
        if isinstance(content, str):
            blocks.append(CacheBlock(tier, f"messages.{i}.content", "text", content, role, i))
        elif content is not None:
            for j, part in enumerate(_need_list(content, f"messages.{i}.content")):
                path = f"messages.{i}.content.{j}"
                part = _need_dict(part, path)
                text = part.get("text") if part.get("type") == "text" else None
                if isinstance(text, str):
                    blocks.append(CacheBlock(tier, path, "text", text, role, i))
                else:
                    blocks.append(CacheBlock(tier, path, str(part.get("type")),
                                             f"[{part.get('type')} {_short_hash(part)}]", role, i))
        for k, call in enumerate(message.get("tool_calls") or ()):
            path = f"messages.{i}.tool_calls.{k}"
            function = _need_dict(_need_dict(call, path).get("function") or {}, path)
            arguments = function.get("arguments")
            if sort_keys and isinstance(arguments, str):
                arguments = _resorted(arguments)
            head = _json({"id": call.get("id"), "name": function.get("name")}, True)
            blocks.append(CacheBlock(tier, path, "tool_call", f"[tool_call {head}] {arguments}",
                                     role, i))
    return blocks


def _resorted(arguments: str) -> str:
    try:
        return _json(json.loads(arguments), True)
    except ValueError:
        return arguments
