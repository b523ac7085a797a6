"""One benchmark run end to end: send the workload, count tokens with the model's tokenizer,
work out the hit rate the workload implies, summarise, and package it as a `BenchResult`.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

import radixserve
from radixserve.bench.ideal import SentPrompt, ideal_cached_tokens
from radixserve.bench.loadgen import LoadConfig, LoadResult, run_load
from radixserve.bench.metrics import summarize
from radixserve.bench.results import BenchResult
from radixserve.bench.server_metrics import counter_delta
from radixserve.bench.workloads import Message, Workload, with_defaults
from radixserve.model.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class RunInfo:
    """How the run is described in its result; none of it changes what is sent."""

    command: str = ""
    system: str = ""
    label: str = ""
    tokenizer_path: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    ideal_page_size: int = 1
    goodput_slos_ms: Mapping[str, float] = field(default_factory=dict)


def annotate(result: LoadResult, tokenizer: ChatTokenizer, chat: bool) -> None:
    """Fills each record's client-side prompt count, output count (when the server reported
    none) and the cached tokens the workload implies. Done after the run to keep tokenising
    off the timed path."""
    def prompt_ids(sent: list[Message] | str) -> list[int]:
        if chat:
            assert isinstance(sent, list)
            return tokenizer.encode_chat(sent)
        assert isinstance(sent, str)
        return tokenizer.encode(sent, add_special_tokens=True)

    def cached_reply(text: str, finish_reason: str | None) -> list[int]:
        # The last token sampled never went through the model, so no cache holds its KV: cut
        # at the length limit it is the reply's last token; at a stop it is the EOS, not in
        # the text. (Re-tokenised text may differ from the ids generated; the server's own
        # ids are not in the API.)
        reply = tokenizer.encode(text, add_special_tokens=False)
        return reply[:-1] if finish_reason == "length" else reply

    # Warm-ups went first and finished before the run: the cache may hold them.
    prompts = [
        SentPrompt(-1.0, -1.0, prompt_ids(sent), cached_reply(reply, finish))
        for sent, reply, finish in result.warmups
    ]
    for record in result.records:
        ids = prompt_ids(result.sent[record.index])
        reply = tokenizer.encode(record.generated_text, add_special_tokens=False)
        record.client_prompt_tokens = len(ids)
        if record.success and record.output_tokens is None:
            record.output_tokens = len(reply)
            record.output_tokens_source = "tokenizer"
        end = record.end if record.success else None
        prompts.append(SentPrompt(record.start, end, ids,
                                  cached_reply(record.generated_text, record.finish_reason),
                                  record.cache_salt or ""))
    implied = ideal_cached_tokens(prompts)[len(result.warmups):]
    for record, ideal in zip(result.records, implied, strict=True):
        record.ideal_cached_tokens = ideal


def environment() -> dict[str, Any]:
    return {
        "radixserve": radixserve.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


async def run_benchmark(
    workload: Workload,
    tokenizer: ChatTokenizer,
    config: LoadConfig,
    info: RunInfo,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BenchResult:
    chat = config.endpoint == "chat"

    def render(messages: list[Message]) -> str:
        return tokenizer.apply_chat_template(messages)

    load = await run_load(workload, config, render, transport)
    annotate(load, tokenizer, chat)
    delta = counter_delta(load.metrics_before, load.metrics_after)
    summary = summarize(
        load.records,
        load.duration_s,
        not_sent=load.not_sent,
        server_delta=delta,
        ideal_page_size=info.ideal_page_size,
        goodput_slos_ms=info.goodput_slos_ms,
    )
    load_settings = {
        "max_concurrency": config.max_concurrency,
        "request_rate": None if config.request_rate == float("inf") else config.request_rate,
        "burstiness": config.burstiness,
        "seed": config.seed,
        "num_warmups": config.num_warmups,
        "time_limit_s": config.time_limit_s,
        "request_timeout_s": config.request_timeout_s,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        "goodput_slos_ms": dict(info.goodput_slos_ms),
    }
    return BenchResult(
        command=info.command,
        system=info.system or config.root_url,
        label=info.label,
        base_url=config.root_url,
        endpoint=config.endpoint,
        model=load.model,
        tokenizer=info.tokenizer_path,
        started_at=load.started_at,
        load=load_settings,
        workload={
            **asdict(with_defaults(workload.spec)),
            "description": workload.description,
            "num_requests": len(workload.requests),
        },
        summary=summary,
        server_metrics={"before": load.metrics_before, "after": load.metrics_after,
                        "delta": delta},
        records=load.records,
        metadata=dict(info.metadata),
        environment=environment(),
    )
