"""Speculative decoding from the cache: output tokens/s with speculation off, ngram, suffix and
auto on four workloads, in-process on the default model, with the acceptance length and the
drafter's time per step; optionally llama-server (same GGUF, same prompts) with each of its
n-gram `--spec-type`s.

    .venv/bin/python benchmarks/bench_spec.py --quick                  # a 1-2 minute smoke run
    .venv/bin/python benchmarks/bench_spec.py --out results/spec.json --rounds 3 \
        --llama-cpp-bin /work/llama/LLAMA_CPP/build/bin

Every mode has its engine loaded and warmed up before the first timing; each round runs every
workload in every mode, one after another, so that the machine's drift (tens of percent within
minutes on shared CPUs) falls on all modes alike. Reported: each figure's median over the
rounds, and each mode's speed-up as the median of its per-round ratios to `off`.

Workloads: code-edit (a ~600-token source file of this repository returned whole with one
rename), rag-quote (answer by quoting a document), json-extract (the same document's title and
first two sentences as JSON under a schema: structured output, drafting under its grammar), agent (4 tool loops at once, 3 turns each,
every call repeating arguments seen earlier), unique-chat (nothing to copy; 1 and 16 at once),
short-c32 (32 short requests at once). The engines keep their prefix cache on (the default),
as llama-server keeps its prompt cache: the agent's later turns extend its earlier ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from peers import RunningServer, System
from timing import cpu_summary

from radixserve import LLM, SamplingParams
from radixserve.model.default_model import default_model_path
from radixserve.sampling_params import StructuredOutputsParams

REPO = Path(__file__).resolve().parent.parent
MODES = ("off", "ngram", "suffix", "auto")
LLAMA_SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
MODEL_NAME = "model"


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: list[list[dict[str, str]]]  # sent at once
    max_tokens: int
    # Later turns: each conversation gets its reply and then this message, and goes again.
    follow_ups: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None  # the reply's JSON schema (structured output)


# A 597-token file of this repository (in the default model's tokens), returned whole.
CODE_EDIT_FILE = "radixserve/engine/heartbeat.py"
CODE_EDIT_TOKENS = 640


def _code_edit() -> list[list[dict[str, str]]]:
    source = (REPO / CODE_EDIT_FILE).read_text()
    ask = ("Return this Python file unchanged except that the method `step_running_s` is "
           "renamed to `current_step_seconds`. Output only the file.\n\n" + source)
    return [[{"role": "user", "content": ask}]]


def _rag_quote() -> list[list[dict[str, str]]]:
    document = (REPO / "docs/architecture.md").read_text()[:2400]
    ask = (f"Document:\n{document}\n\nQuote, word for word, the document's first three "
           "sentences.")
    return [[{"role": "user", "content": ask}]]


# Structured extraction from a document: the values are quotes, so drafts from the prompt fit
# inside the grammar's strings (a constrained request drafts under its grammar).
EXTRACT_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "first_sentence": {"type": "string"},
    "second_sentence": {"type": "string"}},
    "required": ["title", "first_sentence", "second_sentence"], "additionalProperties": False}


def _json_extract() -> list[list[dict[str, str]]]:
    document = (REPO / "docs/architecture.md").read_text()[:2400]
    ask = (f"Document:\n{document}\n\nAnswer in JSON: the document's title, and its first two "
           "sentences quoted word for word.")
    return [[{"role": "user", "content": ask}]]


def _agent(users: int) -> list[list[dict[str, str]]]:
    conversations = []
    for user in range(users):
        path = f"src/module_{user}/handlers.py"
        call = json.dumps({"name": "read_file", "arguments": {"path": path, "start": 1,
                                                              "end": 120}})
        conversations.append([
            {"role": "system", "content": "You call tools by writing one JSON object."},
            {"role": "user", "content": f"Open {path} and then open it again from line 1."},
            {"role": "assistant", "content": call},
            {"role": "user", "content": "Tool result: file opened. Now repeat the same call "
                                        "exactly, as JSON."},
        ])
    return conversations


# The agent's next turns: each tool result asks for the call again (a loop re-reading a file).
AGENT_FOLLOW_UPS = ("Tool result: 120 lines read. Repeat the same call exactly, as JSON.",
                    "Tool result: the file changed. Repeat the same call exactly, as JSON.")


def _unique(users: int) -> list[list[dict[str, str]]]:
    topics = ["rivers", "volcanoes", "bread", "chess", "owls", "glass", "tides", "maps",
              "bees", "clocks", "salt", "kites", "moss", "comets", "violins", "deserts"]
    return [[{"role": "user", "content": f"Write three new sentences about {topics[i % 16]}."}]
            for i in range(users)]


def workloads(quick: bool) -> list[Workload]:
    out = 48 if quick else 256
    runs = [Workload("code-edit", _code_edit(), 48 if quick else CODE_EDIT_TOKENS),
            Workload("rag-quote", _rag_quote(), out),
            Workload("json-extract", _json_extract(), out, schema=EXTRACT_SCHEMA),
            Workload("agent-c4", _agent(4), min(out, 64), AGENT_FOLLOW_UPS),
            Workload("unique-chat-c1", _unique(1), out)]
    if not quick:
        runs += [Workload("unique-chat-c16", _unique(16), 64),
                 Workload("short-c32", _unique(32), 16)]
    return runs


def load(mode: str, args: argparse.Namespace) -> LLM:
    llm = LLM(args.model, speculative=mode, num_speculative_tokens=args.k,
              num_threads=args.threads, show_progress=False, kv_cache_tokens=8192)
    # First calls load kernels and build per-shape state: not part of any figure.
    llm.chat(_code_edit(), SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    return llm


def run_radixserve(mode: str, llm: LLM, workload: Workload, namespace: str) -> dict:
    counters = llm.engine.speculation.counters
    before = (counters.steps, counters.drafts, counters.accepted_tokens,
              counters.draft_seconds, counters.speculative_steps)
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0,
                            structured_outputs=None if workload.schema is None
                            else StructuredOutputsParams(json=workload.schema))
    conversations = workload.conversations
    tokens, decode_tokens, decode_seconds = 0, 0, 0.0
    results: list[Any] = []
    started = time.perf_counter()
    for follow_up in (None, *workload.follow_ups):
        if follow_up is not None:
            conversations = [c + [{"role": "assistant", "content": r.outputs[0].text},
                                  {"role": "user", "content": follow_up}]
                             for c, r in zip(conversations, results, strict=True)]
        # A namespace per workload and round: `suffix` and `auto` must not copy what an
        # earlier round, or another workload asking the same, said.
        results = llm.chat(conversations, params, use_tqdm=False, cache_salt=namespace)
        tokens += sum(len(r.outputs[0].token_ids) for r in results)
        # Decode alone (first token to last), the part speculation changes.
        decode_tokens += sum(len(r.outputs[0].token_ids) - 1 for r in results)
        decode_seconds += (max(r.metrics.finished_time for r in results)
                           - min(r.metrics.first_token_time for r in results))
    seconds = time.perf_counter() - started
    steps = counters.steps - before[0]
    drafts = counters.drafts - before[1]
    accepted = counters.accepted_tokens - before[2]
    row = {
        "system": "radixserve", "mode": mode, "workload": workload.name,
        "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "decode_tokens_per_s": decode_tokens / max(decode_seconds, 1e-9),
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "speculative_step_share": (counters.speculative_steps - before[4]) / max(steps, 1),
        "drafter_ms_per_step": (counters.draft_seconds - before[3]) / max(steps, 1) * 1e3,
        "step_ms": seconds / max(steps, 1) * 1e3,
        "step_overhead_ms": llm.engine.speculation.overhead * 1e3,
    }
    print(json.dumps(row), flush=True)
    return row


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (system, mode, workload): each number the median over the rounds, and the
    speed-up over `off` the median of the rounds' own ratios."""
    off = {(r["round"], r["workload"]): r["tokens_per_s"] for r in rows if r["mode"] == "off"
           and r["system"] == "radixserve"}
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if (r.get("round"), r["workload"]) in off:
            r["speedup_vs_off"] = r["tokens_per_s"] / off[(r["round"], r["workload"])]
        groups.setdefault((r["system"], r["mode"], r["workload"]), []).append(r)
    out = []
    for (system, mode, workload), group in groups.items():
        row: dict[str, Any] = {"system": system, "mode": mode, "workload": workload,
                               "rounds": len(group)}
        for key in group[0]:
            values = [g[key] for g in group if isinstance(g.get(key), (int, float))]
            if key not in row and key != "round" and len(values) == len(group):
                row[key] = statistics.median(values)
        out.append(row)
    return out


def run_llama_server(spec_type: str, runs: list[Workload], args: argparse.Namespace,
                     log: Path) -> list[dict]:
    command = [str(args.llama_cpp_bin / "llama-server"), "-m", args.model, "-t",
               str(args.threads), "-np", "16", "-c", "65536", "-a", MODEL_NAME,
               "--host", "127.0.0.1", "--port", "{port}"]
    if spec_type != "none":
        # Each n-gram type at llama.cpp's own defaults (drafts of up to 48-64 tokens): what its
        # users get, and its authors' tuning.
        command += ["--spec-type", spec_type]
    rows = []
    with RunningServer(System(f"llama-server {spec_type}", command), log, 300) as server:
        for workload in runs:
            started = time.perf_counter()
            tokens = 0
            with httpx.Client(base_url=server.url, timeout=1800, trust_env=False) as client:
                # One at a time even where the workload sends several at once: its slots
                # would share the machine's 2 cores either way (a lower bound for it).
                for messages in workload.conversations:
                    reply = ""
                    for follow_up in (None, *workload.follow_ups):
                        if follow_up is not None:
                            messages = messages + [
                                {"role": "assistant", "content": reply},
                                {"role": "user", "content": follow_up}]
                        # Its prompt cache on (its default), as radixserve's prefix cache is.
                        request: dict[str, Any] = {
                            "model": MODEL_NAME, "messages": messages, "temperature": 0,
                            "max_tokens": workload.max_tokens}
                        if workload.schema is not None:
                            request["response_format"] = {"type": "json_schema", "json_schema": {
                                "name": "answer", "schema": workload.schema}}
                        body = client.post("/v1/chat/completions", json=request).json()
                        tokens += body["usage"]["completion_tokens"]
                        reply = body["choices"][0]["message"]["content"]
            seconds = time.perf_counter() - started
            rows.append({"system": "llama-server", "mode": spec_type,
                         "workload": workload.name, "output_tokens": tokens,
                         "seconds": seconds, "tokens_per_s": tokens / seconds})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF or HF directory; unset: default")
    parser.add_argument("--modes", default=",".join(MODES), help="radixserve modes to run")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every workload in every mode (medians reported)")
    parser.add_argument("--quick", action="store_true", help="short outputs, fewer workloads")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated workload names to run (default: all)")
    parser.add_argument("--llama-cpp-bin", type=Path, default=None,
                        help="a llama.cpp build's bin directory: also run llama-server")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    args.model = str(args.model or default_model_path())
    runs = [w for w in workloads(args.quick)
            if args.workloads is None or w.name in args.workloads.split(",")]
    results: dict[str, Any] = {"cpu": cpu_summary(), "model": args.model, "k": args.k,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "rows": []}
    modes = args.modes.split(",")
    engines = {mode: load(mode, args) for mode in modes}
    for round_ in range(args.rounds):
        for workload in runs:
            for mode in modes:
                results["rows"].append({**run_radixserve(
                    mode, engines[mode], workload, f"{workload.name}-{round_}"), "round": round_})
    del engines
    if args.llama_cpp_bin is not None:
        log = (args.out or Path("bench_spec.json")).with_suffix(".llama-server.log")
        for spec_type in LLAMA_SPEC_TYPES:
            results["rows"] += run_llama_server(spec_type, runs, args, log)
    results["medians"] = median_rows(results["rows"])
    print(f"{'system':12} {'mode':13} {'workload':16} {'tok/s':>7} {'x off':>6} "
          f"{'decode tok/s':>12} {'accept len':>10} {'draft ms/step':>13}")
    for r in results["medians"]:
        accept = r.get("acceptance_length")
        draft_ms = r.get("drafter_ms_per_step")
        print(f"{r['system']:12} {r['mode']:13} {r['workload']:16} {r['tokens_per_s']:7.1f} "
              f"{r.get('speedup_vs_off', 0):6.2f} {r.get('decode_tokens_per_s', 0):12.1f} "
              f"{'' if accept is None else f'{accept:.2f}':>10} "
              f"{'' if draft_ms is None else f'{draft_ms:.3f}':>13}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
