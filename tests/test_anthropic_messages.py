"""The Anthropic Messages API through the official `anthropic` SDK against a real server process
in engine accounting (the truth): breakpoints write then read, usage arithmetic streamed and
not, TTL segments, count_tokens, pre-warming, stop sequences, auth, errors, cost headers; and
the content blocks of a stream with tool calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from radixserve.testing.server import ServerProcess
from tests.support.anthropic_suite import KEY, AnthropicSuite
from tests.support.servers import anthropic_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--api-key", KEY, name="anthropic") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic_client(server, KEY) as c:
        yield c


@pytest.fixture(scope="module")
def keyed_server(server: ServerProcess) -> ServerProcess:
    """The auth test's server: this module's server already wants KEY."""
    return server


class TestSingleServer(AnthropicSuite):
    """The suite against one server process."""


