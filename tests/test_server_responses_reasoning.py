"""Reasoning on the Responses API, on the default model with a template that opens the think
block in the prompt (the reply starts inside it): the reasoning comes back as a `reasoning`
output item, equal to what chat completions splits off as `reasoning_content`, streamed as
reasoning_text events the openai SDK parses, replayed by GET ?stream=true, and a reasoning item
sent back as input is taken; `reasoning.effort` is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from radixserve.server.settings import DEFAULT_MODEL_NAME as MODEL
from radixserve.testing.server import ServerProcess
from tests.support.servers import openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

OPEN_THINK = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)
QUESTION = "What is two plus two?"


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "open_think.jinja"
    template.write_text(OPEN_THINK)
    with running_server(tmp_path_factory, "--chat-template", str(template),
                        "--reasoning-parser", "think") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def _ask(**kwargs: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 24,
            **kwargs}


def test_reasoning_is_an_output_item_as_chat_completions_splits_it(
    client: openai.OpenAI,
) -> None:
    r = client.responses.create(**_ask())
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24,
                                          messages=[{"role": "user", "content": QUESTION}])
    reasoning = getattr(chat.choices[0].message, "reasoning_content", None)
    assert reasoning
    item = r.output[0]
    assert item.type == "reasoning" and item.summary == []
    assert item.content is not None and [c.type for c in item.content] == ["reasoning_text"]
    assert item.content[0].text == reasoning
    assert r.output_text == (chat.choices[0].message.content or "")
    assert "<think>" not in r.output_text and "</think>" not in r.output_text
    assert r.usage is not None and chat.usage is not None
    details = chat.usage.completion_tokens_details
    assert details is not None
    assert r.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens > 0


def test_reasoning_streams_as_reasoning_text_events(client: openai.OpenAI,
                                                    server: ServerProcess) -> None:
    whole = client.responses.create(**_ask())
    events = list(client.responses.create(**_ask(), stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas >= 2
    assert kinds[:4 + deltas + 3] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done"]
    assert kinds[-1] == f"response.{whole.status}"
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert whole.output[0].content is not None  # type: ignore[union-attr]
    assert text == whole.output[0].content[0].text  # type: ignore[union-attr]
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    with httpx.stream("GET", f"{server.base_url}/v1/responses/{final.id}",
                      params={"stream": "true"}, trust_env=False) as replay:
        lines = [json.loads(line[6:]) for line in replay.iter_lines()
                 if line.startswith("data: ")]
    replayed = [e["delta"] for e in lines if e["type"] == "response.reasoning_text.delta"]
    assert replayed == [text]


def test_reasoning_items_are_taken_as_input_and_effort_is_refused(
    client: openai.OpenAI,
) -> None:
    r = client.responses.create(**_ask(max_output_tokens=4, input=[
        {"type": "message", "role": "user", "content": "Hi."},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Greet back."}]},
        {"type": "message", "role": "assistant", "content": "Hello!"},
        {"type": "message", "role": "user", "content": QUESTION}]))
    assert r.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**_ask(reasoning={"effort": "low"}))
    assert refused.value.body["param"] == "reasoning"  # type: ignore[index]
