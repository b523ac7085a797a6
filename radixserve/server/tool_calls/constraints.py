"""How an OpenAI-style request asks for structured output, read into one
`StructuredOutputsParams`: chat's `response_format` (OpenAI's json_object and json_schema, what
`client.chat.completions.parse(response_format=Model)` sends), and on both routes vLLM's
`structured_outputs` object and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields. One request sets at most one of them.
"""

from __future__ import annotations

from typing import Any

from radixserve.sampling_params import SamplingParamError, StructuredOutputsParams
from radixserve.server.errors import bad_request
from radixserve.server.transport import StrictModel

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


class ConstraintFields(StrictModel):
    """The request fields (vLLM's extensions) that constrain the output on both routes."""

    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def extension_constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """The constraint these fields ask for, with the field's name; 400 when several are
        set or one is malformed."""
        found: list[tuple[StructuredOutputsParams, str]] = []
        for field, key in _GUIDED.items():
            value = getattr(self, field)
            if value is not None:
                found.append((_params({key: value}, field), field))
        if self.structured_outputs is not None:
            unknown = sorted(set(self.structured_outputs) - set(_STRUCTURED_KEYS))
            if unknown:
                raise bad_request(f"structured_outputs.{unknown[0]} is not supported (supported:"
                                  f" {', '.join(_STRUCTURED_KEYS)}).", "structured_outputs")
            found.append((_params(self.structured_outputs, "structured_outputs"),
                          "structured_outputs"))
        if len(found) > 1:
            raise bad_request(f"{found[0][1]} and {found[1][1]} both constrain the output; set "
                              "one.", found[1][1])
        return found[0] if found else None


def _params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except SamplingParamError as exc:
        raise bad_request(f"{param}: {exc.problem}.", param) from None
    except TypeError as exc:
        raise bad_request(f"{param} is malformed: {exc}.", param) from None


def response_format_constraint(response_format: dict[str, Any] | None
                               ) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
    or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}. The schema is
    enforced whether or not `strict` is set: a schema asked for is a schema delivered."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request('response_format json_schema needs {"name": ..., "schema": {...}}.',
                              "response_format.json_schema")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object.",
                              "response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema)
    raise bad_request('response_format.type must be "text", "json_object" or "json_schema".',
                      "response_format.type")
