"""`--metrics-compat vllm`: /metrics also carries `vllm:` twins, equal sample for sample to our
originals, so aiperf and vLLM's Grafana boards read them; HEAD on /metrics and /health (aiperf
probes with HEAD); and no twins without the flag."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.bench.server_metrics import parse_counters
from radixserve.server.app import create_app
from radixserve.server.observability.metrics import PREFIX, ServerMetrics
from radixserve.server.observability.metrics_compat import VLLM_NAMES, VLLM_PREFIX
from radixserve.testing.server import ServerProcess
from tests.support.fakes import IdleEngine
from tests.support.servers import running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _families(text: str, prefix: str) -> dict[str, Samples]:
    """Family name without `prefix` -> {(sample suffix, labels without engine): value}; the
    counters' and histograms' `_created` timestamps (families of their own) are left out."""
    found: dict[str, Samples] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix) or family.name.endswith("_created"):
            continue
        samples = found.setdefault(family.name.removeprefix(prefix), {})
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "engine"))
            samples[sample.name.removeprefix(family.name), labels] = sample.value
    return found


def _assert_twins_match(text: str) -> set[str]:
    """Every original vLLM has a name for has its twins, with the same samples; returns the
    twins' names."""
    ours, theirs = _families(text, PREFIX), _families(text, VLLM_PREFIX)
    for name, twins in VLLM_NAMES.items():
        for twin in twins:
            assert theirs.get(twin) == ours[name], (name, twin)
    assert set(theirs) == {twin for twins in VLLM_NAMES.values() for twin in twins}
    return set(theirs)


def test_twins_in_process() -> None:
    metrics = ServerMetrics("m", compat="vllm")
    metrics.prompt_tokens.inc(7)
    metrics.time_to_first_token.observe(0.03)
    metrics.request_finished("stop")
    text = metrics.render(None).decode()
    assert 'vllm:prompt_tokens_total{engine="0",model_name="m"} 7.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' in text
    assert 'vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 0.0' in text
    # Without an engine snapshot the engine's families are absent, and so are their twins.
    assert "prefix_cache_hits" not in text
    # A client that reads counters by their bare names counts each once, not once per name.
    assert parse_counters(text)["prompt_tokens_total"] == 7


def test_no_twins_without_the_flag() -> None:
    async def scrape() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(IdleEngine()))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.get("/metrics")

    response = asyncio.run(scrape())
    assert response.status_code == 200 and "radixserve:prompt_tokens_total" in response.text
    assert "vllm:" not in response.text


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, "--metrics-compat", "vllm") as proc:
        yield proc


def test_twins_after_a_request(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        c.completions.create(model="SmolLM2-135M-Instruct", prompt="Name a colour:",
                             max_tokens=3)
    text = httpx.get(server.base_url + "/metrics", trust_env=False).text
    assert "kv_cache_usage_perc" in _assert_twins_match(text)
    vllm = _families(text, VLLM_PREFIX)
    assert vllm["prompt_tokens"][("_total", (("model_name", "SmolLM2-135M-Instruct"),))] > 0
    assert vllm["time_to_first_token_seconds"][
        ("_count", (("model_name", "SmolLM2-135M-Instruct"),))] == 1
    assert sum(v for (suffix, _), v in vllm["request_success"].items() if suffix == "_total") == 1


@pytest.mark.parametrize("path", ["/metrics", "/health"])
def test_head_answers_like_get_without_a_body(server: ServerProcess, path: str) -> None:
    head = httpx.head(server.base_url + path, trust_env=False)
    get = httpx.get(server.base_url + path, trust_env=False)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and get.content != b""
    assert head.headers["content-type"] == get.headers["content-type"]
