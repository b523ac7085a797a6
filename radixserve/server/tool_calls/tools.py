"""Tools as both APIs declare them, normalised: the tool list, the choice (none, auto, required,
or one named tool) and whether calls may be parallel; and, where the choice forces a call, the
grammar that makes the model write one valid call in its chat family's format.

A forced call is constrained decoding, not a retry: every token of the output is masked so the
text is `<tool_call>{"name": <one of the tools>, "arguments": <valid for that tool's
schema>}</tool_call>` (or the family's own shape), which `parsers` then reads back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.engine.structured_output import GrammarCompiler
from radixserve.sampling_params import StructuredOutputsParams
from radixserve.server.errors import bad_request
from radixserve.server.tool_calls.parsers import (
    CallCheck,
    ParsedOutput,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
)

ChoiceMode = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]  # the arguments' JSON schema
    strict: bool = False  # arguments must follow the schema, even where the call is free


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode
    name: str | None = None  # the one tool to call (mode "required")
    parallel: bool = True  # several calls in one turn allowed

    @property
    def forced(self) -> bool:
        return self.mode == "required"


def _schema(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {"type": "object"}
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object.", param)
    return value


def _spec(definition: dict[str, Any], schema_key: str, path: str) -> ToolSpec:
    """A tool from the object that holds its name, its arguments' schema (`schema_key`) and
    `strict` (both APIs' name)."""
    name = definition.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("a tool needs a name.", f"{path}.name")
    strict = definition.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("strict must be true or false.", f"{path}.strict")
    return ToolSpec(name, _schema(definition.get(schema_key), f"{path}.{schema_key}"),
                    bool(strict))


def _check_names(tools: list[ToolSpec], param: str) -> list[ToolSpec]:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(f"tool names must be unique; {tool.name!r} appears twice.",
                              f"{param}.{i}")
        seen.add(tool.name)
    return tools


def openai_tools(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    """OpenAI's `tools`: [{"type": "function", "function": {"name", "parameters", ...}}]."""
    specs = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request('only tools of type "function" (with a "function" object) are '
                              "supported.", f"tools.{i}")
        specs.append(_spec(function, "parameters", f"tools.{i}.function"))
    return _check_names(specs, "tools")


def openai_tool_choice(choice: str | dict[str, Any] | None, tools: list[ToolSpec],
                       parallel: bool | None) -> ToolChoice:
    """OpenAI's `tool_choice`: "none", "auto" (the default with tools), "required", or
    {"type": "function", "function": {"name": ...}}; `parallel_tool_calls` defaults to true."""
    allow_parallel = True if parallel is None else parallel
    if choice is None:
        return ToolChoice("auto" if tools else "none", parallel=allow_parallel)
    if not tools:
        raise bad_request("tool_choice is only allowed when tools are specified.", "tool_choice")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request('tool_choice must be "none", "auto", "required" or a named '
                              "function.", "tool_choice")
        return ToolChoice(choice, parallel=allow_parallel)  # type: ignore[arg-type]
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request('a named tool_choice is {"type": "function", "function": {"name": '
                          "...}}.", "tool_choice")
    return ToolChoice("required", _known(name, tools, "tool_choice"), parallel=False)


def anthropic_tools(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    """Anthropic's `tools`: [{"name", "description", "input_schema"}]. Server tools (a `type`
    such as web_search_20250305) run on the vendor's machines: refused."""
    specs = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"tool type {kind!r} is not supported: only client tools "
                              "(name, description, input_schema).", f"tools.{i}")
        specs.append(_spec(tool, "input_schema", f"tools.{i}"))
    return _check_names(specs, "tools")


def anthropic_tool_choice(choice: dict[str, Any] | None, tools: list[ToolSpec]) -> ToolChoice:
    """Anthropic's `tool_choice`: {"type": "auto" | "any" | "tool" | "none"}, "tool" with a
    "name", each with an optional disable_parallel_tool_use."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "none":
        return ToolChoice("none")
    if not tools:
        raise bad_request("tool_choice needs tools.", "tool_choice")
    if kind == "auto":
        return ToolChoice("auto", parallel=parallel)
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request('tool_choice of type "tool" needs a name.', "tool_choice.name")
        return ToolChoice("required", _known(name, tools, "tool_choice.name"), parallel=False)
    raise bad_request('tool_choice.type must be "auto", "any", "tool" or "none".',
                      "tool_choice.type")


def _known(name: str, tools: list[ToolSpec], param: str) -> str:
    if name not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools.", param)
    return name


@dataclass(frozen=True)
class CallReading:
    """How one turn's tool calls are read back out of the text: the family's format, at most
    how many (parallel calls off: one), arguments streamed as generated (only for a forced
    call, whose grammar keeps an announced call from turning out malformed) or each call
    whole, and which calls count (`call_check`)."""

    family: str
    max_calls: int | None
    incremental: bool
    accept: CallCheck

    def parse(self, text: str) -> ParsedOutput:
        parsed = parse_tool_calls(text, self.family, self.accept)
        return ParsedOutput(parsed.content, parsed.calls[: self.max_calls])

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.family, self.incremental, self.accept)

    def keeps(self, index: int) -> bool:
        """Whether the call of this index is sent (calls past max_calls are dropped)."""
        return self.max_calls is None or index < self.max_calls


def call_reading(tools: list[ToolSpec], choice: ToolChoice, family: str,
                 grammars: GrammarCompiler) -> CallReading | None:
    """How a turn with these tools reads its calls; None when it reads none (no tools, or
    tool_choice none)."""
    if choice.mode == "none":
        return None
    return CallReading(family, None if choice.parallel else 1, choice.forced,
                       call_check(tools, grammars))


def call_check(tools: list[ToolSpec], grammars: GrammarCompiler) -> CallCheck:
    """Which calls a free (tool_choice auto) reply may return: those to a declared tool, whose
    arguments, for a strict tool, are valid for its schema. Any other stays text. (A forced
    call's grammar allows only such calls.)"""
    by_name = {tool.name: tool for tool in tools}

    def accept(call: ToolCall) -> bool:
        tool = by_name.get(call.name)
        if tool is None:
            return False
        # The model's own spacing is fine here: only the forced grammar writes compact JSON.
        schema = {**_closed(tool.parameters), "x-guidance": {"whitespace_flexible": True}}
        return not tool.strict or grammars.matches(StructuredOutputsParams(json=schema),
                                                   call.arguments)

    return accept


# Compact JSON: a small model left free whitespace inside a call spends tokens on it.
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema with no properties beyond those declared, unless it says
    otherwise (as OpenAI's strict function calling): left open, a small model copies schema
    keywords into the arguments and runs on."""
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def _call_schema(tool: ToolSpec, arguments_key: str) -> dict[str, Any]:
    # Properties in this order are generated in this order: the name first, so a stream can
    # announce the call before its arguments.
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, arguments_key: _closed(tool.parameters)},
            "required": ["name", arguments_key], "additionalProperties": False}


Constraint = tuple[StructuredOutputsParams, str]  # and the request field that asked for it


def turn_constraint(formats: list[Constraint], tools: list[ToolSpec], choice: ToolChoice,
                    family: str, none_choice: str) -> Constraint | None:
    """The one constraint on a turn's output: the format the client asked for (`formats`,
    each with its field), or the grammar of a forced call. 400 when two formats are set, or a
    format meets tools the model may call (it could then never call them); `none_choice` is
    the API's way to write tool_choice none, for that message."""
    if len(formats) > 1:
        raise bad_request(f"{formats[0][1]} and {formats[1][1]} both constrain the output; "
                          "set one.", formats[1][1])
    if formats:
        field = formats[0][1]
        if choice.mode != "none":
            raise bad_request(f"{field} cannot be combined with tools unless tool_choice is "
                              f"{none_choice} (a constrained answer cannot also be a tool "
                              "call).", field)
        return formats[0]
    if choice.forced:
        return forced_call_grammar(tools, choice, family), "tool_choice"
    return None


def forced_call_grammar(tools: list[ToolSpec], choice: ToolChoice,
                        family: str) -> StructuredOutputsParams:
    """The grammar of a turn that is tool calls only: one call (or, with `parallel`, one or
    more) to the chosen tool or any of `tools`, in `family`'s format (`parsers.PARSERS`)."""
    assert choice.forced
    candidates = [t for t in tools if choice.name in (None, t.name)]
    key = "parameters" if family == "llama3_json" else "arguments"
    schemas = [_call_schema(t, key) for t in candidates]
    call = {**_COMPACT, **(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})}
    call_json = "%json " + json.dumps(call, sort_keys=False)
    if family == "smollm2":
        items = 'call ("," call)*' if choice.parallel else "call"
        lark = f'start: "<tool_call>[" {items} "]</tool_call>"\ncall: {call_json}\n'
    elif family == "llama3_json":
        calls = 'call (";" call)*' if choice.parallel else "call"
        lark = f"start: {calls}\ncall: {call_json}\n"
    else:
        calls = 'call ("\\n" call)*' if choice.parallel else "call"
        lark = f'start: {calls}\ncall: "<tool_call>" {call_json} "</tool_call>"\n'
    return StructuredOutputsParams(grammar=lark)
