"""The load generator, result file, summary table and report against a scripted in-process
OpenAI-compatible server (httpx MockTransport): what is sent, what is recorded, the bounds."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from radixserve.bench.cli import command_line
from radixserve.bench.loadgen import BenchError, LoadConfig
from radixserve.bench.results import BenchResult
from radixserve.bench.run import RunInfo, run_benchmark
from radixserve.bench.table import summary_table
from radixserve.bench.workloads import Workload, WorkloadSpec, build_workload
from radixserve.cli import build_parser, main
from radixserve.model.tokenizer import ChatTokenizer

pytestmark = [pytest.mark.model]

WORDS = ["one", " two", " three"]


class FakeServer:
    """Streams "one two three" for every request, with usage (cached_tokens = 4) unless told
    otherwise; keeps the bodies it got and the most streams it had open at once."""

    def __init__(
        self,
        delay: float = 0.005,
        usage: bool = True,
        fail: set[int] | None = None,
        fail_warmup: bool = False,
    ) -> None:
        self.delay, self.usage, self.fail, self.fail_warmup = (
            delay,
            usage,
            fail or set(),
            fail_warmup,
        )
        self.bodies: list[dict] = []
        self.open = self.peak = 0
        self.queries = self.hits = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        if path == "/metrics":
            return httpx.Response(
                200,
                text=(
                    f'radixserve:prefix_cache_queries_total{{model_name="m"}} {self.queries}\n'
                    f'radixserve:prefix_cache_hits_total{{model_name="m"}} {self.hits}\n'
                ),
            )
        body = json.loads(request.content)
        self.bodies.append(body)
        warmup = "Warm-up" in json.dumps(body)
        if (warmup and self.fail_warmup) or (not warmup and len(self.bodies) - 1 in self.fail):
            return httpx.Response(500, json={"error": {"message": "scripted failure"}})
        if not warmup:
            self.queries += 10
            self.hits += 4
        return httpx.Response(
            200,
            content=self.stream(path.endswith("/chat/completions")),
            headers={"content-type": "text/event-stream"},
        )

    async def stream(self, chat: bool):  # noqa: ANN201 - an async generator of SSE bytes
        def event(data: dict) -> bytes:
            return f"data: {json.dumps(data)}\n\n".encode()

        self.open += 1
        self.peak = max(self.peak, self.open)
        if chat:  # the opening role-only chunk carries no token and must not set TTFT
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for word in WORDS:
            await asyncio.sleep(self.delay)
            piece = {"delta": {"content": word}} if chat else {"text": word}
            yield event({"choices": [{"index": 0, **piece, "finish_reason": None}]})
        end = {"delta": {}} if chat else {"text": ""}
        yield event({"choices": [{"index": 0, **end, "finish_reason": "length"}]})
        if self.usage:
            yield event(
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 10,
                        "completion_tokens": 3,
                        "total_tokens": 13,
                        "prompt_tokens_details": {"cached_tokens": 4},
                    },
                }
            )
        # Counted closed before the last event: the client stops reading at [DONE] and
        # the generator is only finalised later.
        self.open -= 1
        yield b"data: [DONE]\n\n"


def _run(
    tokenizer: ChatTokenizer,
    server: FakeServer,
    spec: WorkloadSpec | Workload,
    info: RunInfo | None = None,
    **load: object,
) -> BenchResult:
    config = LoadConfig(base_url="http://bench.test/v1", progress=False, **load)  # type: ignore[arg-type]
    workload = spec if isinstance(spec, Workload) else build_workload(spec, tokenizer)
    return asyncio.run(
        run_benchmark(workload, tokenizer, config, info or RunInfo(), transport=server.transport())
    )


def test_multi_turn_chat_run_records_everything(tokenizer: ChatTokenizer) -> None:
    server = FakeServer()
    spec = WorkloadSpec(
        "multi-turn", num_prompts=2, prefix_len=8, suffix_len=4, num_turns=2, output_len=3
    )
    result = _run(tokenizer, server, spec, max_concurrency=2, num_warmups=1)
    assert result.model == "fake-model"
    warmup, *sent = server.bodies
    assert "Warm-up" in json.dumps(warmup) and len(sent) == 4
    for body in sent:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model" and body["max_tokens"] == 3
    second_turns = [b for b in sent if len(b["messages"]) == 4]
    assert len(second_turns) == 2
    for body in second_turns:  # the reply the server actually streamed is in the history
        assert body["messages"][2] == {"role": "assistant", "content": "one two three"}
    s = result.summary
    assert (s.completed, s.failed, s.not_sent) == (4, 0, 0)
    for r in result.records:
        assert r.success and r.ttft is not None and len(r.itl) == 2
        assert r.output_tokens == 3 and r.output_tokens_source == "usage"
        assert (r.prompt_tokens, r.cached_tokens) == (10, 4)
        assert r.client_prompt_tokens == len(
            tokenizer.encode_chat(
                build_workload(spec, tokenizer).conversation(
                    r.index, {r.parent: "one two three"} if r.parent is not None else {}
                )
            )
        )
        assert r.latency >= r.ttft >= 0
    # Turn 2 extends turn 1's prompt and reply: the implied reuse is at least turn 1's prompt.
    by_index = {r.index: r for r in result.records}
    for r in result.records:
        if r.parent is not None:
            assert r.ideal_cached_tokens >= by_index[r.parent].client_prompt_tokens
    assert s.cache.usage_hit_rate == pytest.approx(0.4)
    assert s.cache.metrics_queries == 40 and s.cache.metrics_hit_rate == pytest.approx(0.4)
    assert s.peak_concurrency <= 2 and server.peak <= 2
    assert s.ttft.count == 4 and s.itl.count == 8


def test_completions_without_usage(tokenizer: ChatTokenizer) -> None:
    server = FakeServer(usage=False)
    spec = WorkloadSpec("shared-prefix", num_prompts=3, prefix_len=8, suffix_len=4)
    result = _run(tokenizer, server, spec, endpoint="completions", num_warmups=0)
    for body in server.bodies:  # the chat template is rendered client-side
        assert body["prompt"].startswith("<|im_start|>system\n")
        assert body["prompt"].endswith("<|im_start|>assistant\n")
    for r in result.records:
        assert r.output_tokens == len(tokenizer.encode("one two three", add_special_tokens=False))
        assert r.output_tokens_source == "tokenizer"
        assert r.cached_tokens is None and r.prompt_tokens is None
        assert r.client_prompt_tokens == len(tokenizer.encode(server.bodies[r.index]["prompt"]))
    assert result.summary.cache.usage_hit_rate is None
    assert result.summary.cache.usage_requests_reported == 0


def test_salt_goes_in_the_body_and_namespaces_the_implied_rate(tokenizer: ChatTokenizer) -> None:
    server = FakeServer()
    spec = WorkloadSpec(
        "salted", num_prompts=2, prefix_len=16, suffix_len=4, num_prefixes=1, num_tenants=2
    )
    result = _run(tokenizer, server, spec, max_concurrency=1, num_warmups=0)
    salts = [b["cache_salt"] for b in server.bodies]
    assert len(set(salts)) == 2 and salts[0] == salts[2]
    ideal = [r.ideal_cached_tokens for r in result.records]
    # Prompt 0 is new to both tenants; prompt 1 shares the system prompt within each tenant.
    assert ideal[0] == ideal[1] == 0
    assert ideal[2] == ideal[3] > 16


def test_failures_skip_dependents(tokenizer: ChatTokenizer) -> None:
    server = FakeServer(fail={0})
    spec = WorkloadSpec("multi-turn", num_prompts=2, prefix_len=8, suffix_len=4, num_turns=3)
    result = _run(tokenizer, server, spec, max_concurrency=1, num_warmups=0)
    s = result.summary
    assert s.failed == 1 and "HTTP 500" in result.records[0].error
    assert s.not_sent == 2 and s.completed == 3  # the failed conversation's later turns


def test_time_limit_and_rate_bound_the_run(tokenizer: ChatTokenizer) -> None:
    server = FakeServer(delay=0.5)
    spec = WorkloadSpec("unique", num_prompts=20, prefix_len=4, suffix_len=2)
    result = _run(tokenizer, server, spec, request_rate=10.0, time_limit_s=0.6, num_warmups=0)
    s = result.summary
    assert result.records and all(not r.success for r in result.records)
    assert all(r.error == "cancelled at the time limit" for r in result.records)
    assert s.not_sent == 20 - len(result.records) > 10  # arrivals 0.1 s apart, stopped at 0.6
    assert s.duration_s < 1.5


def test_failed_warmup_stops_the_run(tokenizer: ChatTokenizer) -> None:
    server = FakeServer(fail_warmup=True)
    with pytest.raises(BenchError, match="warm-up"):
        _run(tokenizer, server, WorkloadSpec("unique", num_prompts=1), num_warmups=1)


def _report_inputs(tokenizer: ChatTokenizer, tmp_path: Path) -> list[Path]:
    paths = []
    small = dict(prefix_len=8, suffix_len=4, num_prefixes=1)
    names = ("shared-prefix", "unique", "identical", "trap-timestamp")
    workloads = {
        n: build_workload(WorkloadSpec(n, num_prompts=5, **small), tokenizer) for n in names
    }
    for mode in ("radix", "hash", "off"):
        for workload in names:
            for concurrency in (1, 5):
                spec = workloads[workload]
                info = RunInfo(
                    command=f"radixserve bench --workload {workload}",
                    system=f"radixserve-{mode}",
                    metadata={"prefix_cache": mode},
                )
                result = _run(
                    tokenizer,
                    FakeServer(delay=0.001),
                    spec,
                    info,
                    max_concurrency=concurrency,
                    num_warmups=0,
                )
                paths.append(result.save(tmp_path / f"{mode}-{workload}-{concurrency}.json"))
    return paths


def test_results_round_trip_and_report(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    paths = _report_inputs(tokenizer, tmp_path)
    loaded = BenchResult.load_file(paths[0])
    original = json.loads(paths[0].read_text())
    assert loaded.to_json() == original
    assert "Serving Benchmark Result" in summary_table(loaded)
    assert "Hit rate, from usage (cached/prompt)" in summary_table(loaded)

    out = tmp_path / "report"
    markdown = tmp_path / "BENCHMARKS.md"
    assert (
        main(["bench", "report", *map(str, paths), "--out", str(out), "--markdown", str(markdown)])
        == 0
    )
    text = markdown.read_text()
    for png in ("latency_vs_concurrency.png", "throughput.png", "hit_rate.png", "cache_modes.png"):
        assert (out / png).stat().st_size > 1000
        assert f"(report/{png})" in text  # linked relative to the markdown
    for heading in (
        "## Runs",
        "## Prefix cache: radix vs hash vs off",
        "Essentially all of a radix engine's advantage",
        "identical requests",
        "### The traps",
        "## Commands",
    ):
        assert heading in text
    assert "radixserve bench --workload identical" in text
    assert "radixserve bench report" in text
    assert "c=5 / c=1" in text


def test_bench_command_line_is_reproducible() -> None:
    parser = build_parser()
    argv = [
        "bench",
        "--workload",
        "agent",
        "--max-concurrency",
        "4",
        "--api-key",
        "sk-secret",
        "--metadata",
        "prefix_cache=radix",
        "--goodput",
        "ttft:500",
        "e2el:2000",
        "--no-progress",
    ]
    args = parser.parse_args(argv)
    command = command_line(args.bench_parser, args, ["bench"])
    assert "sk-secret" not in command and "--api-key REDACTED" in command
    again = parser.parse_args(command.split()[1:])
    for name in (
        "workload",
        "max_concurrency",
        "metadata",
        "goodput",
        "no_progress",
        "prefix_len",
        "request_rate",
    ):
        assert getattr(again, name) == getattr(args, name)
    assert math.isinf(again.request_rate)
