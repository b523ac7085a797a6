"""Sliding-window layers with the prefix cache, on prompts longer than the window: a
Mistral-shaped model (every layer windowed) and a Llama-shaped one whose odd layers attend to a
16-token window through `LayerAttention` (Gemma 3's and gpt-oss's mix). Output with the cache
on and chunked prefill equals the cache off and one chunk, token for token; a hypothesis state
machine inserts, extends, branches and evicts, checking every answer and the pool's books."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from radixserve import LLM, SamplingParams
from radixserve.layers.attention import LayerAttention
from radixserve.model.loader import load_tokenizer

pytestmark = [pytest.mark.model]

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=49152, max_position_embeddings=1024,
             initializer_range=0.2)  # weights large enough that tokens matter to the answer
# Each token's log-probability too: equal answers then mean equal logits, to the bit.
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
WINDOW = 16  # the Llama-shaped model's odd layers


def _save(model, directory: Path, model_path: Path) -> str:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = load_tokenizer(model_path)  # any real vocabulary of the right size will do
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer.chat_template, "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token}))
    return str(directory)


def _engines(path: str, windows: list[int | None] | None) -> tuple[LLM, LLM]:
    """(cache on, 16-token chunks, a small pool that evicts; cache off, one chunk)."""
    common = dict(dtype="float32", show_progress=False, quantization="none",
                  debug_invariants=True)
    cached = LLM(path, prefix_cache="radix", kv_cache_tokens=700, max_num_batched_tokens=16,
                 **common)
    plain = LLM(path, prefix_cache="off", kv_cache_tokens=2048, **common)
    for llm in (cached, plain):
        if windows is not None:
            model = llm.engine.model
            model.stack = None  # the C++ stack runs the model's one window
            for layer, window in zip(model.layers, windows, strict=True):
                layer.self_attn.layer_attention = (None if window is None
                                                   else LayerAttention(window=window))
    return cached, plain


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, model_path) -> tuple[LLM, LLM]:
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=24,
                                     tie_word_embeddings=False)
    path = _save(transformers.MistralForCausalLM(cfg), tmp_path_factory.mktemp("mistral"),
                 model_path)
    return _engines(path, None)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, model_path) -> tuple[LLM, LLM]:
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**SMALL, num_hidden_layers=4, tie_word_embeddings=False)
    path = _save(transformers.LlamaForCausalLM(cfg), tmp_path_factory.mktemp("mixed"),
                 model_path)
    return _engines(path, [None, WINDOW, None, WINDOW])


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def _answers(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)


def _said(results) -> list[tuple]:
    """Each answer's tokens and their log-probabilities."""
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def _assert_idle(llm: LLM) -> None:
    stats = llm.pool_stats()
    assert stats.balanced and stats.private == 0 and stats.protected == 0, stats


@pytest.mark.parametrize("which", ["mistral", "mixed"])
def test_cache_on_and_chunked_equals_cache_off_past_the_window(which, request):
    cached, plain = request.getfixturevalue(which)
    rng = random.Random(7)
    system = _tokens(rng, 90)  # several windows long
    first = [system + _tokens(rng, 5)]
    turns = [system + _tokens(rng, 3 + i) for i in range(3)]  # hit the cached system prompt
    want = _said(_answers(plain, first + turns))
    got = _answers(cached, first)
    hits = _answers(cached, turns)
    assert _said(got + hits) == want
    assert len({tuple(tokens) for tokens, _ in want}) > 1  # the prompts' answers differ
    assert all(r.num_cached_tokens >= len(system) for r in hits)
    # A request that extends a cached sequence (prompt and reply) past the window.
    extended = turns[0] + hits[0].outputs[0].token_ids + _tokens(rng, 30)
    again = _answers(cached, [extended])[0]
    assert again.num_cached_tokens >= len(turns[0])
    assert _said([again]) == _said(_answers(plain, [extended]))
    for llm in (cached, plain):
        _assert_idle(llm)


def test_the_window_really_matters_here(mixed):
    # The windowed layers change the answer against full attention on these prompts (else
    # the test above could not tell a wrong window from a right one).
    cached, plain = mixed
    prompt = _tokens(random.Random(8), 80)
    windowed = _said(_answers(plain, [prompt]))
    layers = plain.engine.model.layers
    saved = [layer.self_attn.layer_attention for layer in layers]
    for layer in layers:
        layer.self_attn.layer_attention = None
    try:
        full = _said(_answers(plain, [prompt]))
    finally:
        for layer, kept in zip(layers, saved, strict=True):
            layer.self_attn.layer_attention = kept
    assert full != windowed


class WindowedCacheMachine(RuleBasedStateMachine):
    """Sequences grow, branch and get evicted in the cached engine; each answer is checked
    against the cache-off engine, and the pool's books after every step."""

    def __init__(self, cached: LLM, plain: LLM) -> None:
        super().__init__()
        self.cached, self.plain = cached, plain
        self.sequences: list[list[int]] = []  # prompt + reply of every answered request
        self.rng = random.Random(0)

    def _ask(self, prompts: list[list[int]]) -> None:
        got = _answers(self.cached, prompts)
        want = _answers(self.plain, prompts)
        assert _said(got) == _said(want)
        for prompt, result in zip(prompts, got, strict=True):
            assert result.num_cached_tokens < len(prompt)
            self.sequences.append(prompt + result.outputs[0].token_ids)

    @rule(length=st.integers(20, 90))
    def insert(self, length: int) -> None:
        self._ask([_tokens(self.rng, length)])

    @rule(pick=st.integers(0, 1000), more=st.integers(1, 40))
    def extend(self, pick: int, more: int) -> None:
        if self.sequences:
            base = self.sequences[pick % len(self.sequences)]
            self._ask([base + _tokens(self.rng, more)])

    @rule(pick=st.integers(0, 1000), cut=st.floats(0.05, 1.0), more=st.integers(1, 30),
          together=st.booleans())
    def branch(self, pick: int, cut: float, more: int, together: bool) -> None:
        # A new continuation from inside an old sequence (maybe far behind its end); with
        # `together`, beside another request that extends the same sequence in one batch.
        if self.sequences:
            base = self.sequences[pick % len(self.sequences)]
            at = max(1, int(len(base) * cut))
            prompts = [base[:at] + _tokens(self.rng, more)]
            if together:
                prompts.append(base + _tokens(self.rng, 3))
            self._ask(prompts)

    @rule(tokens=st.integers(1, 400))
    def evict(self, tokens: int) -> None:
        self.cached.engine.cache.evict(tokens)

    @invariant()
    def books_balance(self) -> None:
        _assert_idle(self.cached)


def test_windowed_cache_state_machine(mixed):
    cached, plain = mixed
    run_state_machine_as_test(lambda: WindowedCacheMachine(cached, plain),
                              settings=settings(max_examples=6, stateful_step_count=8,
                                                deadline=None))
