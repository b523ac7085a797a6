"""The server under load and under fuzzing, against a real server process: 200 mixed requests
at concurrency 32 with bad ones mixed in, and hypothesis-generated bodies; no 5xx, no request
lost, nothing left locked or private afterwards. FUZZ_EXAMPLES=2000 fuzzes longer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from radixserve.testing.server import ServerProcess, start_server, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
WORDS = ("river stone light paper window garden music winter orange castle signal market "
         "doctor silver engine forest planet yellow bridge thunder").split()


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # No queue-wait bound: every request here must be served (test_server_overload refuses).
    proc = start_server(["--kv-cache-tokens", "8192", "--num-threads", "2", "--debug-invariants",
                         "--no-access-log", "--max-queue-wait", "0"], tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()
    assert not proc.serious_errors(), proc.log()


def assert_clean(base_url: str) -> None:
    m = wait_idle(base_url)
    states = ("free", "evictable", "protected", "pinned", "private")
    slots = {s: m[f"kv_cache_tokens{{state={s}}}"] for s in states}
    assert slots["protected"] == 0 and slots["private"] == 0, slots
    assert sum(slots.values()) == m["kv_cache_capacity_tokens"], slots


# ----- load -----

BAD_REQUESTS: list[tuple[dict[str, Any], type[openai.APIStatusError]]] = [
    ({"max_tokens": "two"}, openai.BadRequestError),
    ({"model": "no-such-model"}, openai.NotFoundError),
    ({"temperature": -1}, openai.BadRequestError),
    ({"messages": [{"role": "user"}], "max_tokens": 100_000}, openai.BadRequestError),
    ({"stream_options": {"include_usage": True}}, openai.BadRequestError),
]


def _request(i: int, shared: str) -> tuple[dict[str, Any], type[openai.APIStatusError] | None]:
    """Request i of the load: every 8th is bad; the rest share a prefix of varying length."""
    rng = random.Random(i)
    prefix = " ".join(shared.split()[: rng.choice((5, 40, 120, 300))])
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": rng.randint(1, 4), "temperature": rng.choice((0.0, 0.8)),
        "messages": [{"role": "system", "content": prefix},
                     {"role": "user", "content": f"{i}: {question}"}],
        "stream": rng.random() < 0.4,
    }
    if i % 8 == 7:
        override, error = BAD_REQUESTS[(i // 8) % len(BAD_REQUESTS)]
        body.update(override)
        body["stream"] = body["stream"] and "stream_options" not in override
        return body, error
    return body, None


async def _run_one(client: openai.AsyncOpenAI, body: dict[str, Any]) -> tuple[str, Any]:
    """("ok", finish reason) or ("error", the SDK's exception)."""
    try:
        if body.get("stream"):
            stream = await client.chat.completions.create(**body)
            reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
            return "ok", reasons[-1]
        response = await client.chat.completions.create(**body)
        return "ok", response.choices[0].finish_reason
    except openai.APIStatusError as exc:
        return "error", exc


def test_load_mixed_requests(server: ServerProcess) -> None:
    shared = " ".join(random.Random(0).choice(WORDS) for _ in range(300))
    requests = [_request(i, shared) for i in range(200)]

    async def drive() -> list[tuple[str, Any]]:
        gate = asyncio.Semaphore(32)
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                      max_retries=0, timeout=600) as client:
            async def bounded(body: dict[str, Any]) -> tuple[str, Any]:
                async with gate:
                    return await _run_one(client, body)

            return await asyncio.gather(*(bounded(body) for body, _ in requests))

    results = asyncio.run(drive())
    for (body, expected), (status, value) in zip(requests, results, strict=True):
        if expected is None:
            assert status == "ok", (body, value)
            assert value in ("stop", "length"), (body, value)
        else:
            assert status == "error" and isinstance(value, expected), (body, value)
            assert value.status_code < 500 and value.body["message"], (body, value)
    assert_clean(server.base_url)


# ----- fuzzing -----

_json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                 | st.floats(allow_nan=False) | st.text(max_size=12))
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "input_text", "image_url"]),
                               "text": st.text(max_size=20)})
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "user", "assistant", "tool", "robot"])},
    optional={"content": st.one_of(st.text(max_size=40), st.lists(_part, max_size=2), st.none()),
              "name": st.text(max_size=8),
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"function": st.fixed_dictionaries({"name": st.text(max_size=8),
                                                      "arguments": st.text(max_size=12)})}),
                  max_size=1)})


def _mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, other)


# Mostly valid values, some out of range; `_bodies` adds values of the wrong type.
_common = {
    "temperature": _mostly(st.floats(0, 2), st.floats(-0.5, 2.5)),
    "top_p": _mostly(st.floats(0.01, 1), st.floats(-0.1, 1.1)),
    "top_k": _mostly(st.integers(-1, 50), st.integers(-3, -2)),
    "n": _mostly(st.integers(1, 3), st.integers(-1, 0)),
    "seed": _mostly(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**64), 2**64)),
    "stop": _mostly(st.one_of(st.text(min_size=1, max_size=4),
                              st.lists(st.text(min_size=1, max_size=4), max_size=3)),
                    st.lists(st.text(max_size=2), max_size=20)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": _mostly(st.text(min_size=1, max_size=6), st.just("")),
    "min_tokens": _mostly(st.integers(0, 3), st.just(-1)),
    "ignore_eos": st.booleans(),
    "stop_token_ids": _mostly(st.lists(st.integers(0, 49_151), max_size=2),
                              st.lists(st.integers(-5, 60_000), max_size=2)),
    "prompt_cache_key": st.text(max_size=6),
    "user": st.text(max_size=6),
}
_chat_required = {"model": _mostly(st.just(MODEL), st.just("other-model")),
                  "messages": _mostly(st.lists(_message, min_size=1, max_size=3), st.just([])),
                  "max_tokens": _mostly(st.integers(1, 3), st.integers(-1, 0))}
_chat_optional = {
    **_common,
    "logprobs": st.booleans(),
    "top_logprobs": _mostly(st.integers(0, 20), st.integers(-1, 21)),
    "max_completion_tokens": _mostly(st.integers(1, 3), st.integers(-1, 0)),
    "tools": st.lists(st.dictionaries(st.text(max_size=6), _json, max_size=2), max_size=2),
}
_completion_required = {
    "model": _mostly(st.just(MODEL), st.just("other-model")),
    "prompt": _mostly(st.one_of(st.text(min_size=1, max_size=40),
                                st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
                                st.lists(st.integers(0, 49_151), min_size=1, max_size=5),
                                st.lists(st.lists(st.integers(0, 49_151), min_size=1, max_size=3),
                                         min_size=1, max_size=2)),
                      st.one_of(st.just(""), st.just([]), st.lists(st.integers(-3, 60_000)))),
    "max_tokens": _mostly(st.integers(1, 3), st.integers(-1, 0)),
}
_completion_optional = {
    **_common,
    "logprobs": _mostly(st.integers(0, 5), st.integers(-1, 21)),
    "echo": st.booleans(),
    "suffix": _mostly(st.just(""), st.text(max_size=3)),
    "best_of": _mostly(st.just(1), st.integers(0, 3)),
}


def _bodies(required: dict[str, st.SearchStrategy[Any]],
            optional: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    keys = sorted({*required, *optional})
    junk = st.one_of(st.just({}), st.just({}), st.dictionaries(st.sampled_from(keys), _json,
                                                              min_size=1, max_size=2))
    return st.builds(lambda body, bad: {**body, **bad},
                     st.fixed_dictionaries(required, optional=optional), junk)


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    # A valid body without a small max_tokens would generate to the end of the context.
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is None or isinstance(body.get(key), int) and body[key] > 3:
            body[key] = 2
    return body


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120, trust_env=False) as c:
        yield c


def _check(response: httpx.Response) -> None:
    event(f"HTTP {response.status_code}")  # --hypothesis-show-statistics shows the spread
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
        assert '"server_error"' not in response.text, response.text


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "120")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_bodies_never_5xx(http: httpx.Client, data: st.DataObject) -> None:
    if data.draw(st.booleans(), label="chat"):
        path = "/v1/chat/completions"
        body = data.draw(_bodies(_chat_required, _chat_optional), label="body")
    else:
        path = "/v1/completions"
        body = data.draw(_bodies(_completion_required, _completion_optional), label="body")
    _check(http.post(path, content=json.dumps(_bounded(body))))


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models"]))
def test_fuzzed_raw_bytes_never_5xx(http: httpx.Client, raw: bytes, path: str) -> None:
    method = "GET" if path == "/v1/models" else "POST"
    _check(http.request(method, path, content=raw))


def test_server_still_healthy_after_fuzzing(server: ServerProcess, http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert_clean(server.base_url)
