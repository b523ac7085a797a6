"""Anthropic's context editing (`context_management.edits`): old tool results (and inputs) and
old thinking blocks cleared from the conversation before it is rendered, as the vendor does it
server-side; the client keeps sending its full history.

The cache consequence is the vendor's: the rendered prompt is unchanged up to the first
cleared block, so the prefix cache still serves everything before it, and the rest is prefilled
again (why `clear_at_least` exists: clear enough to be worth that). An edit type not listed
here is refused, never ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.server.errors import bad_request

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
EDIT_TYPES = (CLEAR_TOOL_USES, CLEAR_THINKING)
# What a cleared tool result says instead (the model must know something was there).
CLEARED_RESULT = "[tool result cleared to save context]"
# The vendor's documented defaults.
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1
_THINKING = ("thinking", "redacted_thinking")


@dataclass(frozen=True)
class ClearToolUses:
    """clear_tool_uses_20250919: once the trigger is passed, every tool use older than the
    last `keep` (and not of an excluded tool) has its result replaced by CLEARED_RESULT and,
    per `clear_tool_inputs` (all, or the named tools), its input emptied; nothing is cleared
    unless at least `clear_at_least` input tokens go."""

    trigger_kind: str = "input_tokens"  # or "tool_uses"
    trigger_value: int = DEFAULT_TRIGGER_TOKENS
    keep: int = DEFAULT_KEEP_TOOL_USES
    clear_at_least: int = 0
    exclude_tools: frozenset[str] = frozenset()
    clear_tool_inputs: bool | frozenset[str] = False


@dataclass(frozen=True)
class ClearThinking:
    """clear_thinking_20251015: thinking blocks of all but the last `keep` assistant turns
    that have any are removed (`keep` None: "all", nothing is removed)."""

    keep: int | None = DEFAULT_KEEP_THINKING_TURNS


Edit = ClearToolUses | ClearThinking


@dataclass(frozen=True)
class EditedBody:
    """A body after its edits: the applied ones as the response reports them, the token count
    before any, and the body path of the first block an edit changed (None: nothing changed)."""

    body: dict[str, Any]
    applied_edits: list[dict[str, Any]]
    original_input_tokens: int
    first_edited: str | None


def _count(value: Any, path: str, kinds: tuple[str, ...]) -> tuple[str, int]:
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise bad_request(f"{path}: expected {{\"type\": {' or '.join(map(repr, kinds))}, "
                          "\"value\": N}", path)
    number = value.get("value")
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise bad_request(f"{path}.value: expected an integer >= 0", f"{path}.value")
    return value["type"], number


def _names(value: Any, path: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request(f"{path}: expected a list of tool names", path)
    return frozenset(value)


def _tool_uses_edit(spec: dict[str, Any], path: str) -> ClearToolUses:
    known = {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}
    _no_extra(spec, known, path)
    edit = ClearToolUses()
    if spec.get("trigger") is not None:
        kind, value = _count(spec["trigger"], f"{path}.trigger", ("input_tokens", "tool_uses"))
        edit = ClearToolUses(trigger_kind=kind, trigger_value=value)
    keep = edit.keep
    if spec.get("keep") is not None:
        keep = _count(spec["keep"], f"{path}.keep", ("tool_uses",))[1]
    least = 0
    if spec.get("clear_at_least") is not None:
        least = _count(spec["clear_at_least"], f"{path}.clear_at_least", ("input_tokens",))[1]
    exclude = frozenset[str]()
    if spec.get("exclude_tools") is not None:
        exclude = _names(spec["exclude_tools"], f"{path}.exclude_tools")
    inputs: bool | frozenset[str] = False
    raw_inputs = spec.get("clear_tool_inputs")
    if isinstance(raw_inputs, bool):
        inputs = raw_inputs
    elif raw_inputs is not None:
        inputs = _names(raw_inputs, f"{path}.clear_tool_inputs")
    return ClearToolUses(edit.trigger_kind, edit.trigger_value, keep, least, exclude, inputs)


def _thinking_edit(spec: dict[str, Any], path: str) -> ClearThinking:
    _no_extra(spec, {"type", "keep"}, path)
    keep = spec.get("keep")
    if keep is None:
        return ClearThinking()
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"
                         and set(keep) == {"type"}):
        return ClearThinking(None)
    return ClearThinking(_count(keep, f"{path}.keep", ("thinking_turns",))[1])


def _no_extra(spec: dict[str, Any], known: set[str], path: str) -> None:
    extra = sorted(set(spec) - known)
    if extra:
        raise bad_request(f"{path}.{extra[0]}: Extra inputs are not permitted",
                          f"{path}.{extra[0]}")


def parse_context_management(value: Any, thinking_on: bool) -> tuple[Edit, ...]:
    """The edits of a `context_management` field, checked; 400 for an unknown edit type, a
    malformed parameter, clear_thinking without thinking on, or clear_thinking after another
    edit (the vendor's rules)."""
    if not isinstance(value, dict):
        raise bad_request("context_management: expected an object", "context_management")
    _no_extra(value, {"edits"}, "context_management")
    specs = value.get("edits") or []
    if not isinstance(specs, list):
        raise bad_request("context_management.edits: expected a list", "context_management.edits")
    edits: list[Edit] = []
    for i, spec in enumerate(specs):
        path = f"context_management.edits.{i}"
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == CLEAR_TOOL_USES:
            edits.append(_tool_uses_edit(spec, path))
        elif kind == CLEAR_THINKING:
            if not thinking_on:
                raise bad_request(f"{path}: {CLEAR_THINKING} needs thinking enabled "
                                  "(thinking.type enabled or adaptive)", path)
            if i != 0:
                raise bad_request(f"{path}: {CLEAR_THINKING} must come first in "
                                  "context_management.edits", path)
            edits.append(_thinking_edit(spec, path))
        else:
            raise bad_request(f"{path}.type: edit type {kind!r} is not implemented by this "
                              f"server; it applies {' and '.join(EDIT_TYPES)}", f"{path}.type")
    return tuple(edits)


@dataclass(frozen=True)
class _ToolUse:
    message: int
    block: int
    name: str
    result: tuple[int, int] | None  # (message, block) of its tool_result


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _tool_uses(messages: list[Any]) -> list[_ToolUse]:
    results: dict[str, tuple[int, int]] = {}
    for i, message in enumerate(messages):
        for j, block in enumerate(_blocks(message)):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                results.setdefault(str(block.get("tool_use_id")), (i, j))
    uses = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        for j, block in enumerate(_blocks(message)):
            if isinstance(block, dict) and block.get("type") == "tool_use":
                uses.append(_ToolUse(i, j, str(block.get("name")), results.get(str(block.get("id")))))
    return uses


def _set_block(messages: list[Any], at: tuple[int, int], block: dict[str, Any]) -> None:
    i, j = at
    content = list(messages[i]["content"])
    content[j] = block
    messages[i] = {**messages[i], "content": content}


def _clear_tool_uses(edit: ClearToolUses, messages: list[Any], tokens: int
                     ) -> tuple[list[Any], int, list[tuple[int, int]]]:
    """(messages, tool uses cleared, blocks changed) for one clear_tool_uses edit."""
    uses = _tool_uses(messages)
    measure = tokens if edit.trigger_kind == "input_tokens" else len(uses)
    if measure <= edit.trigger_value:
        return messages, 0, []
    older = uses[: max(0, len(uses) - edit.keep)]
    edited, cleared, changed = list(messages), 0, []
    for use in older:
        if use.name in edit.exclude_tools:
            continue
        touched = False
        if use.result is not None:
            i, j = use.result
            result = messages[i]["content"][j]
            if result.get("content") != CLEARED_RESULT:
                _set_block(edited, use.result, {**result, "content": CLEARED_RESULT})
                changed.append(use.result)
                touched = True
        inputs = edit.clear_tool_inputs
        if inputs is True or (isinstance(inputs, frozenset) and use.name in inputs):
            call = messages[use.message]["content"][use.block]
            if call.get("input") != {}:
                _set_block(edited, (use.message, use.block), {**call, "input": {}})
                changed.append((use.message, use.block))
                touched = True
        cleared += touched
    return edited, cleared, changed


def _assistant_turns(messages: list[Any]) -> list[list[int]]:
    """Assistant message indices by turn: a turn runs until a user message that says more than
    tool results (a tool-use loop is one turn)."""
    turns: list[list[int]] = []
    open_turn = False
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            if not open_turn:
                turns.append([])
                open_turn = True
            turns[-1].append(i)
        elif role == "user":
            content = message.get("content")
            only_results = isinstance(content, list) and bool(content) and all(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content)
            open_turn = open_turn and only_results
    return turns


def _clear_thinking(edit: ClearThinking, messages: list[Any]
                    ) -> tuple[list[Any], int, list[tuple[int, int]]]:
    if edit.keep is None:
        return messages, 0, []
    with_thinking = [turn for turn in _assistant_turns(messages) if any(
        isinstance(b, dict) and b.get("type") in _THINKING
        for i in turn for b in _blocks(messages[i]))]
    older = with_thinking[: max(0, len(with_thinking) - edit.keep)]
    edited, changed = list(messages), []
    for turn in older:
        for i in turn:
            content = _blocks(messages[i])
            changed += [(i, j) for j, b in enumerate(content)
                        if isinstance(b, dict) and b.get("type") in _THINKING]
            edited[i] = {**messages[i], "content": [
                b for b in content if not (isinstance(b, dict) and b.get("type") in _THINKING)]}
    return edited, len(older), changed


def apply_edits(body: dict[str, Any], edits: tuple[Edit, ...],
                count_tokens: Callable[[dict[str, Any]], int]) -> EditedBody:
    """`body` with `edits` applied in order, each judged on the body as the earlier ones left
    it; `count_tokens` is the rendered prompt's length (exact, so cleared_input_tokens is)."""
    tokens = original = count_tokens(body)
    applied: list[dict[str, Any]] = []
    first: tuple[int, int] | None = None
    for edit in edits:
        messages = list(body["messages"])
        if isinstance(edit, ClearToolUses):
            edited, cleared, changed = _clear_tool_uses(edit, messages, tokens)
            report = {"type": CLEAR_TOOL_USES, "cleared_tool_uses": cleared}
        else:
            edited, cleared, changed = _clear_thinking(edit, messages)
            report = {"type": CLEAR_THINKING, "cleared_thinking_turns": cleared}
        if not changed:
            continue
        candidate = {**body, "messages": edited}
        after = count_tokens(candidate)
        if isinstance(edit, ClearToolUses) and tokens - after < edit.clear_at_least:
            continue  # not worth invalidating the cache for
        applied.append({**report, "cleared_input_tokens": tokens - after})
        body, tokens = candidate, after
        first = min([first, *changed] if first is not None else changed)
    path = None if first is None else f"messages.{first[0]}.content.{first[1]}"
    return EditedBody(body, applied, original, path)

