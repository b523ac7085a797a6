"""Each workload's exact token lengths and sharing structure, with the default model's real
tokenizer: who shares which prefix with whom is what the hit rates are judged against."""

from __future__ import annotations

import json
import random
from itertools import combinations

import pytest

from radixserve.bench.textgen import WordBank
from radixserve.bench.workloads import Workload, WorkloadSpec, build_workload
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.sequences import common_prefix_len

pytestmark = [pytest.mark.model]

# "<|im_start|>system\n": the tokens every chat prompt of this template starts with.
TEMPLATE_HEAD = 3


def _ids(
    tokenizer: ChatTokenizer, workload: Workload, index: int, replies: dict[int, str] | None = None
) -> list[int]:
    return tokenizer.encode_chat(workload.conversation(index, replies or {}))


def _count(tokenizer: ChatTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_word_bank_text_has_exact_length(tokenizer: ChatTokenizer) -> None:
    bank = WordBank.from_tokenizer(tokenizer)
    rng = random.Random(7)
    for n in (1, 2, 17, 300):
        text = bank.text(rng, n)
        assert _count(tokenizer, text) == n
        # Also inside a rendered prompt: after the template's newline it costs the same.
        alone = tokenizer.encode_chat([{"role": "user", "content": "x"}])
        inside = tokenizer.encode_chat([{"role": "user", "content": text}])
        assert len(inside) - len(alone) == n - 1


def test_shared_prefix_lengths_and_sharing(tokenizer: ChatTokenizer) -> None:
    spec = WorkloadSpec(
        "shared-prefix", num_prompts=8, prefix_len=40, suffix_len=12, num_prefixes=3, output_len=4
    )
    w = build_workload(spec, tokenizer)
    assert len(w.requests) == 8 and all(r.max_tokens == 4 for r in w.requests)
    for r in w.requests:
        system, user = r.messages
        assert _count(tokenizer, system["content"]) == 40
        assert _count(tokenizer, user["content"]) == 12
    ids = [_ids(tokenizer, w, i) for i in range(8)]
    # The prefix, through the system turn's end and the user turn's opening tokens.
    shared = (
        len(
            tokenizer.encode_chat(
                [
                    {"role": "system", "content": w.requests[0].messages[0]["content"]},
                    {"role": "user", "content": ""},
                ],
                add_generation_prompt=False,
            )
        )
        - 2
    )
    for a, b in combinations(range(8), 2):
        lcp = common_prefix_len(ids[a], ids[b])
        if w.requests[a].group == w.requests[b].group:
            assert w.requests[a].group == f"prefix-{a % 3}"
            assert lcp == shared  # questions start with distinct words
        else:
            assert lcp == TEMPLATE_HEAD


def test_unique_shares_only_the_template(tokenizer: ChatTokenizer) -> None:
    w = build_workload(
        WorkloadSpec("unique", num_prompts=6, prefix_len=20, suffix_len=5), tokenizer
    )
    ids = [_ids(tokenizer, w, i) for i in range(6)]
    assert all(len(x) == len(ids[0]) for x in ids)
    assert all(common_prefix_len(a, b) == TEMPLATE_HEAD for a, b in combinations(ids, 2))


def test_prefix_repetition_is_prefixes_times_suffixes_shuffled(tokenizer: ChatTokenizer) -> None:
    w = build_workload(
        WorkloadSpec(
            "prefix-repetition", num_prompts=12, prefix_len=30, suffix_len=6, num_prefixes=3
        ),
        tokenizer,
    )
    groups = [r.group for r in w.requests]
    assert sorted(groups) == sorted(f"prefix-{p}" for p in range(3) for _ in range(4))
    assert groups != sorted(groups)  # shuffled, not prefix after prefix
    systems = {r.group: r.messages[0]["content"] for r in w.requests}
    assert len(set(systems.values())) == 3
    assert all(_count(tokenizer, s) == 30 for s in systems.values())


def test_multi_turn_history_grows_with_the_actual_replies(tokenizer: ChatTokenizer) -> None:
    w = build_workload(
        WorkloadSpec("multi-turn", num_prompts=2, prefix_len=16, suffix_len=8, num_turns=3),
        tokenizer,
    )
    assert len(w.requests) == 6 and w.roots == [0, 3]
    replies = {i: f"reply number {i}" for i in range(6)}
    for r in w.requests:
        conversation = w.conversation(r.index, replies)
        assert len(conversation) == 2 + 2 * (r.index % 3)
        if r.parent is not None:
            assert r.include_parent_reply and r.parent == r.index - 1
            assert conversation[-2] == {"role": "assistant", "content": replies[r.parent]}
            parent, child = (
                _ids(tokenizer, w, r.parent, replies),
                _ids(tokenizer, w, r.index, replies),
            )
            # The whole previous prompt is a prefix of the next: a radix cache reuses all of it.
            assert child[: len(parent)] == parent
            markers = _count(
                tokenizer, "<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
            )
            assert len(child) - len(parent) == _count(tokenizer, replies[r.parent]) + 8 + markers


def test_agent_tree_branches_from_shared_histories(tokenizer: ChatTokenizer) -> None:
    w = build_workload(
        WorkloadSpec("agent", num_prompts=2, prefix_len=16, suffix_len=8, num_turns=3, branching=2),
        tokenizer,
    )
    assert len(w.requests) == 2 * (1 + 2 + 4)
    assert len(w.roots) == 2
    ids = {r.index: _ids(tokenizer, w, r.index) for r in w.requests}
    system = w.requests[0].messages[0]["content"]
    tools = json.loads(system.split("\n")[1])
    assert len(tools) == 4
    for r in w.requests:
        if r.parent is None:
            assert r.messages[0]["content"] == system  # one system prompt for every task
            continue
        assert not r.include_parent_reply  # the recorded tool call is replayed instead
        assert r.messages[0]["role"] == "assistant" and "<tool_call>" in r.messages[0]["content"]
        assert r.messages[1]["role"] == "tool"
        assert _count(tokenizer, r.messages[1]["content"]) == 8
        parent = ids[r.parent]
        assert ids[r.index][: len(parent)] == parent
    for parent, kids in w.children.items():
        assert len(kids) == 2
        a, b = (ids[k] for k in kids)
        assert common_prefix_len(a, b) >= len(ids[parent])


def test_salted_sends_each_prompt_once_per_tenant(tokenizer: ChatTokenizer) -> None:
    w = build_workload(
        WorkloadSpec("salted", num_prompts=4, prefix_len=16, suffix_len=4, num_tenants=3), tokenizer
    )
    assert len(w.requests) == 12
    salts = [r.cache_salt for r in w.requests]
    assert len(set(salts)) == 3 and salts[:3] == salts[3:6]
    for i in range(0, 12, 3):
        assert w.requests[i].messages == w.requests[i + 1].messages == w.requests[i + 2].messages


def test_identical(tokenizer: ChatTokenizer) -> None:
    w = build_workload(
        WorkloadSpec("identical", num_prompts=4, prefix_len=10, suffix_len=3), tokenizer
    )
    assert len({json.dumps(r.messages) for r in w.requests}) == 1


def test_traps_change_only_what_they_claim(tokenizer: ChatTokenizer) -> None:
    spec = dict(num_prompts=4, prefix_len=24, suffix_len=6, num_prefixes=1)
    base = build_workload(WorkloadSpec("shared-prefix", **spec), tokenizer)
    stamped = build_workload(WorkloadSpec("trap-timestamp", **spec), tokenizer)
    for b, s in zip(base.requests, stamped.requests, strict=True):
        head, _, rest = s.messages[0]["content"].partition("\n")
        assert head.startswith("Current time: 20") and rest == b.messages[0]["content"]
        assert s.messages[1] == b.messages[1]
    ids = [_ids(tokenizer, stamped, i) for i in range(4)]
    stamp_line = _count(tokenizer, stamped.requests[0].messages[0]["content"].partition("\n")[0])
    # Requests 1.37 s apart share the timestamp's leading digits, never the whole line.
    assert (
        max(common_prefix_len(a, b) for a, b in combinations(ids, 2)) < TEMPLATE_HEAD + stamp_line
    )

    tools = build_workload(WorkloadSpec("tools-sorted", **spec), tokenizer)
    shuffled = build_workload(WorkloadSpec("trap-unsorted-tools", **spec), tokenizer)
    texts = [r.messages[0]["content"] for r in shuffled.requests]
    sorted_text = tools.requests[0].messages[0]["content"]
    assert all(r.messages[0]["content"] == sorted_text for r in tools.requests)
    assert len(set(texts)) == 4
    for text in texts:  # the same schemas, only serialised in another key order
        assert json.loads(text.split("\n")[1]) == json.loads(sorted_text.split("\n")[1])

    short = build_workload(WorkloadSpec("trap-short-prefix", num_prompts=2), tokenizer)
    assert _count(tokenizer, short.requests[0].messages[0]["content"]) == 8


def test_deterministic_from_seed(tokenizer: ChatTokenizer) -> None:
    def make(seed: int) -> Workload:
        return build_workload(WorkloadSpec("agent", num_prompts=1, seed=seed), tokenizer)

    assert make(3).requests == make(3).requests
    assert make(3).requests != make(4).requests


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec("nope")
    with pytest.raises(ValueError, match="num_prompts"):
        WorkloadSpec("unique", num_prompts=0)
