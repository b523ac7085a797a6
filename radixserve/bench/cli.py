"""`radixserve bench` (drive a server with a workload, write JSON, print a summary) and
`radixserve bench report` (results -> markdown report with plots)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import sys
import time
from pathlib import Path

from radixserve.bench.loadgen import ENDPOINTS, BenchError, LoadConfig
from radixserve.bench.metrics import GOODPUT_METRICS
from radixserve.bench.workloads import WORKLOADS, WorkloadSpec

_SECRET_FLAGS = {"--api-key"}


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="root URL of any OpenAI-compatible server (a trailing /v1 is fine); "
                             "only this server is contacted (default: %(default)s)")
    target.add_argument("--endpoint", choices=list(ENDPOINTS), default="chat",
                        help="chat: /v1/chat/completions with messages; completions: "
                             "/v1/completions with the chat template rendered client-side "
                             "(default: %(default)s)")
    target.add_argument("--model", help="model name sent in each request "
                                        "(default: the first one /v1/models lists)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                        help="extra HTTP header (repeatable)")
    target.add_argument("--tokenizer", metavar="PATH",
                        help="the served model's .gguf or HF directory, for exact token counts "
                             "(default: radixserve's default model)")

    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=list(WORKLOADS), default="shared-prefix",
                      help="; ".join(f"{name}: {g.summary}" for name, g in WORKLOADS.items()))
    work.add_argument("--num-prompts", type=int, default=32,
                      help="requests (single-turn), conversations (multi-turn) or tasks "
                           "(agent) (default: %(default)s)")
    work.add_argument("--prefix-len", type=int,
                      help="tokens of the shared system prompt (default: per workload, "
                           + ", ".join(f"{n} {g.prefix_len}" for n, g in WORKLOADS.items()) + ")")
    work.add_argument("--suffix-len", type=int, default=32,
                      help="tokens of each question, suffix, user turn or tool result "
                           "(default: %(default)s)")
    work.add_argument("--num-prefixes", type=int, default=4,
                      help="distinct system prompts (default: %(default)s)")
    work.add_argument("--num-turns", type=int, default=3,
                      help="multi-turn: turns per conversation; agent: tree depth "
                           "(default: %(default)s)")
    work.add_argument("--branching", type=int, default=2,
                      help="agent: children per step (default: %(default)s)")
    work.add_argument("--num-tenants", type=int, default=2,
                      help="salted: tenants, each with its own cache_salt (default: %(default)s)")
    work.add_argument("--output-len", type=int, default=32,
                      help="max_tokens of every request (default: %(default)s)")
    work.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos=true so every request generates --output-len tokens "
                           "(servers that lack the field may reject it)")
    work.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature (default: %(default)s, greedy)")
    work.add_argument("--seed", type=int, default=0,
                      help="seed of the prompts and of the arrival times (default: %(default)s)")
    work.add_argument("--extra-body", metavar="JSON",
                      help="JSON object merged into every request body")

    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int,
                      help="most requests in flight at once (default: no cap)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="conversations started per second, with gamma-distributed gaps; "
                           "inf sends them all at once (default: %(default)s)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps: 1 is Poisson, < 1 burstier "
                           "(default: %(default)s)")
    load.add_argument("--num-warmups", type=int, default=1,
                      help="requests sent before the measured run, with prompts unrelated to "
                           "the workload (default: %(default)s)")
    load.add_argument("--ready-timeout", type=float, default=0.0,
                      help="seconds to keep retrying the first warm-up while the server starts "
                           "(default: %(default)s)")
    load.add_argument("--time-limit", type=float, default=600.0,
                      help="the run stops after this many seconds, cancelling what is in flight "
                           "(default: %(default)s)")
    load.add_argument("--request-timeout", type=float, default=300.0,
                      help="seconds a request may wait for its next bytes before it counts as "
                           "failed (default: %(default)s)")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")

    out = p.add_argument_group("results")
    out.add_argument("--system", help="name of what is measured, e.g. radixserve-radix "
                                      "(default: the base URL)")
    out.add_argument("--label", default="", help="free text shown in reports")
    out.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                     help="recorded with the result (repeatable); prefix_cache=radix|hash|off "
                          "and runtime=single-user are used by the report")
    out.add_argument("--ideal-page-size", type=int, default=1,
                     help="page size for the hit rate the workload implies (default: %(default)s)")
    out.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                     help=f"SLOs for goodput, metrics {', '.join(GOODPUT_METRICS)}, e.g. ttft:500")
    out.add_argument("--result-file", metavar="PATH",
                     help="where to write the JSON (default: "
                          "results/bench/SYSTEM_WORKLOAD_cN_TIME.json)")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark any OpenAI-compatible server; 'bench report' turns results into a report",
        description="Sends a workload to an OpenAI-compatible server under bounded load and "
                    "reports vLLM-style latency and throughput figures plus the prefix-cache "
                    "hit rate. Writes every request's record to JSON.",
    )
    _add_run_arguments(bench)
    bench.set_defaults(func=_run, bench_parser=bench)
    sub = bench.add_subparsers(dest="bench_command", metavar="{report}")
    report = sub.add_parser("report", help="markdown report with plots from result files",
                            description="Turns bench result files into a markdown report with "
                                        "PNG plots and the commands that reproduce each run.")
    report.add_argument("results", nargs="+", metavar="RESULT.json")
    report.add_argument("--out", required=True, metavar="DIR",
                        help="directory for the plots (and report.md unless --markdown)")
    report.add_argument("--markdown", metavar="PATH",
                        help="where to write the markdown, e.g. BENCHMARKS.md; plots are linked "
                             "relative to it (default: DIR/report.md)")
    report.add_argument("--title", default="radixserve benchmark report")
    report.set_defaults(func=_report, bench_parser=report)


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 words: list[str]) -> str:
    """The command that reproduces `args`, every option spelled out, secrets left out."""
    parts = ["radixserve", *words]
    # argparse keeps no public list of a parser's options.
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "bench_command"):
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")),
                    action.option_strings[0])
        value = getattr(args, action.dest, None)
        if value is None or value in ([], "") or value is False:
            continue
        if flag in _SECRET_FLAGS:
            parts += [flag, "REDACTED"]
        elif value is True:
            parts.append(flag)
        elif isinstance(value, list) and action.nargs == "+":
            parts += [flag, *map(str, value)]
        elif isinstance(value, list):
            for item in value:
                parts += [flag, str(item)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def _pairs(items: list[str], sep: str, what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, found, value = item.partition(sep)
        if not found or not key.strip():
            raise ValueError(f"{what} must look like KEY{sep}VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def _default_result_path(system: str, workload: str, concurrency: int | None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", system).strip("-") or "server"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("results") / "bench" / f"{safe}_{workload}_c{concurrency or 'max'}_{stamp}.json"


def _run(args: argparse.Namespace) -> int:
    from radixserve.bench.run import RunInfo, run_benchmark
    from radixserve.bench.table import summary_table
    from radixserve.bench.workloads import build_workload
    from radixserve.model.default_model import ModelFetchError, default_model_path
    from radixserve.model.loader import load_tokenizer

    try:
        headers = _pairs(args.header, ":", "--header")
        if args.api_key:
            headers["Authorization"] = f"Bearer {args.api_key}"
        metadata = _pairs(args.metadata, "=", "--metadata")
        slos = {k: float(v) for k, v in _pairs(args.goodput, ":", "--goodput").items()}
        if unknown := set(slos) - set(GOODPUT_METRICS):
            raise ValueError(f"--goodput metrics must be among {GOODPUT_METRICS}: {unknown}")
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
        spec = WorkloadSpec(
            name=args.workload, num_prompts=args.num_prompts, prefix_len=args.prefix_len,
            suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
            num_turns=args.num_turns, branching=args.branching, num_tenants=args.num_tenants,
            output_len=args.output_len, seed=args.seed,
        )
        config = LoadConfig(
            base_url=args.base_url, endpoint=args.endpoint, model=args.model,
            max_concurrency=args.max_concurrency, request_rate=args.request_rate,
            burstiness=args.burstiness, seed=args.seed, num_warmups=args.num_warmups,
            ready_timeout_s=args.ready_timeout, time_limit_s=args.time_limit,
            request_timeout_s=args.request_timeout, temperature=args.temperature,
            ignore_eos=args.ignore_eos, extra_body=extra_body, headers=headers,
            progress=not args.no_progress,
        )
        if args.ideal_page_size < 1:
            raise ValueError("--ideal-page-size must be >= 1")
        tokenizer_path = args.tokenizer or str(default_model_path())
        tokenizer = load_tokenizer(tokenizer_path)
    except (ValueError, FileNotFoundError, ModelFetchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workload = build_workload(spec, tokenizer)
    info = RunInfo(
        command=command_line(args.bench_parser, args, ["bench"]),
        system=args.system or "",
        label=args.label,
        tokenizer_path=tokenizer_path,
        metadata=metadata,
        ideal_page_size=args.ideal_page_size,
        goodput_slos_ms=slos,
    )
    try:
        result = asyncio.run(run_benchmark(workload, tokenizer, config, info))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    path = Path(args.result_file) if args.result_file else _default_result_path(
        result.system, spec.name, args.max_concurrency)
    result.save(path)
    print(summary_table(result))
    print(f"wrote {path}")
    # Partial failures are in the table and the JSON; only a run with no success fails.
    return 0 if result.summary.completed > 0 else 1


def _report(args: argparse.Namespace) -> int:
    from radixserve.bench.report import write_report
    from radixserve.bench.results import BenchResult

    try:
        results = [BenchResult.load_file(p) for p in args.results]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: cannot read results: {exc}", file=sys.stderr)
        return 2
    command = command_line(args.bench_parser, args, ["bench", "report", *args.results])
    path = write_report(results, Path(args.out), title=args.title, command=command,
                        markdown=Path(args.markdown) if args.markdown else None)
    print(f"wrote {path}")
    return 0
