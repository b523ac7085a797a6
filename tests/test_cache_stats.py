"""GET /v1/cache/stats: the stats book's series and tenants without a model, then one real
server (two API keys, --isolate-tenants) driven through the official SDKs, whose endpoint must
agree with the responses' usage and the engine's own counters, and keep tenants apart."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.server.observability.cache_stats import CacheStatsBook, namespace_label
from radixserve.server.serving import Job, JobEnd
from radixserve.testing.server import ServerProcess, read_metrics
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
SYSTEM = "You are a terse assistant. Answer every question in exactly one word. " * 12


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _end(request_id: str, prompt: int, cached: int, ttft: float, namespace: Any = None) -> JobEnd:
    job = Job(list(range(prompt)), SamplingParams(max_tokens=1), namespace)
    return JobEnd(request_id, job, cached, ttft, usage=None)


def test_book_buckets_requests_and_tenants() -> None:
    clock = FakeClock(1000.0)
    book = CacheStatsBook(clock)
    book.record(_end("a", 100, 0, 0.5))
    clock.now = 1000.7  # the same 1 s bucket
    book.record(_end("b", 100, 96, 0.1, namespace="s1"))
    clock.now = 1003.2
    book.record(_end("c", 50, 49, 0.2, namespace="s1"))  # all but the last token: no miss
    book.record(JobEnd("never-ran", Job([1, 2], SamplingParams()), None, None, None))
    points = book.series["5m"].points(clock.now)
    assert len(points) == 300 and points[-1][0] == 1003.0 and points[-4][0] == 1000.0
    first, last = points[-4][1], points[-1][1]
    assert first is not None and last is not None and points[-2][1] is None
    assert (first.requests, first.prompt_tokens, first.cached_tokens) == (2, 200, 96)
    assert first.percentile(0.5) == 0.1 and first.percentile(0.99) == 0.5
    assert (book.totals.requests, book.totals.cached_tokens) == (3, 145)
    assert book.series["1h"].points(clock.now)[-1][1].requests == 3  # type: ignore[union-attr]
    assert {namespace_label(ns): t.requests for ns, t in book.tenants.items()} == {
        "default": 1, "salt:s1": 2}
    a, b, c = book.recent
    assert (a.miss_at, a.miss_token_ids) == (0, tuple(range(8)))
    assert (b.miss_at, b.miss_token_ids) == (96, (96, 97, 98, 99))
    assert (c.miss_at, c.miss_token_ids) == (None, ())
    clock.now += 301  # everything has left the 5 minute window, not the hour
    assert all(b is None for _, b in book.series["5m"].points(clock.now))
    assert sum(b.requests for _, b in book.series["1h"].points(clock.now) if b) == 3


def test_namespace_labels() -> None:
    h = hashlib.sha256(b"k").hexdigest()[:32]
    assert namespace_label(None) == "default"
    assert namespace_label("blue") == "salt:blue"
    assert namespace_label(("tenant", h, None)) == f"tenant:{h[:8]}"
    assert namespace_label(("tenant", h, "x")) == f"tenant:{h[:8]}/salt:x"


# ----- against a real server -----


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--kv-cache-tokens", "4096", "--api-key", KEY_A,
                        "--api-key", KEY_B, "--isolate-tenants") as proc:
        yield proc


def _stats(server: ServerProcess, key: str, window: str = "5m") -> dict[str, Any]:
    response = httpx.get(server.base_url + "/v1/cache/stats", params={"window": window},
                         headers={"authorization": f"Bearer {key}"}, timeout=60)
    response.raise_for_status()
    return response.json()


def _tenant(key: str) -> str:
    return "tenant:" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _walk(nodes: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for node in nodes:
        yield node
        yield from _walk(node["children"])


@pytest.fixture(scope="module")
def workload(server: ServerProcess) -> dict[str, tuple[str, int, int]]:
    """Known traffic, one request at a time: response id -> (tenant label, prompt tokens,
    cached tokens), as the responses' usage reports them."""
    seen: dict[str, tuple[str, int, int]] = {}

    def chat(key: str, question: str, salt: str | None = None) -> None:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0,
                           timeout=300) as client:
            extra = {"cache_salt": salt} if salt else {}
            r = client.chat.completions.create(
                model=MODEL, max_tokens=2, extra_body=extra,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": question}])
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        label = _tenant(key) + (f"/salt:{salt}" if salt else "")
        seen[r.id] = (label, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens)

    for question in ("Sky colour?", "Grass colour?", "Snow colour?"):
        chat(KEY_A, question)
    for question in ("Sea colour?", "Sun colour?"):
        chat(KEY_A, question, salt="s1")
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY_A, max_retries=0,
                             timeout=300) as client:
        m = client.messages.create(model=MODEL, max_tokens=2, system=SYSTEM,
                                   messages=[{"role": "user", "content": "Night colour?"}])
    u = m.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    seen[m.id] = (_tenant(KEY_A), prompt, u.cache_read_input_tokens or 0)
    for question in ("Fire colour?", "Leaf colour?"):
        chat(KEY_B, question)
    time.sleep(1.2)  # let the sampler take a pool sample after the traffic
    return seen


def test_needs_a_key_and_a_known_window(server: ServerProcess) -> None:
    bare = httpx.get(server.base_url + "/v1/cache/stats")
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(server.base_url + "/v1/cache/stats", headers={"x-api-key": "nope"})
    assert wrong.status_code == 401
    bad = httpx.get(server.base_url + "/v1/cache/stats?window=2d", headers={"x-api-key": KEY_A})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "window"


def test_totals_agree_with_usage_and_engine_counters(server: ServerProcess, workload) -> None:
    stats = _stats(server, KEY_A)
    metrics = read_metrics(server.base_url)
    totals = stats["totals"]
    assert totals["requests"] == len(workload) == 8
    assert totals["prompt_tokens"] == sum(p for _, p, _ in workload.values())
    assert totals["cached_tokens"] == sum(c for _, _, c in workload.values()) > 0
    assert totals["cached_tokens"] == metrics["prefix_cache_hits_total"]
    assert totals["prompt_tokens"] == metrics["prefix_cache_queries_total"]
    assert totals["computed_prompt_tokens"] == metrics["prompt_tokens_computed_total"]
    assert totals["hit_rate"] == pytest.approx(totals["cached_tokens"] / totals["prompt_tokens"])
    cost = stats["cost"]
    assert cost["profile"] == "anthropic-1024, openai"
    billed = sum(v for k, v in metrics.items() if k.startswith("request_cost_usd_total"))
    uncached = sum(v for k, v in metrics.items() if k.startswith("request_uncached_cost_usd_total"))
    assert cost["with_cache_usd"] == pytest.approx(billed)
    assert cost["without_cache_usd"] == pytest.approx(uncached)
    assert cost["saved_usd"] > 0 and cost["saved_usd_per_hour"] > 0


def test_series_and_pool_add_up(server: ServerProcess, workload) -> None:
    for window, points in (("5m", 300), ("1h", 60)):
        stats = _stats(server, KEY_B, window)
        series = stats["series"]
        assert len(series["t"]) == len(series["requests"]) == points
        assert sum(series["requests"]) == stats["totals"]["requests"]
        assert sum(series["cached_tokens"]) == stats["totals"]["cached_tokens"]
        assert any(p is not None for p in series["ttft_p50_s"])
        pool = stats["pool"]
        assert pool["total"] == 4096
        assert sum(pool[s] for s in ("free", "evictable", "protected", "pinned", "private")) == 4096
        samples = list(zip(*series["pool"].values(), strict=True))
        sampled = [p for p in samples if p[0] is not None]
        assert sampled and all(sum(p) == 4096 for p in sampled)


def test_tenants_see_their_own_tree_requests_and_figures(server: ServerProcess, workload) -> None:
    for key, other in ((KEY_A, KEY_B), (KEY_B, KEY_A)):
        stats = _stats(server, key)
        mine = {rid: v for rid, v in workload.items() if v[0].startswith(_tenant(key))}
        # Recent requests: exactly this key's, newest first, with the usage's cached tokens.
        assert [r["id"] for r in stats["recent"]] == list(reversed(mine))
        for r in stats["recent"]:
            label, prompt, cached = mine[r["id"]]
            assert (r["namespace"], r["prompt_tokens"], r["cached_tokens"]) == (label, prompt,
                                                                                 cached)
            assert r["miss_at"] == cached and r["miss_text"]  # a new question: a real miss
            assert r["cost_usd"] > 0 and r["ttft_s"] > 0
        # Per tenant, split by cache_salt.
        expected: dict[str, list[int]] = {}
        for label, prompt, cached in mine.values():
            totals = expected.setdefault(label, [0, 0, 0])
            totals[0], totals[1], totals[2] = totals[0] + 1, totals[1] + prompt, totals[2] + cached
        assert {t["namespace"]: [t["requests"], t["prompt_tokens"], t["cached_tokens"]]
                for t in stats["tenants"]} == expected
        # The tree: the shared system prompt, hit by each later request of its namespace.
        nodes = list(_walk(stats["tree"]["roots"]))
        assert nodes and all(n["namespace"].startswith(_tenant(key)) for n in nodes)
        assert not any(n["namespace"].startswith(_tenant(other)) for n in nodes)
        assert stats["tree"]["shown"] == len(nodes) <= stats["tree"]["nodes"]
        roots = {n["namespace"]: n for n in stats["tree"]["roots"]}
        assert set(roots) == set(expected)  # one root per namespace: prompts start alike
        for label, root in roots.items():
            hits = sum(1 for lb, _, cached in mine.values() if lb == label and cached)
            assert root["hits"] == hits and root["served_tokens"] == hits * root["tokens"]
            assert root["depth"] == 0 and root["id"].startswith("n")
        assert "terse assistant" in "".join(n["text"] for n in nodes)
        assert all(n["locks"] == 0 and n["pinned_for_s"] is None for n in nodes)
