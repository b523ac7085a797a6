"""An agent conversation over the Responses API, continued by previous_response_id, beside the
same conversation re-sent whole: to radixserve's chat completions, and to llama-server's
(stateless) /v1/responses when a binary is given. Then the response store's bound under 10,000
stored responses.

Each of --conversations agents (run concurrently) has --instructions-tokens of instructions and
one function tool, and runs --turns turns: every turn forces one call, whose output (a tool
result of 200-500 tokens) is the next turn's input. Reported per turn: TTFT (to the first
streamed delta) and the cached share of the prompt; and, for scale, the last turn's prompt
prefilled cold: one conversation's alone, and every conversation's at once (the same load
with nothing cached).

    .venv/bin/python benchmarks/bench_responses.py --out results/responses.json
    .venv/bin/python benchmarks/bench_responses.py --conversations 4 --turns 4 \\
        --instructions-tokens 500 --llama-server LLAMA_CPP/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench.textgen import WordBank
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.server.response_store import ResponseStore, StoredResponse
from radixserve.testing.server import ServerProcess, free_port, start_server

MODEL = "bench-model"
TOOL = {"type": "function", "name": "lookup", "description": "Looks a record up.",
        "parameters": {"type": "object", "required": ["query"],
                       "properties": {"query": {"type": "string", "maxLength": 24}}}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


async def _sse(client: httpx.AsyncClient, path: str, body: dict[str, Any]
               ) -> tuple[float, list[dict[str, Any]]]:
    """(seconds to the first output, every event) of a streamed POST: the first delta, or on
    /v1/responses the first output item (a function call's item comes with its name, as a chat
    stream's first tool-call delta does)."""
    start, first = time.perf_counter(), None
    events = []
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            kind = event.get("type", "")
            delta = kind.endswith(".delta") or kind == "response.output_item.added" or any(
                c.get("delta", {}).get("content") or c.get("delta", {}).get("tool_calls")
                for c in event.get("choices", []))
            if first is None and delta:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start, events


def _turn_record(ttft: float, prompt: int, cached: int, output: int) -> dict[str, float]:
    return {"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": output, "cached_share": cached / prompt if prompt else 0.0}


async def by_id(client: httpx.AsyncClient, instructions: str, results: list[str],
                output_tokens: int) -> list[dict[str, float]]:
    """One conversation through POST /v1/responses, each turn continuing the last by id."""
    turns: list[dict[str, float]] = []
    body: dict[str, Any] = {"model": MODEL, "instructions": instructions, "tools": [TOOL],
                            "input": "Find the records the task needs, one lookup at a time.",
                            "tool_choice": "required", "parallel_tool_calls": False,
                            "temperature": 0, "max_output_tokens": output_tokens, "stream": True}
    for result in results:
        ttft, events = await _sse(client, "/v1/responses", body)
        response = events[-1]["response"]
        usage = response["usage"]
        turns.append(_turn_record(ttft, usage["input_tokens"],
                                  usage["input_tokens_details"]["cached_tokens"],
                                  usage["output_tokens"]))
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        call_id = calls[0]["call_id"] if calls else "call_none"
        body = {"model": MODEL, "previous_response_id": response["id"], "tools": [TOOL],
                "input": [{"type": "function_call_output", "call_id": call_id,
                           "output": result}],
                "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
                "max_output_tokens": output_tokens, "stream": True}
    return turns


def _call_message(events: list[dict[str, Any]], turn: int) -> dict[str, Any]:
    """The assistant message a streamed chat completion made (its call, reassembled)."""
    name, arguments = "lookup", ""
    for event in events:
        for choice in event.get("choices", []):
            for call in choice.get("delta", {}).get("tool_calls") or []:
                name = call.get("function", {}).get("name") or name
                arguments += call.get("function", {}).get("arguments") or ""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{turn}", "type": "function",
         "function": {"name": name, "arguments": arguments or "{}"}}]}


async def full_chat(client: httpx.AsyncClient, instructions: str, results: list[str],
                    output_tokens: int, salt: str | None = None,
                    last_salt: str | None = None) -> list[dict[str, float]]:
    """The same conversation re-sent whole to /v1/chat/completions every turn; `last_salt`
    sends the last turn in a namespace of its own, so that it finds nothing cached."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": instructions},
        {"role": "user", "content": "Find the records the task needs, one lookup at a time."}]
    turns = []
    for turn, result in enumerate(results):
        body = {"model": MODEL, "messages": messages, "tools": [CHAT_TOOL],
                "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
                "max_tokens": output_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        if salt is not None:
            body["cache_salt"] = salt
        if last_salt is not None and turn == len(results) - 1:
            body["cache_salt"] = last_salt
        ttft, events = await _sse(client, "/v1/chat/completions", body)
        usage = events[-1]["usage"]
        turns.append(_turn_record(ttft, usage["prompt_tokens"],
                                  usage["prompt_tokens_details"]["cached_tokens"],
                                  usage["completion_tokens"]))
        messages += [_call_message(events, turn),
                     {"role": "tool", "tool_call_id": f"call_{turn}", "content": result}]
    return turns


async def full_responses(client: httpx.AsyncClient, instructions: str, results: list[str],
                         output_tokens: int) -> list[dict[str, float]]:
    """The conversation re-sent whole to a stateless /v1/responses (llama-server's)."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "Find the records the task "
                                                                "needs, one lookup at a time."}]
    turns = []
    for turn, result in enumerate(results):
        body = {"model": MODEL, "instructions": instructions, "input": items, "tools": [TOOL],
                "tool_choice": "required", "temperature": 0,
                "max_output_tokens": output_tokens, "stream": True}
        ttft, events = await _sse(client, "/v1/responses", body)
        done = next((e["response"] for e in reversed(events) if "response" in e), {})
        usage = done.get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        turns.append(_turn_record(ttft, usage.get("input_tokens", 0),
                                  details.get("cached_tokens", 0), usage.get("output_tokens", 0)))
        call_id = f"call_{turn}"
        calls = [i for i in done.get("output", []) if i.get("type") == "function_call"]
        arguments = calls[0].get("arguments", "{}") if calls else "{}"
        items += [{"type": "function_call", "call_id": call_id, "name": "lookup",
                   "arguments": arguments},
                  {"type": "function_call_output", "call_id": call_id, "output": result}]
    return turns


def _summary(runs: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per turn, over the conversations: median and p90 TTFT, the mean cached share of the
    prompt, and of the history (the previous turn's prompt and output: all a cache can hold,
    as the new tool output is new)."""
    out = []
    for turn in range(len(runs[0])):
        rows = [run[turn] for run in runs]
        ttfts = sorted(r["ttft_s"] for r in rows)
        summary = {"turn": turn + 1, "ttft_p50_s": statistics.median(ttfts),
                   "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
                   "cached_share": statistics.mean(r["cached_share"] for r in rows),
                   "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rows)}
        if turn:
            summary["history_cached_share"] = statistics.mean(
                run[turn]["cached_tokens"]
                / max(1, run[turn - 1]["prompt_tokens"] + run[turn - 1]["output_tokens"])
                for run in runs)
        out.append(summary)
    return out


async def drive(url: str, kind: str, workloads: list[tuple[str, list[str]]],
                output_tokens: int) -> list[dict[str, float]]:
    # The chat run gets a namespace of its own: its first turns must not hit the by-id run's.
    run = {"by-id": by_id, "chat-full": functools.partial(full_chat, salt="chat-full"),
           "responses-full": full_responses}[kind]
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        runs = await asyncio.gather(*(run(client, instructions, results, output_tokens)
                                      for instructions, results in workloads))
    return _summary(list(runs))


async def cold_prefill(url: str, work: list[tuple[str, list[str]]],
                       output_tokens: int) -> list[dict[str, float]]:
    """The last turn of each conversation in `work` with nothing cached. The earlier turns run
    as the chat run does (each cached from the one before); the last goes to a fresh
    namespace. With one conversation this is a cold prefill alone; with all of them, the
    by-id run's load with nothing cached."""
    nonce = random.random()

    async def last(client: httpx.AsyncClient, i: int, instructions: str,
                   results: list[str]) -> dict[str, float]:
        turns = await full_chat(client, instructions, results, output_tokens,
                                salt=f"warm-{nonce}-{i}", last_salt=f"cold-{nonce}-{i}")
        return turns[-1]

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        return list(await asyncio.gather(*(last(client, i, *w) for i, w in enumerate(work))))


def workloads(args: argparse.Namespace, bank: WordBank) -> list[tuple[str, list[str]]]:
    rng = random.Random(args.seed)
    return [(bank.text(rng, args.instructions_tokens),
             [bank.text(rng, rng.randint(200, 500)) for _ in range(args.turns)])
            for _ in range(args.conversations)]


def store_bound(count: int, max_mb: float, tokens: int) -> dict[str, Any]:
    """Stores `count` responses of `tokens` tokens in a store bounded at `max_mb`: its size
    on disk and the process's peak memory before and after."""
    with tempfile.TemporaryDirectory() as directory:
        store = ResponseStore(directory, int(max_mb * 2**20), 3600.0, time.time)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rng = random.Random(0)
        seconds = 0.0
        for i in range(count):
            ids = [b % 50000 for b in array("H", rng.randbytes(2 * tokens))]
            response = StoredResponse(id=f"resp_{i}", tenant="", token_ids=ids,
                                      prompt_len=tokens - 20, history_len=0, namespace=None,
                                      input_items=[{"type": "message", "role": "user",
                                                    "content": "x" * 400}],
                                      body={"output": [{"type": "message", "content": []}]})
            start = time.perf_counter()
            store.put(response)
            seconds += time.perf_counter() - start
        on_disk = sum(p.stat().st_size for p in Path(directory).iterdir())
        result = {"responses": count, "tokens_each": tokens, "bound_mb": max_mb,
                  "kept": len(store), "evicted": store.evicted,
                  "accounted_mb": store.bytes / 2**20, "on_disk_mb": on_disk / 2**20,
                  "put_ms": seconds / count * 1e3, "peak_rss_mb_before": rss_before,
                  "peak_rss_mb_after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        store.close()
    return result


def llama_server(binary: str, model: Path, context: int, parallel: int, threads: int,
                 log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [binary, "-m", str(model), "-c", str(context * parallel), "-np", str(parallel),
               "-t", str(threads), "--jinja", "-a", MODEL, "--host", "127.0.0.1",
               "--port", str(port),
               # Its HTTP timeout (600 s by default) is shorter than a turn of 16 concurrent
               # conversations takes it on 2 cores: it would drop the connections.
               "--timeout", "3600"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).is_success:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"llama-server did not start: {log.read_text()[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF dir; default: the default")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--instructions-tokens", type=int, default=2000)
    parser.add_argument("--output-tokens", type=int, default=40)
    # Room for the by-id run's pinned sequences (16 x ~5,700 tokens, pinned for the responses'
    # TTL) beside the chat run's and the cold runs' (each as many again, evictable).
    parser.add_argument("--kv-cache-tokens", type=int, default=196608)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-server", default=None, metavar="BINARY",
                        help="also run llama-server's /v1/responses (stateless, full lists)")
    parser.add_argument("--store-responses", type=int, default=10000)
    parser.add_argument("--store-max-mb", type=float, default=64.0)
    parser.add_argument("--store-tokens", type=int, default=4000)
    parser.add_argument("--store-only", action="store_true",
                        help="only the store's bound check (no server)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                        help="an extra `radixserve serve` flag (repeat it), e.g. "
                             "--server-arg=--no-grammar-jump-forward")
    parser.add_argument("--no-chat", action="store_true",
                        help="skip the chat completions run (by id and the cold runs only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    if args.store_only:
        bound = store_bound(args.store_responses, args.store_max_mb, args.store_tokens)
        print("store", json.dumps(bound, indent=1))
        return
    model = Path(args.model) if args.model else default_model_path()
    bank = WordBank.from_tokenizer(load_tokenizer(model))
    work = workloads(args, bank)
    results: dict[str, Any] = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M")}
    logs = Path(tempfile.mkdtemp(prefix="bench-responses-"))
    server: ServerProcess = start_server(
        ["--model", str(model), "--served-model-name", MODEL, "--num-threads",
         str(args.threads), "--kv-cache-tokens", str(args.kv_cache_tokens), "--no-access-log",
         "--responses-dir", str(logs / "store"), "--max-pinned-fraction", "0.9",
         # Every first turn arrives at once by design (a backlog of ~16 x 2,000 tokens from
         # one caller): admission control would refuse some, and this measures the cache.
         "--max-queue-wait", "0", "--queue-key-share", "1", *args.server_arg],
        logs / "radixserve.log")
    try:
        for kind in ("by-id",) if args.no_chat else ("by-id", "chat-full"):
            results[kind] = asyncio.run(drive(server.base_url, kind, work, args.output_tokens))
            print(kind, json.dumps(results[kind], indent=1), flush=True)
        alone = asyncio.run(cold_prefill(server.base_url, work[:1], args.output_tokens))[0]
        loaded = asyncio.run(cold_prefill(server.base_url, work, args.output_tokens))
        loaded_p50 = statistics.median(t["ttft_s"] for t in loaded)
        results["cold_last_turn"] = {"alone": alone, "all_at_once_ttft_p50_s": loaded_p50,
                                     "all_at_once": loaded}
        last = results["by-id"][-1]["ttft_p50_s"]
        results["targets"] = {
            "cached_share_after_turn_1_min": min(t["cached_share"] for t in results["by-id"][1:]),
            "history_cached_share_min": min(t["history_cached_share"]
                                            for t in results["by-id"][1:]),
            "last_turn_ttft_over_cold_alone": last / alone["ttft_s"],
            "last_turn_ttft_over_cold_all_at_once": last / loaded_p50}
    finally:
        server.stop()
    if args.llama_server:
        context = args.instructions_tokens + args.turns * 600 + 512
        process, url = llama_server(args.llama_server, model, context, args.conversations,
                                    args.threads, logs / "llama-server.log")
        try:
            results["llama-server-full"] = asyncio.run(drive(url, "responses-full", work,
                                                             args.output_tokens))
        except httpx.HTTPError as exc:
            results["llama-server-full"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            process.terminate()
            process.wait(timeout=30)
        print("llama-server-full", json.dumps(results["llama-server-full"], indent=1))
    results["store_bound"] = store_bound(args.store_responses, args.store_max_mb,
                                         args.store_tokens)
    print("store", json.dumps(results["store_bound"], indent=1))
    print("targets", json.dumps(results.get("targets"), indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"logs in {logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
