"""Speculation on a tiny random-weight float model: greedy output equals plain decoding's
(ngram and auto); sampled output keeps plain sampling's distribution (frequencies over many
seeds, top-k and top-p on) and a seeded request repeats; and a hypothesis state machine adds,
steps and aborts speculating requests in a pool small enough to evict and preempt, checking
after every move that slot accounting balances, that every key the radix tree was given is a
prefix of a sequence plain decoding produces (a rejected draft token never reaches it), and
that finished outputs equal plain decoding's."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from radixserve import LLM, SamplingParams
from tests.support.families import save_checkpoint

pytestmark = [pytest.mark.model]

MAX_TOKENS = 14


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    prompts = []
    for _ in range(4):
        motif = [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 7))]
        prompts.append([rng.randrange(100, 5000) for _ in range(5)] + motif * 4)
    return prompts


@pytest.fixture(scope="module")
def checkpoint(model_path, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512,
        tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny-spec"), model_path)


def _engine(checkpoint, **settings) -> LLM:
    return LLM(str(checkpoint), dtype="float32", show_progress=False, debug_invariants=True,
               **settings)


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_greedy_speculation_equals_plain_decoding_on_a_float_model(checkpoint, mode):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    plain = _engine(checkpoint, kv_cache_tokens=2048).generate(prompts, params)
    spec = _engine(checkpoint, kv_cache_tokens=2048, speculative=mode,
                   num_speculative_tokens=5)
    fast = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.speculation.counters.accepted_tokens > 0


def test_sampled_speculation_keeps_the_distribution(checkpoint):
    seeds = range(300)

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=4, temperature=0.6, top_k=3, top_p=0.95,
                              seed=seed, ignore_eos=True)

    plain = _engine(checkpoint, kv_cache_tokens=4096, prefix_cache="off")
    # The model repeats the prompt's motif often enough at this temperature that drafts are
    # sometimes right and sometimes not.
    prompt = {"prompt_token_ids": _prompts()[0]}
    spec = _engine(checkpoint, kv_cache_tokens=4096, prefix_cache="off", speculative="ngram",
                   num_speculative_tokens=3)
    want = [o.outputs[0].token_ids for o in plain.generate([prompt] * len(seeds),
                                                           [params(s) for s in seeds])]
    got = [o.outputs[0].token_ids for o in spec.generate([prompt] * len(seeds),
                                                         [params(s) for s in seeds])]
    counters = spec.engine.speculation.counters
    assert 0 < counters.accepted_tokens < counters.draft_tokens
    for position in range(1, 4):  # the first token comes from the prefill, never a draft
        a = Counter(t[position] for t in want)
        b = Counter(t[position] for t in got)
        for token in a.keys() | b.keys():
            # Two counts of one token: their difference's variance is about their sum.
            assert abs(a[token] - b[token]) <= 4.5 * (a[token] + b[token]) ** 0.5 + 2, (
                position, token, a, b)
    again = spec.generate([prompt] * 2, [params(11)] * 2)  # a seed repeats under one draft rule
    assert again[0].outputs[0].token_ids == again[1].outputs[0].token_ids


def test_speculation_never_publishes_an_unverified_token(checkpoint):
    prompts = _prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    reference = [p + o.outputs[0].token_ids for p, o in zip(prompts, _engine(
        checkpoint, kv_cache_tokens=2048).generate([{"prompt_token_ids": p} for p in prompts],
                                                    params), strict=True)]
    # 96 slots in pages of 2: requests of ~40 tokens plus drafts evict and preempt.
    llm = _engine(checkpoint, kv_cache_tokens=96, page_size=2, speculative="suffix",
                  num_speculative_tokens=4)
    engine = llm.engine
    inserted: list[list[int]] = []
    original_insert = engine.cache.insert

    def recording_insert(namespace, tokens, slots):
        inserted.append(list(tokens))
        return original_insert(namespace, tokens, slots)

    engine.cache.insert = recording_insert  # type: ignore[method-assign]

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[str, int] = {}  # request id -> prompt index
            self.count = 0

        @rule(which=st.integers(0, len(prompts) - 1))
        def add(self, which: int) -> None:
            request_id = f"r{self.count}"
            self.count += 1
            engine.add_request(prompts[which], params, request_id=request_id)
            self.live[request_id] = which

        @rule()
        def step(self) -> None:
            for output in engine.step():
                if output.finished:
                    which = self.live.pop(output.request_id)
                    assert prompts[which] + output.outputs[0].token_ids == reference[which]

        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            if self.live:
                request_id = data.draw(st.sampled_from(sorted(self.live)))
                engine.abort_request(request_id)
                del self.live[request_id]

        @invariant()
        def books_balance_and_the_tree_holds_verified_tokens(self) -> None:
            assert engine.pool_stats().balanced
            while inserted:
                key = inserted.pop()
                assert any(ref[: len(key)] == key for ref in reference), key
            for request in engine.scheduler.running:
                ref = next(r for r in reference if r[: len(request.prompt_token_ids)]
                           == request.prompt_token_ids)
                assert request.token_ids == ref[: request.num_tokens]

        def teardown(self) -> None:
            for request_id in list(self.live):
                engine.abort_request(request_id)
            stats = engine.pool_stats()
            assert stats.balanced and stats.private == 0 and stats.protected == 0, stats

    run_state_machine_as_test(Machine, settings=settings(
        max_examples=12, stateful_step_count=30, deadline=None))
    # The drawn moves need not overfill the pool, so one fixed round does: every prompt twice
    # at once (eight requests of ~40 tokens plus drafts in 96 slots) must preempt.
    preempted_before = engine.scheduler.counters.preemptions
    machine = Machine()
    for which in list(range(len(prompts))) * 2:
        machine.add(which)
    while machine.live:
        machine.step()
        machine.books_balance_and_the_tree_holds_verified_tokens()
    machine.teardown()
    counters = engine.speculation.counters
    # The moves really happened: drafts kept and drafts rejected, requests preempted.
    assert 0 < counters.accepted_tokens < counters.draft_tokens
    assert engine.scheduler.counters.preemptions > preempted_before
