"""A stored response's whole token sequence, output included, is pinned in the radix cache from
its creation: on a small pool, a flood of unrelated prompts that evicts every unpinned entry
leaves it, so the continuation reads all of it (less the last sampled token, which has no KV)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from radixserve.testing.server import ServerProcess
from tests.support.servers import openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
POOL = 1024
INSTRUCTIONS = "You are the harbour master's assistant. Answer sailors briefly. " * 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--kv-cache-tokens", str(POOL),
                        "--max-model-len", str(POOL)) as proc:
        yield proc


def _complete(server: ServerProcess, prompt: str) -> int:
    """Sends a one-token completion of `prompt`; its cached_tokens."""
    r = httpx.post(server.base_url + "/v1/completions", trust_env=False, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_output_stays_cached_through_a_flood(server: ServerProcess) -> None:
    probe = "Unpinned probe text about lighthouses and tides. " * 8
    with openai_client(server) as client:
        first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, temperature=0,
                                        input="When is high tide?", max_output_tokens=32)
        assert first.usage is not None and first.usage.output_tokens > 8
        whole = first.usage.input_tokens + first.usage.output_tokens
        _complete(server, probe)
        # More unrelated tokens than the pool holds beside the pinned sequence.
        for i in range(4):
            _complete(server, f"Flood {i}: " + f"cargo manifest line {i} of many; " * 50)
        assert _complete(server, probe) == 0  # the flood evicted what nothing pins
        second = client.responses.create(model=MODEL, input="And low tide?", temperature=0,
                                         previous_response_id=first.id, max_output_tokens=4)
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= whole - 1
