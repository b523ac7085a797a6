"""Faults that end the server process, each on a server of its own: a step stuck past the
watchdog's exit limit, and an engine thread that raises. Both must end the process with a
non-zero status and a log that says why, never leave routes hanging."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest

from radixserve.engine.heartbeat import FAULT_FILE_ENV
from radixserve.server.watchdog import EXIT_ENGINE_DIED, EXIT_ENGINE_STUCK
from radixserve.testing.server import ServerProcess, start_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"


def _server(tmp: Path, *flags: str) -> ServerProcess:
    return start_server(["--kv-cache-tokens", "2048", "--num-threads", "2", "--no-access-log",
                         *flags], tmp / "server.log", env={FAULT_FILE_ENV: str(tmp / "fault")})


def _ready(proc: ServerProcess) -> None:
    deadline = time.monotonic() + 300
    while httpx.get(proc.base_url + "/health/ready", trust_env=False).status_code != 200:
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.1)


def _chat(proc: ServerProcess) -> httpx.Response:
    return httpx.post(proc.base_url + "/v1/chat/completions", timeout=120, trust_env=False,
                      json={"model": MODEL, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]})


def test_a_step_stuck_past_the_exit_limit_ends_the_process(tmp_path: Path) -> None:
    proc = _server(tmp_path, "--watchdog-stall", "3", "--watchdog-exit", "6")
    try:
        _ready(proc)
        (tmp_path / "fault").write_text("stall")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            request = pool.submit(_chat, proc)
            assert proc.process.wait(timeout=120) == EXIT_ENGINE_STUCK, proc.log()
            with pytest.raises(httpx.HTTPError):  # the client's connection ends with it
                request.result(timeout=30)
        log = proc.log()
        assert "stall limit 3 s" in log and "--- thread radixserve-engine ---" in log
        assert f"exiting with status {EXIT_ENGINE_STUCK}" in log
    finally:
        proc.process.kill()


def test_an_engine_exception_ends_the_process_with_a_clear_log(tmp_path: Path) -> None:
    proc = _server(tmp_path)
    try:
        _ready(proc)
        (tmp_path / "fault").write_text("raise")
        response = _chat(proc)
        assert response.status_code == 503, response.text  # answered, not left hanging
        assert response.json()["error"]["code"] == "engine_stopped"
        assert proc.process.wait(timeout=60) == EXIT_ENGINE_DIED, proc.log()
        log = proc.log()
        assert "engine loop died" in log and "InjectedFault" in log
        assert f"exiting with status {EXIT_ENGINE_DIED}" in log
    finally:
        proc.process.kill()
