"""Prompt log-probabilities, from the engine (against HF transformers, cache cold and warm,
chunked prefill) to /v1/completions with echo as lm-evaluation-harness scores multiple-choice
items through the official SDK.

One float32 engine on the dequantized weights serves as both the HF-checked reference and the
server's twin (the server runs the same settings), so the server's numbers can be compared
exactly. The server boots in the background while the models load here.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.engine.scheduler import SchedulerOutput
from radixserve.outputs import RequestOutput, TokenLogprob
from radixserve.testing.server import ServerProcess, start_server, wait_idle
from tests.support.engine import SMALL_ENGINE

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
# Float32 on both sides; what differs is summation order (as in test_parity_hf's 2e-3 on
# logits), and a log-softmax's difference is at most twice its logits'.
HF_TOLERANCE = 4e-3
# Chunked against whole prefill: the same kernels on row slices of other sizes.
CHUNK_TOLERANCE = 1e-4
PROMPT = ("The history of computing is a story of abstractions: switches and cables, then "
          "assembly, then high-level languages, operating systems and networks.")
# Easy multiple-choice items (context, right answer, wrong answers) on which the default
# model, in float32, prefers the right answer by more than ten nats.
ITEMS = [
    ("The capital of France is", "Paris", ["Banana", "Seventeen"]),
    ("The capital of Japan is", "Tokyo", ["Banana", "Seventeen"]),
    ("The opposite of hot is", "cold", ["Tuesday", "Banana"]),
    ("Water freezes at zero degrees", "Celsius", ["Banana", "purple"]),
]
SCORE = dict(echo=True, logprobs=1, max_tokens=0, temperature=0)  # lm-eval's, max_tokens 0


@pytest.fixture(scope="module", autouse=True)
def server_boot(model_path: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Future[ServerProcess]]:
    """Starts the server first (autouse), so it loads while this process loads its models."""
    args = ["--dtype", "float32", "--quantization", "none", "--kv-cache-tokens", "8192",
            "--num-threads", "2", "--debug-invariants", "--no-access-log"]
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ThreadPoolExecutor(1) as pool:
        boot = pool.submit(start_server, args, log)
        yield boot
        proc = boot.result()
        assert proc.stop() == 0, proc.log()
        assert not proc.serious_errors(), proc.log()


@pytest.fixture(scope="module")
def client(server_boot: Future[ServerProcess]) -> Iterator[openai.OpenAI]:
    server = server_boot.result()
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c
    wait_idle(server.base_url)


@pytest.fixture(scope="module")
def llm(model_path: Path) -> LLM:
    return LLM(str(model_path), dtype="float32", quantization="none", **SMALL_ENGINE)


def _score(llm: LLM, ids: list[int], top: int = 5, **params: object) -> RequestOutput:
    options: dict = {"max_tokens": 0, "prompt_logprobs": top, "temperature": 0, **params}
    return llm.generate({"prompt_token_ids": ids}, SamplingParams(**options))[0]


def _assert_clean(llm: LLM) -> None:
    stats = llm.pool_stats()
    assert stats.balanced and stats.private == 0 and stats.protected == 0, stats


def _assert_close(got: list[TokenLogprob | None], want: list[TokenLogprob | None],
                  atol: float) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for i, (g, w) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        assert g is not None and w is not None
        assert abs(g[0] - w[0]) <= atol, (i, g[0], w[0])
        assert g[1].keys() == w[1].keys() or max(  # a near-tie may swap the last place
            abs(a - b) for a, b in zip(sorted(g[1].values()), sorted(w[1].values()),
                                       strict=True)) <= atol, (i, g[1], w[1])


# ----- engine -----


def test_prompt_logprobs_match_hf_cold_and_warm(llm: LLM, hf_model) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    cold = _score(llm, ids)
    assert cold.outputs[0].token_ids == [] and cold.outputs[0].text == ""
    assert cold.outputs[0].finish_reason == "length" and cold.num_cached_tokens == 0
    assert cold.prompt_logprobs is not None and len(cold.prompt_logprobs) == len(ids)
    assert cold.prompt_logprobs[0] is None  # the first token has no context
    for i in range(1, len(ids)):
        entry = cold.prompt_logprobs[i]
        assert entry is not None
        logprob, top = entry
        assert abs(logprob - ref[i - 1, ids[i]].item()) <= HF_TOLERANCE, i
        values, indices = torch.topk(ref[i - 1], 5)
        assert list(top) == indices.tolist(), i
        assert max(abs(a - b) for a, b in zip(top.values(), values.tolist(), strict=True)) \
            <= HF_TOLERANCE, i
    # The request published its KV: a plain request now hits it...
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0))
    assert plain[0].num_cached_tokens == len(ids) - 1
    # ...and with the prompt cached, prompt logprobs still compute it all, to the same bits.
    warm = _score(llm, ids)
    assert warm.num_cached_tokens == 0
    assert warm.prompt_logprobs == cold.prompt_logprobs
    _assert_clean(llm)


def test_chunked_prefill_equals_whole(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    long_ids = llm.tokenizer.encode(PROMPT + " Each layer hid the one below it.")
    short_ids = llm.tokenizer.encode("Abstractions leak, but they still help.")
    whole = [_score(llm, ids, top=3) for ids in (long_ids, short_ids)]
    chunks: list[list[int]] = []
    build_batch = llm.engine.runner.build_batch

    def recording(plan):
        chunks.append([c.num_tokens for c in plan.prefills])
        return build_batch(plan)

    monkeypatch.setattr(llm.engine.runner, "build_batch", recording)
    monkeypatch.setattr(llm.engine.scheduler.config, "max_num_batched_tokens", 16)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0, ignore_eos=True)
    chunked = llm.generate([{"prompt_token_ids": ids} for ids in (long_ids, short_ids)], params)
    assert len([c for c in chunks if c]) >= len(long_ids) // 16  # the prompt went in chunks
    for got, want in zip(chunked, whole, strict=True):
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        _assert_close(got.prompt_logprobs, want.prompt_logprobs, CHUNK_TOLERANCE)
        assert len(got.outputs[0].token_ids) == 2
    _assert_clean(llm)


def test_samples_share_prompt_logprobs(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Abstractions leak, but they still help.")
    alone = _score(llm, ids, top=2)
    both = _score(llm, ids, top=2, n=2, max_tokens=1)
    assert both.prompt_logprobs is not None and alone.prompt_logprobs is not None
    _assert_close(both.prompt_logprobs, alone.prompt_logprobs, CHUNK_TOLERANCE)
    assert [len(o.token_ids) for o in both.outputs] == [1, 1]
    _assert_clean(llm)


def test_preemption_and_abort_midway(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    want = _score(llm, ids, top=2).prompt_logprobs
    engine = llm.engine
    monkeypatch.setattr(engine.scheduler.config, "max_num_batched_tokens", 16)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    # Preempted after its first chunk: it recomputes its prompt from the start (no cache hit),
    # scoring only what it lacks.
    engine.add_request(ids, params)
    engine.step()
    request = engine.scheduler.running[0]
    assert request.prompt_logprobs is not None and len(request.prompt_logprobs) == 17
    engine.scheduler._preempt(request, SchedulerOutput())
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].prompt_logprobs is not None and want is not None
    _assert_close(outputs[-1].prompt_logprobs, want, CHUNK_TOLERANCE)
    assert outputs[-1].num_cached_tokens == 0
    # Aborted midway through its prompt: everything it held is released.
    request_id = engine.add_request(llm.tokenizer.encode(PROMPT * 2), params)
    engine.step()
    engine.abort_request(request_id)
    assert engine.step() == [] and not engine.has_unfinished_requests()
    _assert_clean(llm)


# ----- server: lm-evaluation-harness's loglikelihood -----


def _continuation(logprobs, context: str) -> list[float]:
    """The token logprobs of the text after `context` (lm-eval finds them by length)."""
    return [lp for lp, at in zip(logprobs.token_logprobs, logprobs.text_offset, strict=True)
            if at >= len(context)]


def test_multiple_choice_scores(client: openai.OpenAI, llm: LLM) -> None:
    # Every request first, then the local references: alternating the two processes' OpenMP
    # work on two cores makes each wait out the other's spinning threads.
    responses = {(context, choice): client.completions.create(
                     model=MODEL, prompt=f"{context} {choice}", **SCORE)
                 for context, right, wrong in ITEMS for choice in [right, *wrong]}
    for (context, choice), r in responses.items():
        prompt = f"{context} {choice}"
        c = r.choices[0]
        assert c.text == prompt and c.finish_reason == "length"
        assert r.usage.completion_tokens == 0
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        lp = c.logprobs
        ids = llm.tokenizer.encode(prompt)
        assert len(lp.tokens) == len(ids) == r.usage.prompt_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset[0] == 0 and "".join(lp.tokens) == prompt
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        own = _score(llm, ids, top=1).prompt_logprobs
        assert own is not None
        assert lp.token_logprobs[1:] == pytest.approx([e[0] for e in own[1:]], abs=1e-6)
    for context, right, wrong in ITEMS:
        scores = {choice: sum(_continuation(responses[context, choice].choices[0].logprobs,
                                            context))
                  for choice in [right, *wrong]}
        assert len(set(scores.values())) == len(scores), scores
        assert max(scores, key=scores.__getitem__) == right, (context, scores)


def test_echo_then_generated_token(client: openai.OpenAI, llm: LLM) -> None:
    # lm-eval's own request: token ids, max_tokens 1, and it drops the last entry.
    context, choice = ITEMS[0][0], ITEMS[0][1]
    prompt = f"{context} {choice}"
    ids = llm.tokenizer.encode(prompt)
    scored = client.completions.create(model=MODEL, prompt=prompt, **SCORE).choices[0].logprobs
    r = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1,
                                  temperature=0, seed=1234)
    c, n = r.choices[0], len(ids)
    assert r.usage.completion_tokens == 1 and c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[:n] == scored.token_logprobs
    assert lp.top_logprobs[:n] == scored.top_logprobs
    assert lp.text_offset[n] == len(prompt) and lp.token_logprobs[n] is not None
    ctxlen = len(llm.tokenizer.encode(context))
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(sum(_continuation(scored, context)))


def test_streamed_echo_carries_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = f"{ITEMS[1][0]} {ITEMS[1][1]}"
    kwargs = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)
              if c.choices]
    assert chunks[0].text.startswith(prompt) and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == whole.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c.logprobs for v in getattr(c.logprobs, key)] == \
            getattr(whole.logprobs, key), key
    scored = [c.choices[0] for c in client.completions.create(stream=True, **{**kwargs,
                                                                               **SCORE})]
    assert "".join(c.text for c in scored) == prompt
    assert scored[-1].finish_reason == "length"


def test_max_tokens_zero_without_echo_is_empty(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=-1)
    assert caught.value.body["param"] == "max_tokens"  # type: ignore[index]
