"""The Responses API behind `--replicas 2` on a real local Ray cluster, routed round-robin (the
policy that would otherwise send consecutive turns to different replicas): a continuation by
`previous_response_id` lands on the replica that generated the response it continues and reads
its whole sequence from that replica's cache; with that replica killed, the continuation runs on
the other one from the ingress's store and answers the same. (test_replicas.py checks the
binding under power of two choices too, on its keyed deployment.)"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from radixserve.server.response_store import ResponseStore
from radixserve.testing.server import ServerProcess, read_metrics
from tests.support.servers import openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "You are the ferry company's assistant. Answer travellers briefly. " * 10


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def server(store_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--replicas", "2", "--num-threads", "2",
                        "--cpus-per-replica", "0.25", "--kv-cache-tokens", "4096",
                        "--router", "round-robin", "--responses-dir", str(store_dir),
                        name="replicas") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def _queries_by_replica(server: ServerProcess) -> dict[str, float]:
    m = read_metrics(server.base_url, by_replica=True)
    return {k.split("replica=")[1].rstrip("}"): v for k, v in m.items()
            if k.startswith("prefix_cache_queries_total{")}


def _served_by(server: ServerProcess, send: Callable[[], Any]) -> tuple[str, Any]:
    """The replica that served `send()` (the one whose prefix-cache queries grew), and its
    result."""
    before = _queries_by_replica(server)
    result = send()
    after = _queries_by_replica(server)
    grew = [r for r in after if after[r] > before.get(r, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0], result


def _replicas(server: ServerProcess) -> dict[str, int]:
    r = httpx.get(server.base_url + "/v1/replicas", timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    return {entry["replica"]: entry["pid"] for entry in r.json()["replicas"]}


def _owner(store_dir: Path, response_id: str) -> str | None:
    stored = ResponseStore(store_dir, 2**30, 3600.0, time.time).get(response_id, "")
    assert stored is not None
    return stored.replica


def _turn(client: openai.OpenAI, text: str, previous: str | None = None) -> Any:
    return client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=text,
                                   temperature=0, max_output_tokens=8,
                                   previous_response_id=previous)


def test_continuations_land_on_the_owner_and_hit_its_cache(
    server: ServerProcess, client: openai.OpenAI, store_dir: Path,
) -> None:
    home, r = _served_by(server, lambda: _turn(client, "When does the first ferry leave?"))
    assert _owner(store_dir, r.id) == home
    for question in ("And the last one?", "Is there a night ferry?", "Can I take a bike?"):
        whole = r.usage.input_tokens + r.usage.output_tokens
        replica, r = _served_by(server, lambda q=question, p=r.id: _turn(client, q, p))
        # Round-robin alone would alternate; the bound job follows its stored response.
        assert replica == home
        assert r.usage.input_tokens_details.cached_tokens >= whole - 1
        assert _owner(store_dir, r.id) == home
    # Reading and deleting go through the ingress's store, whichever replica made the response.
    assert client.responses.retrieve(r.id).output_text == r.output_text
    items = client.responses.input_items.list(r.id).data
    assert [item.content[0].text for item in items] == ["Can I take a bike?"]  # type: ignore[union-attr]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_with_the_owner_gone_another_replica_answers_the_same(
    server: ServerProcess, client: openai.OpenAI, store_dir: Path,
) -> None:
    # Last in the module: its server then logs the replica's death.
    home, first = _served_by(server, lambda: _turn(client, "How long is the crossing?"))
    replica, on_owner = _served_by(server, lambda: _turn(client, "And by night?", first.id))
    assert replica == home
    os.kill(_replicas(server)[home], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while home in _replicas(server):
        assert time.monotonic() < deadline, "the dead replica is still listed"
        time.sleep(0.2)
    other, again = _served_by(server, lambda: _turn(client, "And by night?", first.id))
    assert other != home
    # Recomputed from the stored tokens (nothing of them is cached there): the same answer.
    assert again.usage.input_tokens == on_owner.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    assert again.output_text == on_owner.output_text
    assert _owner(store_dir, again.id) == other
