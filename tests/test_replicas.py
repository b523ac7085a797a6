"""`radixserve serve --replicas 2` on a real local Ray cluster: the single server's OpenAI and
Anthropic SDK suites (tests/support) run again through the replicas' ingress, then routing
(prefix vs power of two), tenants, eviction and a replica killed under load.

One cluster for the module: the first server starts it, the others join it (`--ray-address
auto`) with an application of its own; each replica reserves a quarter of a CPU.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from radixserve.model.tokenizer import ChatTokenizer
from radixserve.testing.server import ServerProcess, read_metrics, wait_idle
from tests.support.anthropic_suite import KEY, AnthropicSuite
from tests.support.openai_suite import MAX_REQUEST_BYTES, OpenAISuite
from tests.support.servers import anthropic_client, openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
# 4,096-token pools: the suites' longest prompt (2,000 tokens) fits; pressure is cheap to make.
REPLICA_FLAGS = ("--replicas", "2", "--num-threads", "2", "--cpus-per-replica", "0.25",
                 "--kv-cache-tokens", "4096")


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # A low imbalance threshold (3), so that overloading a replica takes few requests. No
    # OMP_WAIT_POLICY inherited from `make test`: the launcher must set it for the replicas.
    with running_server(tmp_path_factory, *REPLICA_FLAGS, "--max-request-bytes",
                        str(MAX_REQUEST_BYTES), "--router-imbalance-threshold", "3",
                        name="replicas", env={"OMP_WAIT_POLICY": None}) as proc:
        yield proc


@pytest.fixture(scope="module")
def keyed(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ServerProcess]:
    """Replicas behind an API key, routed by power of two choices, on the module's cluster:
    the auth test's server and the routing tests' baseline (Responses' and the prefix
    router's)."""
    with running_server(tmp_path_factory, *REPLICA_FLAGS, "--ray-address", "auto",
                        "--api-key", KEY, "--router", "pow2", name="keyed") as proc:
        yield proc


AUTH = {"authorization": f"Bearer {KEY}"}


# ----- the single server's SDK suites, through the ingress -----
# Left out, to keep `make test` within its budget: the single engine's own submission race (a
# client leaving while its add waits in the engine thread's inbox; behind replicas a submission
# is a stream that is cancelled, as TestOpenAIThroughReplicas's disconnect test checks), and the
# 2,000-token cached_tokens check (the routing test below checks every request's cached_tokens
# through the ingress against a single engine's): both live in test_server_openai.py alone.


class TestOpenAIThroughReplicas(OpenAISuite):
    """The OpenAI suite against the replicas (`server`, and conftest's `client` of it)."""


class TestAnthropicThroughReplicas(AnthropicSuite):
    """The Anthropic suite against the replicas; its auth test against the keyed deployment."""

    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, server: ServerProcess) -> Iterator[anthropic.Anthropic]:
        with anthropic_client(server, KEY) as c:
            yield c

    @pytest.fixture(scope="class")
    @classmethod
    def keyed_server(cls, keyed: ServerProcess) -> ServerProcess:
        return keyed


def test_the_router_counts_nothing_in_flight_once_idle(server: ServerProcess) -> None:
    # The replayed suites' requests finished, failed or were cancelled (some while being
    # routed). Each must have released the load the router counted for it: a count left
    # behind steers every later request away from its replica.
    wait_idle(server.base_url)
    loads: list[Any] = []

    def idle() -> bool:
        loads[:] = [r["routed_in_flight"] for r in _replicas(server)]
        return loads == [0, 0]

    try:
        _until(idle)
    except AssertionError:
        raise AssertionError(f"the router still counts {loads} in flight") from None


# ----- flags -----

@pytest.mark.parametrize("flags, message", [
    (["--router", "pow2"], "--router only apply with --replicas"),
    (["--ray-address", "auto"], "--ray-address only apply with --replicas"),
    (["--replicas", "2", "--router", "pow2", "--router-min-match-tokens", "8"],
     "--router-min-match-tokens set the prefix router"),
    (["--replicas", "2", "--enable-clock-control"], "not available with --replicas"),
    (["--replicas", "2", "--next-turn-prefill", "--prefix-cache", "off"],
     "--next-turn-prefill keeps its prefill in the radix tree"),
    (["--prefix-cache", "hash", "--next-turn-prefill"], "it needs --prefix-cache radix"),
])
def test_flags_that_would_be_ignored_are_refused(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stdout + done.stderr, done


# ----- routing -----

def _prefixes(tokenizer: ChatTokenizer, count: int, tokens: int, tag: str) -> list[str]:
    """`count` distinct texts of about `tokens` tokens each."""
    out = []
    heads = ["Apple", "Boat", "Cloud", "Drum", "Eagle", "Forest", "Guitar", "Harbor", "Island",
             "Jungle", "Kettle", "Lemon"]
    for i in range(count):
        # A distinct first word: no two prompts share even their first token by accident.
        words = [f"{heads[i]} {tag}{i}"] + [
            f"{tag}{i}-{j % 97} item{j} says {['red', 'green', 'blue', 'gold'][j % 4]}."
            for j in range(tokens)]
        text = " ".join(words)
        ids = tokenizer.encode(text)[:tokens]
        out.append(tokenizer.decode(ids))
    return out


def _complete(base_url: str, prompt: str | list[int], max_tokens: int = 1,
              headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra}
    r = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=300,
                   trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(response: dict[str, Any]) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def _queries_by_replica(base_url: str) -> dict[str, float]:
    m = read_metrics(base_url, by_replica=True)
    return {k.split("replica=")[1].rstrip("}"): v for k, v in m.items()
            if k.startswith("prefix_cache_queries_total{")}


def test_replicas_with_more_threads_than_cpus_wait_passively(server: ServerProcess) -> None:
    # 2 threads on 0.25 CPUs each: spinning OpenMP workers would take cores the other
    # replica's threads need.
    replicas = _replicas(server)
    assert len(replicas) == 2
    for replica in replicas:
        environ = Path(f"/proc/{replica['pid']}/environ").read_bytes().split(b"\0")
        assert b"OMP_WAIT_POLICY=PASSIVE" in environ, replica


def _oracle(prompts: list[list[int]]) -> list[int]:
    """What one radix-cached engine (page size 1, nothing evicted) reports as cached: the
    longest common prefix with any earlier prompt, at most all tokens but the last."""
    out = []
    for i, ids in enumerate(prompts):
        best = 0
        for prev in prompts[:i]:
            n = 0
            while n < min(len(ids), len(prev)) and ids[n] == prev[n]:
                n += 1
            best = max(best, n)
        out.append(min(best, len(ids) - 1))
    return out


def _workload(tokenizer: ChatTokenizer, tag: str) -> list[list[int]]:
    """Four 300-token prefixes, 16 requests (4 each, interleaved), distinct questions."""
    prefixes = [tokenizer.encode(p) for p in _prefixes(tokenizer, 4, 300, tag)]
    return [prefixes[i % 4] + tokenizer.encode(f" Question {i}: what does item{i} say?")
            for i in range(16)]


def test_prefix_router_sends_each_prefix_where_it_is_cached(
    server: ServerProcess, keyed: ServerProcess, tokenizer: ChatTokenizer,
) -> None:
    prompts = _workload(tokenizer, "route")
    expected = _oracle(prompts)
    cached = [_cached(_complete(server.base_url, ids)) for ids in prompts]
    # Every request after its prefix's first lands where that prefix is cached: usage matches
    # one engine that saw every request.
    assert cached == expected
    # Power of two choices on the same workload (its own deployment on the same cluster):
    # prefixes land on both replicas and are computed twice.
    before = _queries_by_replica(keyed.base_url)
    cached_pow2 = [_cached(_complete(keyed.base_url, ids, headers=AUTH)) for ids in prompts]
    after = _queries_by_replica(keyed.base_url)
    per_replica = {r: after[r] - before.get(r, 0) for r in after}
    assert sum(cached_pow2) < sum(cached) - 250, (cached_pow2, cached)
    assert len(per_replica) == 2 and min(per_replica.values()) > 0, per_replica


def test_concurrent_first_requests_of_a_new_prefix_meet_on_one_replica(
    server: ServerProcess, tokenizer: ChatTokenizer,
) -> None:
    (prefix,) = _prefixes(tokenizer, 1, 800, "burst")
    before = _queries_by_replica(server.base_url)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda i: _complete(server.base_url, f"{prefix} Q{i}?"),
                                  range(4)))
    wait_idle(server.base_url)
    after = _queries_by_replica(server.base_url)
    grew = {r: after[r] - before.get(r, 0) for r in after if after[r] > before.get(r, 0)}
    assert len(grew) == 1, grew  # all four on one replica: the prefix computed once
    # The engine's in-batch dedup then computes it once there: three of four hit it.
    assert sorted(_cached(r) > 700 for r in responses) == [False, True, True, True]


def _replica_of(server: ServerProcess, send: Callable[[], Any]) -> str:
    before = _queries_by_replica(server.base_url)
    send()
    after = _queries_by_replica(server.base_url)
    grew = [r for r in after if after[r] > before.get(r, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


def _match(server: ServerProcess, prompt: list[int], salt: str | None = None,
           headers: dict[str, str] | None = None) -> dict[str, int]:
    r = httpx.post(server.base_url + "/v1/replicas/match", headers=headers,
                   json={"prompt": prompt, "cache_salt": salt}, timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["replicas"]


def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_tenants_prefixes_are_not_shared_across_salts(
    server: ServerProcess, tokenizer: ChatTokenizer,
) -> None:
    (text,) = _prefixes(tokenizer, 1, 600, "tenant")
    ids = tokenizer.encode(text)
    home = _replica_of(server, lambda: _complete(server.base_url, ids, cache_salt="alpha"))
    _until(lambda: _match(server, ids, "alpha")[home] >= 576)
    # The router's index keeps the namespaces apart: the same tokens under another salt are
    # held nowhere.
    assert set(_match(server, ids, "beta").values()) == {0}
    assert set(_match(server, ids).values()) == {0}
    # And a request under the other salt is routed by load: with its home busy, elsewhere.
    with _busy(server, home, ids, "alpha"):
        other = _replica_of(server, lambda: _complete(server.base_url, ids, cache_salt="beta"))
        assert other != home
        again = _replica_of(server, lambda: _complete(server.base_url, ids,
                                                      cache_salt="alpha"))
        assert again == home  # its own tenant still follows the prefix


def _stream_until(base_url: str, body: dict[str, Any], stop: threading.Event) -> None:
    """A streamed completion, read until it ends or `stop` is set (then abandoned)."""
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=300,
                      trust_env=False) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            if stop.is_set():
                return


class _busy:
    """Keeps `n` long requests running on `replica` (streamed completions of a prompt only
    that replica holds), so load counts against it; abandoned (aborted) on exit."""

    def __init__(self, server: ServerProcess, replica: str, ids: list[int],
                 salt: str | None, n: int = 1) -> None:
        self.server, self.replica, self.ids, self.salt, self.n = server, replica, ids, salt, n
        self.stop = threading.Event()

    def _run(self, i: int) -> None:
        body = {"model": MODEL, "prompt": self.ids + [42 + i], "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "cache_salt": self.salt, "stream": True}
        _stream_until(self.server.base_url, body, self.stop)

    def __enter__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(self.n)
        self.futures = [self.pool.submit(self._run, i) for i in range(self.n)]
        _until(lambda: read_metrics(self.server.base_url, by_replica=True).get(
            f"num_requests_running{{replica={self.replica}}}", 0) >= self.n, timeout_s=30)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for future in self.futures:
            future.result()
        self.pool.shutdown()
        wait_idle(self.server.base_url)  # the aborts have freed the replica


def test_an_overloaded_replica_is_passed_over_despite_its_prefix(
    server: ServerProcess, tokenizer: ChatTokenizer,
) -> None:
    (text,) = _prefixes(tokenizer, 1, 300, "load")
    ids = tokenizer.encode(text)
    home = _replica_of(server, lambda: _complete(server.base_url, ids))
    # Four requests in flight on the prefix's home, none elsewhere: more than the imbalance
    # threshold (3) beyond the least loaded replica, so the prefix is not followed there.
    with _busy(server, home, ids, None, n=4):
        assert _replica_of(server, lambda: _complete(server.base_url, ids)) != home


def test_router_stops_preferring_a_prefix_its_replica_evicted(
    server: ServerProcess, tokenizer: ChatTokenizer,
) -> None:
    (text,) = _prefixes(tokenizer, 1, 400, "evict")
    ids = tokenizer.encode(text)
    home = _replica_of(server, lambda: _complete(server.base_url, ids))
    _until(lambda: _match(server, ids)[home] >= 384)
    # Pool pressure on both replicas: pairs of new 1,400-token prompts sent together split
    # one per replica (load); 3 pairs overflow each 4,096-token pool, oldest (ours) first.
    fillers = _prefixes(tokenizer, 6, 1400, "fill")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for i in range(0, 6, 2):
            list(pool.map(lambda t: _complete(server.base_url, t), fillers[i:i + 2]))
    _until(lambda: _match(server, ids)[home] < 64)
    # Nothing holds it now: the next request goes by load, not to its old home.
    with _busy(server, home, _home_only(server, home, tokenizer, fillers), None):
        assert _replica_of(server, lambda: _complete(server.base_url, ids)) != home


def test_responses_continuations_follow_their_owner_under_power_of_two(
    keyed: ServerProcess,
) -> None:
    # test_replicas_responses.py checks the binding under round-robin; power of two choices
    # would pick either replica for each turn as well.
    instructions = "You are the ferry company's assistant. Answer travellers briefly. " * 10
    with openai_client(keyed, KEY) as client:
        def turn(text: str, previous: str | None) -> tuple[str, Any]:
            out: list[Any] = []
            replica = _replica_of(keyed, lambda: out.append(client.responses.create(
                model=MODEL, instructions=instructions, input=text, temperature=0,
                max_output_tokens=8, previous_response_id=previous)))
            return replica, out[0]

        home, r = turn("Are dogs allowed on board?", None)
        for question in ("On a lead?", "In the cabin?", "And cats?", "And birds?"):
            replica, r = turn(question, r.id)
            assert replica == home  # by chance alone: 1 in 16 over these four turns
    # A continuation routed to its owner releases the load it was counted for, as any does.
    _until(lambda: [r["routed_in_flight"] for r in _replicas(keyed, AUTH)] == [0, 0])


@pytest.fixture
def one_each(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[ServerProcess]:
    """Replicas that take one request at a time, on the module's cluster: a second request
    waits in the router until one is free. A fresh deployment: the test needs both replicas
    idle when its two holders arrive."""
    with running_server(tmp_path_factory, *REPLICA_FLAGS, "--ray-address", "auto",
                        "--replica-max-ongoing", "1", name="one_each") as proc:
        yield proc


def test_a_request_whose_caller_leaves_before_it_is_sent_releases_its_load(
    one_each: ServerProcess,
) -> None:
    url = one_each.base_url
    stop = threading.Event()

    def hold(i: int) -> None:
        # Long enough to outlast the test on a fast CPU; abandoned once it is done.
        _stream_until(url, {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 3000,
                            "temperature": 0, "ignore_eos": True, "stream": True}, stop)

    def in_flight() -> list[int]:
        return [r["routed_in_flight"] for r in _replicas(one_each)]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        holders = [pool.submit(hold, i) for i in range(2)]
        try:
            _until(lambda: in_flight() == [1, 1], timeout_s=30)
            # Both replicas are full: this request waits to be routed, and its caller leaves.
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi",
                           "max_tokens": 2}, timeout=1.5, trust_env=False)
            _until(lambda: in_flight() == [1, 1])
        finally:
            stop.set()
            for holder in holders:
                holder.result()
    wait_idle(url)
    # It was never sent, so no completion released it: the router must have seen it go.
    _until(lambda: in_flight() == [0, 0])
    assert _complete(url, "Hi", max_tokens=2)["usage"]["completion_tokens"] == 2
    _until(lambda: in_flight() == [0, 0])  # Serve reports the finish just after the reply


def _home_only(server: ServerProcess, home: str, tokenizer: ChatTokenizer,
               fillers: list[str]) -> list[int]:
    """A filler prompt the router knows only `home` holds."""
    for text in reversed(fillers):
        ids = tokenizer.encode(text)
        held = _match(server, ids)
        if held[home] > 1200 and all(v == 0 for r, v in held.items() if r != home):
            return ids
    raise AssertionError("no filler is held by the home replica alone")


# ----- faults -----

def test_a_killed_replica_fails_nothing_it_can_retry_and_leaves_the_index(
    server: ServerProcess, tokenizer: ChatTokenizer,
) -> None:
    # Last in the module: its server then logs the replica's death, which nothing else reads.
    proc, auth = server, None
    (text,) = _prefixes(tokenizer, 1, 300, "fault")
    ids = tokenizer.encode(text)
    victim = _replica_of(proc, lambda: _complete(proc.base_url, ids, headers=auth))
    pid = {r["replica"]: r["pid"] for r in _replicas(proc, auth)}[victim]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 150, "temperature": 0,
            "ignore_eos": True}

    def plain(i: int) -> httpx.Response:
        return httpx.post(proc.base_url + "/v1/completions", headers=auth,
                          json={**body, "prompt": ids + [100 + i]}, timeout=120,
                          trust_env=False)

    first_token = threading.Event()

    def streamed() -> list[str]:
        with httpx.stream("POST", proc.base_url + "/v1/completions", headers=auth,
                          json={**body, "stream": True}, timeout=120, trust_env=False) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first_token.set()
            return lines

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        plains = [pool.submit(plain, i) for i in range(3)]
        stream = pool.submit(streamed)
        # All four follow the prefix to the victim; kill it once they are generating and the
        # stream has sent a token (before that, the ingress may run it again elsewhere).
        _until(lambda: first_token.is_set() and read_metrics(proc.base_url, by_replica=True).get(
            f"num_requests_running{{replica={victim}}}", 0) >= 4, timeout_s=60)
        os.kill(pid, signal.SIGKILL)
        responses = [f.result(timeout=120) for f in plains]
        lines = stream.result(timeout=120)
    # Non-streaming requests ran again on the other replica; none failed.
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 150 for r in responses)
    # The stream had sent tokens: it ends with an error event (and [DONE]), never hangs.
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert any("choices" in e and e["choices"][0]["text"] for e in events)
    assert events[-1]["error"]["code"] == "replica_lost", events[-1]
    # The dead replica's prefixes left the router's index at once, and it is routed no more.
    assert victim not in _match(proc, ids, headers=auth)
    assert victim not in {r["replica"] for r in _replicas(proc, auth)}
    assert httpx.get(proc.base_url + "/health", trust_env=False).status_code == 200
    _complete(proc.base_url, ids, headers=auth)  # still serving


def _replicas(proc: ServerProcess, headers: dict[str, str] | None = None
              ) -> list[dict[str, Any]]:
    r = httpx.get(proc.base_url + "/v1/replicas", headers=headers, timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["replicas"]
