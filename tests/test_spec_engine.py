"""Speculative decoding in the engine, on the default (quantized) model: greedy output with
speculation is plain decoding's, token for token (with logprobs, stops and max_tokens acting on
accepted tokens only), under batching, chunked prefill, pages of 4, cache hits and the disk
tier; drafts never carry another tenant's text; constrained requests speculate under their
grammar and keep plain constrained decoding's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve import LLM, SamplingParams
from radixserve.sampling_params import StructuredOutputsParams

pytestmark = [pytest.mark.model]

SOURCE = (Path(__file__).resolve().parent.parent / "radixserve/engine/speculative/verify.py"
          ).read_text()[:700]
PROMPTS = [
    f"Copy this file exactly:\n{SOURCE}\nThe copy:\n",
    "List the numbers: one two three four five one two three four five one two three",
    "Write a short greeting.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 32-token steps chunk the prompts; pages of 4 make a rejected draft's pages go back.
    return LLM(kv_cache_tokens=4096, page_size=4, max_num_batched_tokens=32,
               show_progress=False, debug_invariants=True)


def _params(speculative: str, **extra) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=24, temperature=0, speculative=speculative, logprobs=2,
                           **extra),
            SamplingParams(max_tokens=17, temperature=0, speculative=speculative,
                           stop=[" four five one"]),
            SamplingParams(max_tokens=9, temperature=0, speculative=speculative)]


def _summary(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].logprobs) for o in outputs]


def test_greedy_speculation_equals_plain_decoding(llm: LLM) -> None:
    counters = llm.engine.speculation.counters
    cold = _summary(llm.generate(PROMPTS, _params("suffix")))  # no cache hits yet
    accepted = counters.accepted_tokens
    plain = _summary(llm.generate(PROMPTS, _params("off")))
    hit = _summary(llm.generate(PROMPTS, _params("ngram")))  # prompts and outputs cached
    assert cold == plain and hit == plain
    assert accepted > 0 and counters.accepted_tokens > accepted  # drafts were really kept
    assert plain[1][2] == "stop" and plain[2][2] == "length"
    stats = llm.pool_stats()
    assert stats.balanced and stats.private == 0 and stats.protected == 0


def test_drafts_never_carry_another_tenants_text(llm: LLM, monkeypatch) -> None:
    seen: dict[str, set[int]] = {}
    drafts: dict[str, list[list[int]]] = {}
    suffix = llm.engine.speculation.suffix
    original = suffix.propose

    def spy(request, k):
        draft = original(request, k)
        tenant = request.namespace[1]
        seen.setdefault(tenant, set()).update(request.token_ids)
        drafts.setdefault(tenant, []).append(draft)
        return draft

    monkeypatch.setattr(suffix, "propose", spy)
    secret = "The vault code is zebra quantum marmalade seven four eight one."
    ask = "Repeat after me: " + secret + " Again: " + secret + " Once more: The vault code is"
    params = SamplingParams(max_tokens=12, temperature=0, speculative="suffix")
    llm.generate([ask], params, cache_salt="tenant-a")
    probe = "Question: what is the vault code? Answer: The vault code is"
    llm.generate([probe], params, cache_salt="tenant-b")
    llm.generate([probe], params, cache_salt="tenant-a")
    only_a = seen["tenant-a"] - seen["tenant-b"]
    assert only_a and not any(set(d) & only_a for d in drafts["tenant-b"])
    # The same probe in tenant A's own namespace does draft from A's earlier output: the
    # instrument would have seen a leak.
    assert any(set(d) & only_a for d in drafts["tenant-a"][-12:])


def test_constrained_requests_speculate_under_their_grammar(llm: LLM) -> None:
    # The copy opens as the file does, then any text: drafts from the prompt fit the grammar,
    # and each verified position samples under the grammar's mask after the tokens before it.
    copy = StructuredOutputsParams(regex=r'"""Exact verification[\s\S]{0,300}')
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    counters = llm.engine.speculation.counters

    def run(speculative: str) -> list:
        return llm.generate(PROMPTS[:2], [
            SamplingParams(max_tokens=40, temperature=0, speculative=speculative,
                           structured_outputs=copy),
            SamplingParams(max_tokens=40, temperature=0.8, seed=3, speculative=speculative,
                           structured_outputs=StructuredOutputsParams(json=schema))])

    plain = run("off")
    accepted = counters.accepted_tokens
    speculated = run("suffix")
    assert counters.accepted_tokens > accepted  # drafts were verified and kept
    # Greedy: plain constrained decoding's output, token for token.
    assert speculated[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert speculated[0].outputs[0].text.startswith('"""Exact verification')
    # Sampled: whatever it drew, it is the grammar's.
    assert set(json.loads(speculated[1].outputs[0].text)) == {"name"}


def test_auto_needs_an_engine_that_measured_its_cost_model(llm: LLM) -> None:
    with pytest.raises(ValueError, match="auto"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, speculative="auto"))


def test_greedy_speculation_equals_plain_decoding_from_the_disk_tier(tmp_path) -> None:
    """After a restart the prompts' KV comes from the disk tier, and speculating on it gives
    plain decoding's tokens."""
    settings = dict(kv_cache_tokens=4096, page_size=4, max_num_batched_tokens=32,
                    kv_offload_dir=str(tmp_path), kv_offload_block_tokens=16,
                    show_progress=False, debug_invariants=True)
    with LLM(**settings) as writer:
        plain = _summary(writer.generate(PROMPTS, _params("off")))
        writer.engine.offload.store.flush()
    with LLM(**settings) as reader:
        spec = _summary(reader.generate(PROMPTS, _params("ngram")))
        assert reader.engine.scheduler.counters.kv_tier_hits > 0
        assert reader.engine.speculation.counters.accepted_tokens > 0
        stats = reader.pool_stats()
        assert stats.balanced and stats.private == 0 and stats.protected == 0
    assert spec == plain
