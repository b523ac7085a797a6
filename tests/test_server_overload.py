"""Overload and drain against a real server, through the official SDKs: readiness during warm-up,
429/529 with retry-after once a key's share of the queue is full (and the SDKs' own retries
succeeding once it drains), a flooding key leaving room for another, a stalled step turning
liveness and readiness, per-request deadlines, and SIGTERM with streams in flight.

The engine is held still through the test-only fault file (`engine.heartbeat`), so the queue
fills on cue.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from radixserve.engine.heartbeat import FAULT_FILE_ENV
from radixserve.testing.server import ServerProcess, read_metrics, start_server, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-a", "key-b")
STALL_S = 4.0  # the watchdog's stall limit here (a busy 2-core box has 2-s steps)


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults") / "fault"


@pytest.fixture(scope="module")
def server(model_path: Path, fault_file: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    # Four requests may wait, two per key; no wait bound (the fault stalls would skew the
    # measured rate; tests/test_admission.py checks that bound).
    fault_file.write_text("stall")  # the warm-up waits until the first test lets it go
    proc = start_server(["--kv-cache-tokens", "4096", "--num-threads", "2", "--no-access-log",
                         "--max-waiting", "4", "--max-queue-wait", "0", "--api-key", KEYS[0],
                         "--api-key", KEYS[1], "--watchdog-stall", str(STALL_S),
                         "--watchdog-exit", "0", "--shutdown-timeout", "60"],
                        tmp_path_factory.mktemp("server") / "server.log",
                        env={FAULT_FILE_ENV: str(fault_file)}, wait_ready=False)
    yield proc
    fault_file.unlink(missing_ok=True)
    assert proc.stop() == 0, proc.log()
    assert not proc.serious_errors(), proc.log()


def _until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _get(proc: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(proc.base_url + path, timeout=30, trust_env=False)


def _chat(proc: ServerProcess, key: str, max_tokens: int = 2, **options: Any) -> httpx.Response:
    return httpx.post(proc.base_url + "/v1/chat/completions",
                      headers={"authorization": f"Bearer {key}", **options.pop("headers", {})},
                      json={"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": "Name a colour."}],
                            **options}, timeout=120, trust_env=False)


def _queued(proc: ServerProcess) -> float:
    """Requests admitted and without a first token (read without the engine, which may be
    held still)."""
    return read_metrics(proc.base_url)["admission_queued_requests"]


def _rejected(proc: ServerProcess) -> float:
    return read_metrics(proc.base_url).get("request_rejected_total{reason=queue_full}", 0.0)


def test_readiness_is_503_while_warming_up_then_200(server: ServerProcess,
                                                    fault_file: Path) -> None:
    # The server answers liveness at once; the warm-up generation is held by the fault file.
    ready = _get(server, "/health/ready")
    assert ready.status_code == 503 and ready.json()["status"] in ("warming up",
                                                                   "engine step stalled")
    fault_file.unlink()
    _until(lambda: _get(server, "/health/ready").status_code == 200)
    assert _get(server, "/health").status_code == 200
    assert "warm-up:" in server.log()
    # Warm, the heap is frozen out of the collector's full passes (server.heap): the modules,
    # tokenizer and engine objects alone are well over 100,000.
    assert read_metrics(server.base_url)["gc_frozen_objects"] > 100_000


def test_over_limit_requests_get_429_and_529_then_sdk_retries_succeed(
    server: ServerProcess, fault_file: Path,
) -> None:
    fault_file.write_text("stall")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(_chat, server, KEYS[0]) for _ in range(2)]  # key a's share: 2
        _until(lambda: _queued(server) == 2)
        started = time.monotonic()
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS[0], max_retries=0,
                           timeout=30) as client, pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi"}])
        refusal_s = time.monotonic() - started
        error = caught.value
        assert error.status_code == 429 and error.body["code"] == "server_overloaded"
        assert "API key's share" in error.body["message"]
        assert int(error.response.headers["retry-after"]) >= 1
        assert int(error.response.headers["retry-after-ms"]) >= 100
        with anthropic.Anthropic(base_url=server.base_url, api_key=KEYS[0], max_retries=0,
                                 timeout=30) as client, \
                pytest.raises(anthropic.APIStatusError) as overloaded:
            client.messages.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi"}])
        assert overloaded.value.status_code == 529
        assert overloaded.value.body["error"]["type"] == "overloaded_error"
        assert "retry-after-ms" in overloaded.value.response.headers
        # The SDKs' own retries (they honour retry-after-ms, ~0.5 s here; thirty of them
        # outlast the drain on a busy box) succeed once the queue drains.
        rejected = _rejected(server)
        retried = [
            pool.submit(lambda: openai.OpenAI(
                base_url=server.base_url + "/v1", api_key=KEYS[0], max_retries=30, timeout=60
            ).chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi"}]).choices[0].finish_reason),
            pool.submit(lambda: anthropic.Anthropic(
                base_url=server.base_url, api_key=KEYS[0], max_retries=30, timeout=60
            ).messages.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi"}]).stop_reason)]
        _until(lambda: _rejected(server) >= rejected + 2)  # both were refused at least once
        fault_file.unlink()
        assert [f.result(timeout=120) for f in retried] == ["length", "max_tokens"]
        assert all(f.result(timeout=120).status_code == 200 for f in held)
    assert refusal_s < 2.0  # refused at once, not after waiting (loose: a loaded 2-core box)


def test_a_flooding_key_leaves_room_for_another(server: ServerProcess, fault_file: Path) -> None:
    fault_file.write_text("stall")
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        flood = [pool.submit(_chat, server, KEYS[0]) for _ in range(8)]
        _until(lambda: sum(f.done() for f in flood) >= 6)  # 6 refused at once, 2 held
        other = pool.submit(_chat, server, KEYS[1])
        _until(lambda: _queued(server) == 3)  # key b's request was admitted beside the flood
        fault_file.unlink()
        statuses = sorted(f.result(timeout=120).status_code for f in flood)
        assert statuses == [200, 200] + [429] * 6, statuses
        assert other.result(timeout=120).status_code == 200
    wait_idle(server.base_url)


def test_a_stalled_step_turns_liveness_and_readiness_until_it_ends(
    server: ServerProcess, fault_file: Path,
) -> None:
    dumps = server.log().count("in before_step")
    fault_file.write_text("stall")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        request = pool.submit(_chat, server, KEYS[1])
        # Waits for the injected stall itself (the watchdog's dump of the engine thread shows
        # it in the fault hook): on a loaded box an ordinary step may pass the limit for a
        # moment first, and end, turning liveness back.
        _until(lambda: server.log().count("in before_step") > dumps
               and _get(server, "/health").json()["status"] == "engine step stalled",
               timeout_s=STALL_S + 30)
        assert _get(server, "/health").status_code == 503
        assert _get(server, "/health/ready").status_code == 503
        assert "thread radixserve-engine" in server.log()  # every thread's stack was logged
        fault_file.unlink()
        assert request.result(timeout=120).status_code == 200
    _until(lambda: _get(server, "/health/ready").status_code == 200)
    assert _get(server, "/health").status_code == 200


def test_a_request_past_its_deadline_is_aborted_and_frees_its_kv(
    server: ServerProcess, fault_file: Path,
) -> None:
    fault_file.write_text("stall")
    started = time.monotonic()
    response = _chat(server, KEYS[1], headers={"x-request-timeout": "0.5"})
    assert 0.4 < time.monotonic() - started < 10
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
    assert response.headers["x-should-retry"] == "false"
    bad = _chat(server, KEYS[1], headers={"x-request-timeout": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout"
    fault_file.unlink()
    metrics = wait_idle(server.base_url)
    assert metrics["kv_cache_tokens{state=private}"] == 0
    assert metrics["kv_cache_tokens{state=protected}"] == 0


def test_sigterm_finishes_streams_in_flight_refuses_new_ones_and_exits_0(
    server: ServerProcess, fault_file: Path,
) -> None:
    # Last in the module: it stops the server (the fixture then finds it exited with 0).
    def stream(key: str) -> list[str | None]:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0,
                           timeout=120) as client:
            chunks = client.chat.completions.create(
                model=MODEL, max_tokens=40, temperature=0, stream=True,
                messages=[{"role": "user", "content": "Count to fifty."}],
                extra_body={"ignore_eos": True})
            return [c.choices[0].finish_reason for c in chunks if c.choices]

    fault_file.write_text("stall")  # all four in flight when the signal comes
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, key) for key in KEYS * 2]  # each key's share: 2
        _until(lambda: _queued(server) == 4)
        server.process.send_signal(signal.SIGTERM)
        _until(lambda: _get(server, "/health/ready").status_code == 503)
        assert _get(server, "/health/ready").json()["status"] == "draining"
        refused = _chat(server, KEYS[1])
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] and refused.headers["retry-after-ms"]
        fault_file.unlink()
        assert [f.result(timeout=120)[-1] for f in streams] == ["length"] * 4
    assert server.process.wait(timeout=60) == 0
