"""Benchmark workloads: requests with exact token lengths and a known sharing structure,
deterministic from a seed. A request may depend on an earlier one (the next turn of a chat, the
next step of an agent); the load generator sends it once that one has returned.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from radixserve.bench.textgen import WordBank
from radixserve.model.tokenizer import ChatTokenizer

Message = dict[str, str]


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Lengths are in tokens of the served model's tokenizer."""

    name: str
    num_prompts: int = 32  # single-turn: requests; multi-turn: conversations; agent: tasks
    prefix_len: int | None = None  # shared system prompt; None: the workload's default
    suffix_len: int = 32  # the question, suffix, user turn or tool result
    num_prefixes: int = 4  # distinct system prompts (shared-prefix, prefix-repetition, ...)
    num_turns: int = 3  # multi-turn: turns per conversation; agent: depth of the tree
    branching: int = 2  # agent: children of each step
    num_tenants: int = 2  # salted: tenants sending the same prompts
    output_len: int = 32  # max_tokens of every request
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; known: {', '.join(WORKLOADS)}")
        for name in ("num_prompts", "suffix_len", "num_prefixes", "num_turns", "branching",
                     "num_tenants", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prefix_len is not None and self.prefix_len < 1:
            raise ValueError("prefix_len must be >= 1")

    @property
    def system_len(self) -> int:
        return self.prefix_len if self.prefix_len is not None else WORKLOADS[self.name].prefix_len


@dataclass(frozen=True)
class BenchRequest:
    """One request. Its conversation is its parent's (plus the parent's actual reply when
    `include_parent_reply`) followed by `messages`."""

    index: int
    messages: tuple[Message, ...]
    max_tokens: int
    parent: int | None = None
    include_parent_reply: bool = False
    cache_salt: str | None = None
    group: str = ""  # the shared part it uses, e.g. "prefix-2"; for reports and tests


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    description: str
    requests: tuple[BenchRequest, ...]
    children: Mapping[int, tuple[int, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        kids: dict[int, list[int]] = {}
        for position, request in enumerate(self.requests):
            assert request.index == position, "requests are indexed by position"
            if request.parent is not None:
                assert request.parent < position, "a parent comes before its children"
                kids.setdefault(request.parent, []).append(position)
        object.__setattr__(self, "children", {k: tuple(v) for k, v in kids.items()})

    @property
    def roots(self) -> list[int]:
        return [r.index for r in self.requests if r.parent is None]

    def conversation(self, index: int, replies: Mapping[int, str]) -> list[Message]:
        """The full message list of request `index`, given the replies its ancestors got."""
        chain = []
        cursor: int | None = index
        while cursor is not None:
            chain.append(self.requests[cursor])
            cursor = self.requests[cursor].parent
        messages: list[Message] = []
        for request in reversed(chain):
            if request.include_parent_reply:
                assert request.parent is not None
                messages.append({"role": "assistant", "content": replies[request.parent]})
            messages.extend(request.messages)
        return messages


@dataclass(frozen=True)
class _Generator:
    build: Callable[[WorkloadSpec, WordBank, random.Random], tuple[str, list[BenchRequest]]]
    prefix_len: int  # default length of the shared system prompt
    summary: str  # one line for --help


def build_workload(spec: WorkloadSpec, tokenizer: ChatTokenizer) -> Workload:
    """Generates `spec` with words that are single tokens of `tokenizer`."""
    bank = WordBank.from_tokenizer(tokenizer)
    # The same seed draws the same prompts in every workload of the shared-prefix family, so a
    # trap and its baseline differ only by the trap.
    rng = random.Random(spec.seed)
    description, requests = WORKLOADS[spec.name].build(spec, bank, rng)
    return Workload(spec, description, tuple(requests))


def _texts(bank: WordBank, rng: random.Random, count: int, num_tokens: int) -> list[str]:
    if count <= len(bank.words):
        return bank.distinct_texts(rng, count, num_tokens)
    return [bank.text(rng, num_tokens) for _ in range(count)]


def _single_turn(spec: WorkloadSpec, pairs: list[tuple[str, str, str]]) -> list[BenchRequest]:
    return [
        BenchRequest(
            index=i,
            messages=({"role": "system", "content": system}, {"role": "user", "content": user}),
            max_tokens=spec.output_len,
            group=group,
        )
        for i, (system, user, group) in enumerate(pairs)
    ]


def _shared_pairs(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> list[tuple[str, str, str]]:
    prefixes = _texts(bank, rng, spec.num_prefixes, spec.system_len)
    questions = _texts(bank, rng, spec.num_prompts, spec.suffix_len)
    return [(prefixes[i % spec.num_prefixes], q, f"prefix-{i % spec.num_prefixes}")
            for i, q in enumerate(questions)]


def _shared_prefix(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    description = (
        f"{spec.num_prefixes} system prompts of {spec.system_len} tokens, used in turn by "
        f"{spec.num_prompts} requests, each with its own {spec.suffix_len}-token question"
    )
    return description, _single_turn(spec, _shared_pairs(spec, bank, rng))


def _trap_timestamp(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    pairs = _shared_pairs(spec, bank, rng)
    start = datetime(2025, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=rng.randrange(10**7))
    stamped = []
    for i, (system, user, group) in enumerate(pairs):
        now = start + timedelta(milliseconds=1370 * i)
        stamped.append((f"Current time: {now.isoformat(timespec='milliseconds')}\n{system}",
                        user, group))
    description = (
        "shared-prefix with the current time written at the front of the system prompt, "
        "so every request's prompt differs from its first few tokens"
    )
    return description, _single_turn(spec, stamped)


def _trap_short_prefix(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    _, requests = _shared_prefix(spec, bank, rng)
    description = (
        f"shared-prefix whose system prompts are only {spec.system_len} tokens: below a "
        "block-hash cache's block size or a vendor's minimum cacheable prompt"
    )
    return description, requests


def _tool_schemas(bank: WordBank, rng: random.Random, count: int = 4) -> list[dict[str, Any]]:
    tools = []
    for _ in range(count):
        args = rng.sample(bank.words, 3)
        tools.append({
            "type": "function",
            "function": {
                "name": "_".join(rng.sample(bank.words, 2)),
                "description": bank.text(rng, 12),
                "parameters": {
                    "type": "object",
                    "properties": {a: {"type": "string", "description": bank.text(rng, 6)}
                                   for a in args},
                    "required": args[:2],
                },
            },
        })
    return tools


def _shuffled_keys(value: Any, rng: random.Random) -> Any:
    # The same schema with every object's keys in a fresh order, as a client that builds its
    # tool list from an unordered source would serialise it.
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled_keys(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled_keys(v, rng) for v in value]
    return value


def _tools_system(tools: list[dict[str, Any]], instructions: str) -> str:
    return f"You can call these tools:\n{json.dumps(tools)}\n{instructions}"


def _tools_sorted(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random, shuffle: bool = False
) -> tuple[str, list[BenchRequest]]:
    pairs = _shared_pairs(spec, bank, rng)
    tools = _tool_schemas(bank, rng)
    canonical = json.loads(json.dumps(tools, sort_keys=True))
    order_rng = random.Random(spec.seed + 1)
    rendered = []
    for system, user, group in pairs:
        schema = _shuffled_keys(copy.deepcopy(tools), order_rng) if shuffle else canonical
        rendered.append((_tools_system(schema, system), user, group))
    if shuffle:
        description = ("tools-sorted with the JSON keys of the tool schemas in a different "
                       "order in every request (same schemas, different tokens)")
    else:
        description = (f"4 JSON tool schemas with sorted keys, then one of {spec.num_prefixes} "
                       f"{spec.system_len}-token instructions, in the system prompt of "
                       f"{spec.num_prompts} requests with {spec.suffix_len}-token questions")
    return description, _single_turn(spec, rendered)


def _trap_unsorted_tools(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    return _tools_sorted(spec, bank, rng, shuffle=True)


def _unique(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    systems = _texts(bank, rng, spec.num_prompts, spec.system_len)
    questions = [bank.text(rng, spec.suffix_len) for _ in range(spec.num_prompts)]
    description = (f"{spec.num_prompts} requests sharing nothing but the chat template: "
                   f"{spec.system_len}-token system prompt and {spec.suffix_len}-token question")
    return description, _single_turn(
        spec, [(s, q, f"unique-{i}") for i, (s, q) in enumerate(zip(systems, questions, strict=True))])


def _identical(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    system, question = bank.text(rng, spec.system_len), bank.text(rng, spec.suffix_len)
    description = (f"{spec.num_prompts} copies of one prompt ({spec.system_len}-token system "
                   f"prompt, {spec.suffix_len}-token question); sent at once, they test "
                   "whether an engine computes a shared prefill once or N times")
    return description, _single_turn(spec, [(system, question, "identical")] * spec.num_prompts)


def _prefix_repetition(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    per_prefix = max(1, spec.num_prompts // spec.num_prefixes)
    prefixes = _texts(bank, rng, spec.num_prefixes, spec.system_len)
    suffixes = _texts(bank, rng, spec.num_prefixes * per_prefix, spec.suffix_len)
    pairs = [(prefixes[i // per_prefix], s, f"prefix-{i // per_prefix}")
             for i, s in enumerate(suffixes)]
    rng.shuffle(pairs)
    description = (f"{spec.num_prefixes} prefixes of {spec.system_len} tokens x {per_prefix} "
                   f"suffixes of {spec.suffix_len} tokens, shuffled; make prefixes x prefix "
                   "length exceed the KV pool to force eviction")
    return description, _single_turn(spec, pairs)


def _salted(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    pairs = _shared_pairs(spec, bank, rng)
    salts = [f"tenant-{t}-{rng.getrandbits(128):032x}" for t in range(spec.num_tenants)]
    requests = []
    # Tenant t's copy follows tenant t-1's at once: the case where sharing across tenants would
    # be most tempting and must not happen.
    for system, user, group in pairs:
        for t, salt in enumerate(salts):
            requests.append(BenchRequest(
                index=len(requests),
                messages=({"role": "system", "content": system}, {"role": "user", "content": user}),
                max_tokens=spec.output_len,
                cache_salt=salt,
                group=f"{group}/tenant-{t}",
            ))
    description = (f"shared-prefix ({spec.num_prompts} prompts) sent once by each of "
                   f"{spec.num_tenants} tenants with their own cache_salt: hits only within a tenant")
    return description, requests


def _multi_turn(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    systems = _texts(bank, rng, spec.num_prefixes, spec.system_len)
    requests: list[BenchRequest] = []
    for session in range(spec.num_prompts):
        parent = None
        for _ in range(spec.num_turns):
            user = {"role": "user", "content": bank.text(rng, spec.suffix_len)}
            system = {"role": "system", "content": systems[session % spec.num_prefixes]}
            requests.append(BenchRequest(
                index=len(requests),
                messages=(system, user) if parent is None else (user,),
                max_tokens=spec.output_len,
                parent=parent,
                include_parent_reply=parent is not None,
                group=f"conversation-{session}",
            ))
            parent = requests[-1].index
    description = (f"{spec.num_prompts} conversations of {spec.num_turns} turns; each turn "
                   f"adds a {spec.suffix_len}-token user message after the reply the server "
                   f"actually gave; {spec.num_prefixes} system prompts of {spec.system_len} tokens")
    return description, requests


def _agent(
    spec: WorkloadSpec, bank: WordBank, rng: random.Random
) -> tuple[str, list[BenchRequest]]:
    tools = _tool_schemas(bank, rng)
    system = {"role": "system",
              "content": _tools_system(json.loads(json.dumps(tools, sort_keys=True)),
                                       bank.text(rng, spec.system_len))}
    requests: list[BenchRequest] = []
    calls = 0
    for task in range(spec.num_prompts):
        root = BenchRequest(
            index=len(requests),
            messages=(system, {"role": "user", "content": bank.text(rng, spec.suffix_len)}),
            max_tokens=spec.output_len,
            group=f"task-{task}",
        )
        requests.append(root)
        frontier = [root.index]
        for _ in range(spec.num_turns - 1):
            next_frontier = []
            for parent in frontier:
                for _ in range(spec.branching):
                    tool = rng.choice(tools)["function"]
                    arg = rng.choice(list(tool["parameters"]["properties"]))
                    call = json.dumps({"name": tool["name"], "arguments": {arg: bank.text(rng, 3)}})
                    calls += 1
                    step = (
                        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                        {"role": "tool", "tool_call_id": f"call_{calls}",
                         "content": bank.text(rng, spec.suffix_len)},
                    )
                    requests.append(BenchRequest(
                        index=len(requests), messages=step, max_tokens=spec.output_len,
                        parent=parent, group=f"task-{task}",
                    ))
                    next_frontier.append(requests[-1].index)
            frontier = next_frontier
    description = (f"{spec.num_prompts} agent tasks replayed as trees of depth {spec.num_turns} "
                   f"and branching {spec.branching}: each step appends a recorded tool call and "
                   f"a {spec.suffix_len}-token tool result to its parent's history; one shared "
                   f"system prompt with 4 tool schemas and {spec.system_len} tokens of instructions")
    return description, requests


WORKLOADS: dict[str, _Generator] = {
    "shared-prefix": _Generator(_shared_prefix, 256, "K system prompts of L tokens, many questions"),
    "unique": _Generator(_unique, 256, "nothing shared but the chat template"),
    "prefix-repetition": _Generator(
        _prefix_repetition, 256, "N prefixes x suffixes, shuffled (eviction stress)"),
    "multi-turn": _Generator(_multi_turn, 128, "conversations growing turn by turn"),
    "agent": _Generator(_agent, 128, "branching tool-call histories"),
    "salted": _Generator(_salted, 256, "shared-prefix under several cache_salt tenants"),
    "identical": _Generator(_identical, 256, "N copies of one prompt"),
    "tools-sorted": _Generator(_tools_sorted, 64, "tool schemas (sorted JSON) in the system prompt"),
    "trap-timestamp": _Generator(_trap_timestamp, 256, "timestamp at the front of the system prompt"),
    "trap-unsorted-tools": _Generator(
        _trap_unsorted_tools, 64, "tool schemas whose JSON key order changes per request"),
    "trap-short-prefix": _Generator(_trap_short_prefix, 8, "shared prefix below the minimum"),
}


def with_defaults(spec: WorkloadSpec) -> WorkloadSpec:
    """`spec` with its workload's default prefix length filled in (for the record)."""
    return replace(spec, prefix_len=spec.system_len)
