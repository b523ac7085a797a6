"""Why previous_response_id continues stored tokens instead of re-rendering: with a chat
template that writes earlier turns differently from how the model saw them (as Qwen3's drops a
past turn's think block), re-sending the conversation to chat completions misses the cache from
the previous reply on, while continuing by id hits the whole stored sequence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from radixserve.testing.server import ServerProcess
from tests.support.hf_directory import save_hf_directory
from tests.support.servers import openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

# ChatML whose generation prompt opens an empty think block that past turns do not keep.
DROPS_PAST_THINKING = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}")
MODEL = "thinking-template"
QUESTIONS = ("Name a colour.", "Name another one.")


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    directory = save_hf_directory(model_path, tmp_path_factory.mktemp("thinking-model"),
                                  DROPS_PAST_THINKING)
    with running_server(tmp_path_factory, "--model", str(directory), "--quantization", "none",
                        "--served-model-name", MODEL, "--responses-dir",
                        str(tmp_path_factory.mktemp("responses"))) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def test_by_id_hits_where_re_sent_messages_miss(client: openai.OpenAI) -> None:
    history = [{"role": "user", "content": QUESTIONS[0]}]
    first = client.chat.completions.create(model=MODEL, messages=history,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=12)
    assert first.usage is not None
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": QUESTIONS[1]}]
    second = client.chat.completions.create(model=MODEL, messages=history,  # type: ignore[arg-type]
                                            temperature=0, max_tokens=12)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # The re-render drops the think block the model saw: the cache ends before it.
    assert second.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 1

    r1 = client.responses.create(model=MODEL, input=QUESTIONS[0], temperature=0,
                                 max_output_tokens=12)
    assert r1.output_text == first.choices[0].message.content  # the same prompt tokens
    r2 = client.responses.create(model=MODEL, input=QUESTIONS[1], temperature=0,
                                 max_output_tokens=12, previous_response_id=r1.id)
    assert r1.usage is not None and r2.usage is not None
    whole = r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= whole - 1
