"""Findings: cache-buster occurrences per request, grouped into one finding per cause and
place, each with the tokens it costs and a one-line fix.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.lint.repairs import Repair
from radixserve.provider_caching.preambles import KNOWN_PREAMBLES

Severity = Literal["error", "warning"]

KINDS: dict[str, str] = {
    "timestamp": "timestamp or date in the prefix",
    "request_id": "per-request id in the prefix",
    "key_order": "JSON key order changes between requests",
    "tool_list": "tool list differs between requests",
    "per_request_content": "per-request content before shared content",
    "client_preamble": "a client's per-request preamble before the whole prompt",
    "setting_change": "setting changed within a conversation",
    "template_rewrite": "the chat template rewrote an assistant turn (its reasoning left out)",
    "volatile_breakpoint": "breakpoint on a block that changes every request",
    "breakpoint_error": "cache_control the vendor rejects",
    "breakpoint_below_minimum": "breakpoint below the model's minimum cacheable length",
    "no_breakpoint": "no cache_control: nothing is cached",
    "fan_out": "identical prefixes sent concurrently (all miss)",
}


@dataclass(frozen=True)
class Instance:
    """One cache-buster in one request (`request` is its index in the corpus)."""

    kind: str
    request: int
    location: str  # file:line of the request
    tier: str | None = None
    path: str | None = None
    line_in_block: int | None = None
    char_offset: int | None = None
    tokens_lost: int = 0
    detail: str = ""
    subject: str = ""  # what the fix talks about ("the date", "reasoning_effort")
    repair: Repair | None = None
    # The same fix for the earlier request this one was compared with (it has the same buster
    # but, being first, no instance of its own).
    reference: int | None = None
    reference_repair: Repair | None = None
    reported: bool = True  # False: carries a repair for the simulator only
    severity: Severity = "warning"


@dataclass(frozen=True)
class Finding:
    """Instances of one cause at one place, with the mean tokens lost per affected request."""

    kind: str
    severity: Severity
    title: str
    location: str  # first affected request
    tier: str | None
    path: str | None
    line_in_block: int | None
    char_offset: int | None
    requests: int
    tokens_lost_per_request: int
    detail: str
    fix: str
    examples: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "examples": list(self.examples)}


def group_findings(instances: Sequence[Instance]) -> list[Finding]:
    """One finding per (kind, path, line, subject), ordered by tokens lost in total."""
    groups: dict[tuple[Any, ...], list[Instance]] = defaultdict(list)
    for inst in instances:
        if inst.reported:
            groups[(inst.kind, inst.path, inst.line_in_block, inst.subject)].append(inst)
    findings = []
    for (kind, path, line, _), members in groups.items():
        first = members[0]
        lost = round(sum(m.tokens_lost for m in members) / len(members))
        findings.append(Finding(
            kind=kind, severity=first.severity, title=KINDS[kind], location=first.location,
            tier=first.tier, path=path, line_in_block=line, char_offset=first.char_offset,
            requests=len({m.request for m in members}), tokens_lost_per_request=lost,
            detail=first.detail, fix=fix_text(first, lost),
            examples=tuple(dict.fromkeys(m.location for m in members))[:5],
        ))
    findings.sort(key=lambda f: (f.severity != "error", -f.tokens_lost_per_request * f.requests))
    return findings


def _where(inst: Instance) -> str:
    if inst.path is None:
        return "the prompt"
    return f"{inst.path} line {inst.line_in_block}" if inst.line_in_block else inst.path


def _gain(lost: int) -> str:
    return f": +{lost:,} cached tokens per request" if lost else ""


_FIXES: dict[str, Callable[[Instance], str]] = {
    "timestamp": lambda i: f"move {i.subject or 'the date'} from {_where(i)} to the last user message",
    "request_id": lambda i: f"move {i.subject or 'the id'} from {_where(i)} to the last user "
                            "message, or into request metadata",
    "key_order": lambda i: f"serialise the JSON at {_where(i)} with sorted keys "
                           "(json.dumps(..., sort_keys=True))",
    "tool_list": lambda i: "send one fixed tool list, sorted by name, with every request and "
                           "restrict use with tool_choice instead",
    "per_request_content": lambda i: f"move the per-request text at {_where(i)} after the shared "
                                     "content (into the last user message)",
    "client_preamble": lambda i: f"{i.subject} sends this line, changed on every request, "
                                 f"before the whole prompt ({_where(i)}): serve with radixserve, "
                                 "which takes it out (--strip-preambles, on by default), or "
                                 f"{_client_fix(i.subject)}",
    "setting_change": lambda i: f"keep {i.subject} fixed for the whole conversation "
                                "(start a new conversation to change it)",
    "template_rewrite": lambda i: "send each assistant turn's reasoning_content back (the "
                                  "template renders it then), or "
                                  "serve with radixserve, whose --next-turn-prefill (on by "
                                  "default) prefills the history as the template rewrites it",
    "volatile_breakpoint": lambda i: f"add a breakpoint at the end of {i.subject}, the last "
                                     "block before the part that changes",
    "breakpoint_error": lambda i: "fix the cache_control markers; the vendor answers 400: "
                                  f"{i.detail}",
    "breakpoint_below_minimum": lambda i: f"drop the breakpoint at {_where(i)} or move it "
                                          f"later ({i.detail})",
    "no_breakpoint": lambda i: 'add top-level "cache_control": {"type": "ephemeral"} '
                               "(automatic caching) or a breakpoint after the shared prefix",
    "fan_out": lambda i: "send one request first and the rest after its first token (or "
                         "pre-warm with max_tokens: 0)",
}


def _client_fix(client: str) -> str:
    return next((p.client_fix for p in KNOWN_PREAMBLES if p.client == client),
                "stop the client sending it")


def fix_text(inst: Instance, lost: int) -> str:
    return _FIXES[inst.kind](inst) + _gain(lost)
