"""The engine on the real default model: batching invariance, pressure, sampling, bad input."""

from __future__ import annotations

import pytest
import torch

from radixserve import LLM, SamplingParams
from tests.support.engine import SMALL_ENGINE, use_torch_attention

pytestmark = [pytest.mark.model]

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prefix cache does in one sentence.",
    "List three prime numbers.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def llm(model_path):
    # float32: with bfloat16, a matmul's rounding can depend on the batch shape, and the tests
    # here compare tokens across batch shapes.
    return LLM(str(model_path), dtype="float32", prefix_cache="off", **SMALL_ENGINE)


def _chat_ids(llm: LLM, question: str, repeat: int = 1) -> list[int]:
    content = (question + " ") * repeat
    return llm.tokenizer.encode_chat([{"role": "user", "content": content}])


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _assert_idle(llm: LLM) -> None:
    stats = llm.pool_stats()
    assert stats.balanced, stats
    assert stats.private == 0 and stats.protected == 0, stats


@pytest.fixture(scope="module")
def reference(llm):
    prompts = [{"prompt_token_ids": _chat_ids(llm, q, repeat=i + 1)} for i, q in enumerate(QUESTIONS)]
    one_by_one = [_tokens(llm.generate(p, GREEDY))[0] for p in prompts]
    return prompts, one_by_one


def test_batched_equals_one_at_a_time(llm, reference):
    prompts, one_by_one = reference
    for layer in llm.engine.pool.layers:  # unwritten slots must never be read (pool not zeroed)
        layer.k.fill_(float("nan"))
        layer.v.fill_(float("nan"))
    assert _tokens(llm.generate(prompts, GREEDY)) == one_by_one
    _assert_idle(llm)


def test_torch_attention_path_matches_one_at_a_time(model_path, monkeypatch):
    # The PyTorch attention backends (gathers and shared-prefix groups for decode, SDPA for
    # prefill) give the batched outputs the kernel gives one request at a time, in float32 on
    # the dequantized weights (with int8-quantized activations their last-bit differences from
    # the kernel would turn into different roundings).
    llm = LLM(str(model_path), dtype="float32", prefix_cache="off", quantization="none",
              **SMALL_ENGINE)
    prompts = [{"prompt_token_ids": _chat_ids(llm, q, repeat=i + 1)}
               for i, q in enumerate(QUESTIONS)]
    one_by_one = [_tokens(llm.generate(p, GREEDY))[0] for p in prompts]
    use_torch_attention(monkeypatch, llm)
    assert llm.engine.runner.attention.name == "decode torch, prefill sdpa"
    # The pool is not zeroed at allocation: as if its memory held NaNs, every slot is NaN;
    # only slots written before they are read (and the padding's slot 0, which the first
    # request writes) may reach the output.
    for layer in llm.engine.pool.layers:
        layer.k.fill_(float("nan"))
        layer.v.fill_(float("nan"))
    assert _tokens(llm.generate(prompts, GREEDY)) == one_by_one
    _assert_idle(llm)


def test_chunked_prefill_equals_unchunked(llm, reference):
    prompts, one_by_one = reference
    engine_config = llm.engine.config
    saved = engine_config.max_num_batched_tokens
    engine_config.max_num_batched_tokens = 16  # every prompt is split into many chunks
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == one_by_one
    finally:
        engine_config.max_num_batched_tokens = saved
    _assert_idle(llm)


def test_pool_pressure_preempts_and_completes(llm, model_path):
    # Room for about 3 of the 16 requests at once: the rest wait or get preempted and
    # recomputed, and every output still equals the unpressured one.
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": _chat_ids(llm, f"Story {i}: tell me about dragons.", 4)}
               for i in range(16)]
    expected = _tokens(llm.generate(prompts, params))
    per_request = max(len(p["prompt_token_ids"]) for p in prompts) + 12
    small = LLM(str(model_path), dtype="float32", prefix_cache="radix",
                kv_cache_tokens=3 * per_request + 4, show_progress=False, debug_invariants=True)
    assert _tokens(small.generate(prompts, params)) == expected
    stats = small.pool_stats()
    assert stats.private == 0 and stats.protected == 0
    assert stats.free + stats.evictable == stats.total


def test_seed_reproduces_and_differs(llm):
    prompt = {"prompt_token_ids": _chat_ids(llm, "Tell me a story.")}
    a = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1234))
    b = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1234))
    c = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=99))
    assert _tokens(a) == _tokens(b)
    assert _tokens(a) != _tokens(c)


def test_a_seeded_sample_does_not_depend_on_its_batch(llm):
    # A seed owns its generator: alone, or in a batch beside unseeded and other seeded
    # requests, it draws the same tokens.
    prompt = {"prompt_token_ids": _chat_ids(llm, "Tell me a story.")}
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=77)
    alone = _tokens(llm.generate(prompt, seeded))
    others = [{"prompt_token_ids": _chat_ids(llm, f"Name a city, {i}.")} for i in range(3)]
    batch = llm.generate([others[0], prompt, others[1], others[2]],
                         [SamplingParams(max_tokens=12, temperature=1.0),
                          seeded, SamplingParams(max_tokens=5, temperature=1.0, seed=1),
                          SamplingParams(max_tokens=20, temperature=0.7)])
    assert _tokens(batch)[1] == alone[0]


def test_top_k_one_equals_greedy(llm, reference):
    prompts, one_by_one = reference
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True, seed=3)
    assert _tokens(llm.generate(prompts[:2], params)) == one_by_one[:2]


def test_stop_string_cuts_text(llm):
    prompt = {"prompt_token_ids": _chat_ids(llm, "Write two sentences about autumn leaves.")}
    free = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text = free[0].outputs[0].text
    # A stop string that first occurs in the middle of the free-running text.
    at = next(i for i in range(len(text) // 2, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop=[stop]))
    out = stopped[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:at]


def test_n_returns_n_outputs(llm):
    prompt = {"prompt_token_ids": _chat_ids(llm, "Name a colour.")}
    result = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5))[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(o.token_ids for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1  # independent samples
    _assert_idle(llm)


def test_max_tokens_and_eos(llm):
    prompt = {"prompt_token_ids": _chat_ids(llm, "Say hi.")}
    out = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"
    out = llm.generate(prompt, SamplingParams(max_tokens=200, temperature=0))
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].token_ids[-1] in llm.tokenizer.stop_token_ids


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(max_tokens=4), "empty"),
        ({"prompt_token_ids": [1] * 9000}, SamplingParams(max_tokens=4), "context"),
        ({"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=4), "token ids"),
    ],
)
def test_bad_prompts_raise_and_leave_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["a fine prompt", prompt], params)
    assert not llm.engine.has_unfinished_requests()
    _assert_idle(llm)


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model.gguf", show_progress=False)


def test_unknown_setting_is_named(model_path):
    with pytest.raises(TypeError, match="page_sise"):
        LLM(str(model_path), page_sise=4)


def test_engine_seed_drives_sampling_without_a_request_seed(llm):
    # EngineConfig.seed seeds one generator for requests that carry no seed (vLLM's rule): the
    # same engine seed gives the same samples, another seed other samples.
    generator = llm.engine.runner.generator
    assert generator.initial_seed() == llm.engine.config.seed
    prompt = {"prompt_token_ids": _chat_ids(llm, "Tell me a story.")}
    params = SamplingParams(max_tokens=16, temperature=1.0)
    runs = []
    for seed in (5, 5, 6):
        generator.manual_seed(seed)
        torch.manual_seed(seed * 7 + len(runs))  # the global generator must not matter
        runs.append(_tokens(llm.generate(prompt, params)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
