"""The server's parts without a model: request validation, chat rendering with tools, stop-string
hold-back, tenant namespaces, and the app's drain state (503), in-process through ASGI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.model.loader import load_tokenizer
from radixserve.server.app import create_app
from radixserve.server.auth import cache_namespace
from radixserve.server.errors import APIError
from radixserve.server.exchange import partial_stop_len
from radixserve.server.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from radixserve.server.prompts import TOOLS_PREAMBLE, message_dicts, render_chat
from radixserve.server.settings import ServerSettings
from radixserve.server.transport import parse_body
from radixserve.testing.server import parse_metrics
from tests.support.fakes import IdleEngine

pytestmark = [pytest.mark.model]

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Find a word.",
                                         "parameters": {"type": "object", "properties": {}}}}


def _error(raw: str, model: type[Any] = ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_body(raw.encode(), model)
    assert caught.value.status == 400
    return caught.value


def test_parse_body_names_the_parameter() -> None:
    assert _error('{"messages": [{"role": "user", "content": 5}]}').param == "messages.0.content"
    assert _error('{"messages": [], "n": 1}').param == "messages"
    assert _error('{"prompt": [1, "a"]}', CompletionRequest).param == "prompt"
    assert _error('{"messages": [{"role": "user"}], "seed": 1e30}').param == "seed"
    assert "not valid JSON" in _error('{"messages": ').message
    assert "JSON object" in _error("[]").message
    ok = parse_body(b'{"messages": [{"role": "user", "content": "hi"}], "future_field": 1}',
                    ChatCompletionRequest)
    assert ok.messages[0].content == "hi"


def test_partial_stop_is_held_back() -> None:
    assert partial_stop_len("Hello wor", ["world"]) == 3
    assert partial_stop_len("Hello", ["world", "lo!"]) == 2
    assert partial_stop_len("Hello", ["xyz"]) == 0
    assert partial_stop_len("", ["a"]) == 0


def _reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reversed_keys(v) for k, v in reversed(list(value.items()))}
    return value


def test_tools_go_into_the_system_message_deterministically(model_path: Path) -> None:
    tokenizer = load_tokenizer(model_path)
    assert tokenizer.chat_template and "tools" not in tokenizer.chat_template
    messages = [ChatMessage(role="user", content="Define 'cache'.")]
    dicts = message_dicts(messages, [TOOL], tokenizer.chat_template)
    assert dicts[0]["role"] == "system" and dicts[0]["content"].startswith(TOOLS_PREAMBLE)
    assert json.dumps(TOOL, sort_keys=True, ensure_ascii=False) in dicts[0]["content"]
    assert render_chat(tokenizer, messages, [TOOL]) == render_chat(tokenizer, messages,
                                                                   [_reversed_keys(TOOL)])
    # Text parts concatenate exactly; a developer message is a system message.
    split = [ChatMessage.model_validate({"role": "developer", "content": [
        {"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}), messages[0]]
    whole = [ChatMessage(role="system", content="Be brief."), messages[0]]
    assert render_chat(tokenizer, split, None) == render_chat(tokenizer, whole, None)


def test_tool_calls_render_as_text_for_templates_without_them() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"word": "cache"}'}}
    dicts = message_dicts([ChatMessage(role="assistant", content=None, tool_calls=[call])],
                          None, "{{ messages }}")
    assert dicts[0]["content"] == '<tool_call>{"name": "lookup", "arguments": {"word": "cache"}}</tool_call>'


def test_cache_namespaces() -> None:
    open_server = ServerSettings()
    assert cache_namespace(open_server, None, None) is None
    assert cache_namespace(open_server, None, "salt") == "salt"
    isolated = ServerSettings(api_keys=("sk-secret-a", "sk-secret-b"), isolate_tenants=True)
    a, b = (cache_namespace(isolated, key, "salt") for key in isolated.api_keys)
    assert a != b and a == cache_namespace(isolated, "sk-secret-a", "salt")
    assert "secret" not in json.dumps(a)  # the raw key is not kept in the cache
    with pytest.raises(ValueError):
        ServerSettings(isolate_tenants=True)


def test_draining_app_answers_503_and_readiness_says_so() -> None:
    app = create_app(IdleEngine())  # type: ignore[arg-type]

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            healthy = await http.get("/health")
            app.state.radixserve.lifecycle.begin_shutdown(grace_s=30)
            refused = await http.post("/v1/chat/completions", json={"messages": []})
            return [healthy, refused, await http.get("/health"), await http.get("/health/ready")]

    healthy, refused, live, ready = asyncio.run(scenario())
    assert healthy.status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.headers["retry-after-ms"] == "1000"
    assert refused.json()["error"]["code"] == "shutting_down"
    # Liveness stays 200 (a restart would cut the drain short); readiness turns 503.
    assert live.status_code == 200 and live.json()["status"] == "draining"
    assert ready.status_code == 503 and ready.json()["status"] == "draining"


def test_apps_keep_their_own_metrics() -> None:
    first, second = create_app(IdleEngine()), create_app(IdleEngine())  # type: ignore[arg-type]
    first.state.radixserve.metrics.generation_tokens.inc(5)
    assert first.state.radixserve.metrics.registry is not second.state.radixserve.metrics.registry
    text = second.state.radixserve.metrics.render(None).decode()
    assert parse_metrics(text)["generation_tokens_total"] == 0
