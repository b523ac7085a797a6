"""API keys, tenant isolation, the waiting-queue limit (429) and the SIGTERM drain, against a
real server started with --api-key twice, --isolate-tenants, --max-waiting 1, --max-num-seqs 2.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.testing.server import ServerProcess, start_server, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
SHUTDOWN_TIMEOUT_S = 8
LONG = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
            extra_body={"ignore_eos": True}, stream=True)


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        ["--kv-cache-tokens", "8192", "--num-threads", "2", "--debug-invariants",
         "--no-access-log", "--api-key", KEY_A, "--api-key", KEY_B, "--isolate-tenants",
         "--max-waiting", "1", "--max-queue-wait", "0", "--max-num-seqs", "2",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        tmp_path_factory.mktemp("server") / "server.log")
    yield proc
    assert proc.stop() == 0, proc.log()
    assert not proc.serious_errors(), proc.log()


def make_client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_health_and_metrics_need_no_key(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert "radixserve:kv_cache_tokens" in httpx.get(server.base_url + "/metrics").text


def test_api_keys(server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        make_client(server, "not-a-key").models.list()
    assert caught.value.code == "invalid_api_key"
    bare = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": []})
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert [m.id for m in make_client(server, KEY_A).models.list()] == [MODEL]
    # Anthropic-style x-api-key is accepted too.
    assert httpx.get(server.base_url + "/v1/models", headers={"x-api-key": KEY_B}).is_success


def test_tenants_share_nothing(server: ServerProcess) -> None:
    messages = [{"role": "system", "content": "You answer in one word. " * 40},
                {"role": "user", "content": "Colour of the sky?"}]

    def cached(key: str, **extra: object) -> int:
        r = make_client(server, key).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, **extra)  # type: ignore[arg-type]
        return r.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

    cached(KEY_A)
    assert cached(KEY_A) > 200
    # Same prompt, same salt, other key: nothing, so B cannot time A's prompts.
    assert cached(KEY_B, extra_body={"cache_salt": "shared"}) == 0
    assert cached(KEY_A, extra_body={"cache_salt": "shared"}) == 0  # a salt splits A's own space
    assert cached(KEY_B, extra_body={"cache_salt": "shared"}) > 200


def test_full_waiting_queue_is_429(server: ServerProcess) -> None:
    client = make_client(server, KEY_A)
    running = []
    for _ in range(2):  # fill both batch slots
        stream = client.chat.completions.create(**LONG, max_tokens=200)  # type: ignore[call-overload]
        chunks = iter(stream)
        while not next(chunks).choices[0].delta.content:
            pass
        running.append(stream)
    waiting = client.chat.completions.create(**LONG, max_tokens=2)  # type: ignore[call-overload]
    next(iter(waiting))  # its role chunk: it is in the queue now
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1)
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert int(caught.value.response.headers["retry-after-ms"]) >= 100
    assert caught.value.code == "server_overloaded"
    for stream in [*running, waiting]:
        stream.close()
    m = wait_idle(server.base_url)
    assert m["kv_cache_tokens{state=protected}"] == 0 and m["kv_cache_tokens{state=private}"] == 0


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(server: ServerProcess) -> None:
    client = make_client(server, KEY_B)
    long = client.chat.completions.create(**LONG, max_tokens=4000)  # type: ignore[call-overload]
    long_chunks = iter(long)
    while not next(long_chunks).choices[0].delta.content:
        pass
    short = client.chat.completions.create(**LONG, max_tokens=3)  # type: ignore[call-overload]
    short_chunks = iter(short)
    next(short_chunks)
    server.process.send_signal(signal.SIGTERM)
    # In flight and short: finishes normally within the drain.
    assert [c.choices[0].finish_reason for c in short_chunks if c.choices][-1] == "length"
    # Too long for the drain: ends with an error event the SDK raises.
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in long_chunks:
            pass
    assert server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health")
