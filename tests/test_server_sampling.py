"""logit_bias, frequency/presence penalties and repetition_penalty through the OpenAI server
and the official `openai` SDK: each changes what the model says, and an out-of-range value
is a 400 naming its field. The formulas themselves are checked in test_logits_processors.py.
"""

from __future__ import annotations

import openai
import pytest

from radixserve.model.tokenizer import ChatTokenizer

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
# Greedy, the model repeats this prompt's sentence forever: few distinct tokens.
REPETITIVE = "The cat sat on the mat. The cat sat on the mat."
# Greedy, the model answers this in a few tokens and ends its turn.
SHORT_ANSWER = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]


def greedy_tokens(client: openai.OpenAI, tokenizer: ChatTokenizer, **extra: object) -> list[int]:
    """The 30 greedy tokens after REPETITIVE, with the sampling fields in `extra`."""
    r = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True, **extra})
    assert r.usage is not None and r.usage.completion_tokens == 30
    return tokenizer.encode(r.choices[0].text)


def test_a_large_bias_makes_every_token_that_token(client: openai.OpenAI,
                                                   tokenizer: ChatTokenizer) -> None:
    (cat,) = tokenizer.encode(" cat")
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
            temperature=1.0, seed=seed, logit_bias={str(cat): 100}, logprobs=True,
            extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == " cat" * 8
        # The log-probabilities are the biased distribution's: the token is all but certain.
        assert r.choices[0].logprobs is not None
        assert all(entry.logprob > -1e-3 for entry in r.choices[0].logprobs.content or [])


def test_a_negative_bias_on_the_end_of_turn_prolongs_the_answer(
        client: openai.OpenAI, tokenizer: ChatTokenizer) -> None:
    def answer(**extra: object) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model=MODEL, messages=SHORT_ANSWER, max_tokens=32,
                                              temperature=0, **extra)  # type: ignore[call-overload]

    plain = answer()
    assert plain.choices[0].finish_reason == "stop"
    ban = {str(t): -100 for t in tokenizer.stop_token_ids}
    longer = answer(logit_bias=ban)
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage is not None and longer.usage.completion_tokens == 32
    assert (longer.choices[0].message.content or "").startswith(plain.choices[0].message.content
                                                                or "")


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_on_the_output_reduce_repetition(client: openai.OpenAI,
                                                   tokenizer: ChatTokenizer, penalty: str) -> None:
    plain = greedy_tokens(client, tokenizer)
    penalised = greedy_tokens(client, tokenizer, **{penalty: 2.0})
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain)) + 5, (plain, penalised)


def test_repetition_penalty_changes_the_output(client: openai.OpenAI,
                                               tokenizer: ChatTokenizer) -> None:
    plain = greedy_tokens(client, tokenizer)
    penalised = greedy_tokens(client, tokenizer, repetition_penalty=1.3)
    assert penalised != plain and len(set(penalised)) > len(set(plain))


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_penalty", 3), ("presence_penalty", -2.5), ("logit_bias", {"abc": 1}),
    ("logit_bias", {"42": 200}), ("logit_bias", {"10000000": 1}), ("repetition_penalty", 0),
])
def test_out_of_range_values_are_a_400_naming_the_field(client: openai.OpenAI, field: str,
                                                        value: object) -> None:
    with pytest.raises(openai.BadRequestError) as chat_error:
        client.chat.completions.create(model=MODEL, messages=SHORT_ANSWER, max_tokens=1,
                                       extra_body={field: value})
    with pytest.raises(openai.BadRequestError) as completion_error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                  extra_body={field: value})
    for error in (chat_error.value, completion_error.value):
        assert error.param == field and field in error.message, error
