"""Reasoning through the server and the official SDKs, on the default model with a Qwen3-style
chat template (tests/support/chat_templates.py, given with --chat-template; `auto` picks the
think format from it). The think block is forced with a regex where the route has one, so the
shapes are checked on known output: `reasoning_content` and reasoning_tokens on the OpenAI
route, streamed and not; a `thinking` block on the Anthropic route; `chat_template_kwargs` and
`thinking` as the template's enable_thinking."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from radixserve.server.settings import DEFAULT_MODEL_NAME as MODEL
from radixserve.testing.server import ServerProcess
from tests.support.chat_templates import THINK_TEMPLATE
from tests.support.servers import anthropic_client, openai_client, running_server

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "What is two plus two?"}]
GREEDY = {"temperature": 0}  # the SDK has no field for it; the API does
FORCED = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[A-Z][a-z]{1,8}\."


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    with running_server(tmp_path_factory, "--chat-template", str(template)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def test_reasoning_is_returned_apart_from_the_answer_and_counted(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48, temperature=0,
        extra_body={"guided_regex": FORCED})
    message = response.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert reasoning and re.fullmatch(r"[a-z]+( [a-z]+)+", reasoning)
    assert message.content and re.fullmatch(r"[A-Z][a-z]+\.", message.content)
    usage = response.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"guided_regex": FORCED}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    streamed_content = [d.content or "" for d in deltas]
    assert "".join(streamed_reasoning) == reasoning
    assert "".join(streamed_content) == message.content
    last_reasoning = max(i for i, r in enumerate(streamed_reasoning) if r)
    assert not any(streamed_content[:last_reasoning + 1])  # reasoning comes first
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
        usage.completion_tokens_details.reasoning_tokens


def test_chat_template_kwargs_switch_thinking(client: openai.OpenAI) -> None:
    def ask(kwargs: dict[str, object] | None, **extra: object):
        body: dict[str, object] = {"chat_template_kwargs": kwargs} if kwargs else {}
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                              temperature=0, extra_body={**body, **extra})

    plain = ask(None)
    off = ask({"enable_thinking": False})
    assert off.usage and plain.usage
    # The empty think block is in the prompt, so the reply is all answer.
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # type: ignore[union-attr]
    # On: the prompt opens the think block, so the reply starts inside it; cut off there, it
    # is all reasoning.
    cut = ask({"enable_thinking": True})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == ""
    assert getattr(cut.choices[0].message, "reasoning_content", None)
    assert cut.usage.completion_tokens_details.reasoning_tokens == 6  # type: ignore[union-attr]
    # A constrained reply is the answer, though the prompt opened reasoning: the grammar
    # writes it from its first token (a forced call is not lost in the reasoning).
    forced = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True},
                    "guided_regex": r"Yes\."})
    assert forced.choices[0].message.content == "Yes."
    assert getattr(forced.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError, match="does not read 'reasoning_budget'"):
        ask({"reasoning_budget": 10})


def test_anthropic_thinking_is_a_thinking_block_before_the_text(server: ServerProcess) -> None:
    with anthropic_client(server) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=6, messages=QUESTION, extra_body=GREEDY,  # type: ignore[arg-type]
            thinking={"type": "enabled", "budget_tokens": 1024})
        message = raw.parse()
        assert raw.headers["x-radixserve-thinking"].startswith("applied: enable_thinking=true")
        assert [block.type for block in message.content] == ["thinking"]
        thinking = message.content[0]
        assert thinking.type == "thinking" and thinking.thinking and thinking.signature == ""
        assert message.stop_reason == "max_tokens"

        with client.messages.stream(
                model=MODEL, max_tokens=6, messages=QUESTION, extra_body=GREEDY,  # type: ignore[arg-type]
                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        assert "thinking" in kinds and "text" not in kinds
        assert streamed.content[0].type == "thinking"
        assert streamed.content[0].thinking == thinking.thinking

        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=6, messages=QUESTION, extra_body=GREEDY,  # type: ignore[arg-type]
            thinking={"type": "disabled"})
        assert raw.headers["x-radixserve-thinking"] == "applied: enable_thinking=false"
        assert [block.type for block in raw.parse().content] == ["text"]
