"""Real servers and SDK clients for tests: `radixserve serve` with test defaults around
radixserve.testing.server, and OpenAI/Anthropic clients pointed at one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anthropic
import openai
import pytest

from radixserve.testing.server import ServerProcess, start_server

# A generous client timeout: on a loaded 2-core machine a long prompt can take minutes.
CLIENT_TIMEOUT_S = 300


@contextlib.contextmanager
def running_server(tmp_path_factory: pytest.TempPathFactory, *flags: str,
                   name: str = "server", env: dict[str, str | None] | None = None,
                   ) -> Iterator[ServerProcess]:
    """`radixserve serve` on the default model with a small pool, 2 threads, invariant
    checks and its own Responses store, plus `flags` (a later flag wins over a default); it
    must stop cleanly and log no serious error. `env` as start_server's."""
    directory = tmp_path_factory.mktemp(name)
    # A Responses store of its own, not the one in the user's cache home. No queue-wait bound:
    # these suites check serving, and a busy 2-core machine's measured prefill rate would
    # refuse their concurrent requests (test_server_overload checks it).
    proc = start_server(["--kv-cache-tokens", "8192", "--num-threads", "2", "--debug-invariants",
                         "--no-access-log", "--responses-dir", str(directory / "responses"),
                         "--max-queue-wait", "0", *flags],
                        directory / "server.log", env=env)
    yield proc
    assert proc.stop() == 0, proc.log()
    assert not proc.serious_errors(), proc.log()


def openai_client(server: ServerProcess, api_key: str = "unused",
                  timeout: float | None = CLIENT_TIMEOUT_S) -> openai.OpenAI:
    """An OpenAI SDK client for `server`'s /v1 routes that never retries (a retry would hide a
    failure); use it as a context manager."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0,
                         timeout=timeout)


def anthropic_client(server: ServerProcess, api_key: str = "unused",
                     timeout: float | None = CLIENT_TIMEOUT_S) -> anthropic.Anthropic:
    """An Anthropic SDK client for `server` that never retries; use it as a context manager."""
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0,
                               timeout=timeout)
