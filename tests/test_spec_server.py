"""Speculative decoding through the server: `--speculative auto` starts (measuring its cost
model), a request's extra_body speculative / num_speculative_tokens override it on chat,
completions and Anthropic's messages with plain decoding's output, bad values are 400s naming
the field, and /metrics counts drafts under our names and vLLM's."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from radixserve.server.settings import DEFAULT_MODEL_NAME
from tests.support.servers import anthropic_client, openai_client, running_server

pytestmark = [pytest.mark.model]

ASK = [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta, alpha beta gamma "
        "delta, alpha beta gamma delta, alpha beta gamma delta."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "--speculative", "auto", "--metrics-compat",
                        "vllm") as proc:
        yield proc


def test_a_request_chooses_its_speculation_and_gets_plain_decodings_output(server):
    with openai_client(server) as client:
        def chat(extra):
            return client.chat.completions.create(
                model=DEFAULT_MODEL_NAME, messages=ASK, max_tokens=24, temperature=0,
                extra_body=extra).choices[0].message.content

        plain = chat({"speculative": "off"})
        assert chat({"speculative": "ngram", "num_speculative_tokens": 3}) == plain
        stream = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=ASK, max_tokens=24, temperature=0, stream=True,
            extra_body={"speculative": "suffix"})
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices) == plain
        assert chat({}) == plain  # the server's auto
        completion = client.completions.create(
            model=DEFAULT_MODEL_NAME, prompt="one two three one two three one two", max_tokens=8,
            temperature=0, extra_body={"speculative": "suffix"})
        assert completion.usage.completion_tokens == 8
    text = httpx.get(server.base_url + "/metrics").text
    drafts = [line for line in text.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    assert 'radixserve:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in text


@pytest.mark.parametrize(("extra", "field"), [
    ({"speculative": "eagle"}, "speculative"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
])
def test_bad_speculation_values_are_refused(server, extra, field):
    with openai_client(server) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ASK, max_tokens=4,
                                       extra_body=extra)
    assert field in str(caught.value)


def _drafts(server) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return float(next(line for line in text.splitlines()
                      if line.startswith("radixserve:spec_decode_num_drafts_total")).split()[-1])


def test_anthropic_messages_choose_their_speculation_too(server):
    with anthropic_client(server) as client:
        def message(extra):
            before = _drafts(server)
            # (this SDK has no temperature argument: greedy goes in the body too)
            reply = client.messages.create(model=DEFAULT_MODEL_NAME, messages=ASK, max_tokens=24,
                                           extra_body={"temperature": 0, **extra})
            return reply.content[0].text, _drafts(server) - before

        plain, drafted = message({"speculative": "off"})
        assert drafted == 0
        text, drafted = message({"speculative": "ngram", "num_speculative_tokens": 3})
        assert text == plain
        assert drafted > 0
        with pytest.raises(anthropic.BadRequestError) as caught:
            message({"num_speculative_tokens": 0})
    assert "num_speculative_tokens" in str(caught.value)
