"""radixserve beside llama.cpp on the same GGUF files, one system at a time, in one run (issue 13).

Every round runs, in turn: llama-bench (prefill of --prompt-tokens, batch-1 decode), radixserve
in a child process through `radixserve.LLM` (load time, resident memory after load, the same two
figures), then llama-server (-np --users, its default prompt cache) and `radixserve serve`,
each fresh and driven through the OpenAI chat API: --users streams sharing one system prompt of
--prompt-tokens with a question each, and --short-requests concurrent short requests, every one
producing --output-tokens (EOS ignored). Speeds here drift within minutes, so the ratios are taken within
a round (neighbouring runs) and their median reported. Prints a markdown table, writes JSON.

    .venv/bin/python benchmarks/bench_vs_llama_cpp.py --llama-cpp-bin LLAMA_CPP/build/bin \
        --model llama-1b-Q4_K_M.gguf --model llama-1b-Q8_0.gguf --rounds 2 --out results/vs_llama_cpp.json

llama.cpp, built outside the repo from the sources vendored in the llama-cpp-python sdist
(about 25 minutes on 2 cores; the OFF flags keep the build off the network):

    .venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d DL
    tar xzf DL/llama_cpp_python-0.3.36.tar.gz -C DL
    cp -r DL/llama_cpp_python-0.3.36/vendor/llama.cpp LLAMA_CPP && cd LLAMA_CPP
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build -j2 --target llama-bench llama-server llama-quantize

The 1B model: `benchmarks/make_llama_gguf.py --out llama-1b-f16.gguf`, then
`llama-quantize llama-1b-f16.gguf llama-1b-Q4_K_M.gguf Q4_K_M 2` (and Q8_0 the same way).
Run it on a quiet machine only: llama.cpp's timings collapse under any other load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from bench_http import run_level
from peers import RunningServer, System

from radixserve.bench.textgen import WordBank
from radixserve.kernels.cpu import cpu_flags
from radixserve.model.default_model import default_model_path
from radixserve.model.gguf_file import GGUFFile
from radixserve.model.loader import load_tokenizer

LLAMA_CPP, RADIXSERVE = "llama.cpp", "radixserve"
WORKLOADS = ("shared_prefix", "short")  # the server workloads, in the order they run
CHILD_RESULT = "RESULT "  # prefix of the child's one JSON line on stdout
MODEL_NAME = "bench"  # the name both servers answer to
TEMPLATE_TOKENS = 64  # chat template tokens around a system prompt and a question, at most


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    lower_is_better: bool
    target: str  # issue 13's target on the 1B model, radixserve against llama.cpp


def figures(args: argparse.Namespace) -> tuple[Figure, ...]:
    return (
        Figure("prefill_s", f"prefill of {args.prompt_tokens} tokens (s)", True,
               "<= 0.8x AVX2-only, 0.5x AVX-512/BF16"),
        Figure("decode_ms_per_token", "decode, batch 1 (ms/token)", True, "<= 1x"),
        Figure("decode_gb_per_s", "  weights streamed by that decode (GB/s)", False, ""),
        Figure("weights_read_gb_per_token",
               "  weights a decoded token reads (GB; llama.cpp: the file's active share)", True,
               ""),
        Figure("load_s", "LLM() load (s)", True, ""),
        Figure("rss_after_load_gb", "LLM() RSS after load (GB)", True, "<= 1.15x file"),
        Figure("rss_over_file", "  that RSS over the file's size", True, "<= 1.15"),
        Figure("peak_rss_gb", "LLM() peak RSS during load, mapped file pages included (GB)",
               True, ""),
        Figure("peak_anon_gb", "LLM() peak anonymous memory during load (GB)", True, ""),
        Figure("server_ready_s", "server start to healthy (s)", True, "<= llama.cpp + 5 s"),
        Figure("server_rss_gb", "server RSS when healthy, KV pool included (GB)", True, ""),
        Figure("shared_prefix_tok_s",
               f"{args.users} users, shared {args.prompt_tokens}-token prompt (out tok/s)",
               False, ">= 5x"),
        Figure("short_tok_s", f"{args.short_requests} concurrent short requests (out tok/s)",
               False, ">= 2x"),
    )


def cpu_summary() -> dict[str, Any]:
    flags = cpu_flags()
    vector = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    kind = ("AVX-512/BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
            else "AVX2-only" if "avx2" in flags else "no AVX2")
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                 .splitlines() if line.startswith("model name")), "unknown")
    return {"kind": kind, "flags": vector, "model_name": name, "cores": psutil.cpu_count()}


def describe_model(path: Path) -> dict[str, Any]:
    """File size, tensor types, and the bytes one decode step reads: every matrix except the
    embedding table, which is read one row per token unless it is also the LM head; of a
    mixture-of-experts model's expert tensors (`*_exps`), the share of the experts a token
    uses (`{arch}.expert_used_count` of `{arch}.expert_count`): its active parameters."""
    gguf_file = GGUFFile.open(path)
    tensors, meta = gguf_file.tensors, gguf_file.metadata
    arch = meta.get("general.architecture")
    experts, used = meta.get(f"{arch}.expert_count", 0), meta.get(f"{arch}.expert_used_count", 0)
    tied = "output.weight" not in tensors

    def read_per_token(name: str, n_bytes: int) -> int:
        if name == "token_embd.weight" and not tied:
            return 0
        return n_bytes * used // experts if experts and "_exps." in name else n_bytes

    per_token = sum(read_per_token(name, t.n_bytes) for name, t in tensors.items())
    return {"path": str(path), "file_bytes": path.stat().st_size,
            "tensor_types": dict(Counter(t.type_name for t in tensors.values())),
            "weight_bytes_per_token": per_token,
            "experts": {"count": experts, "used": used} if experts else None}


# ----- offline figures: llama-bench, and radixserve.LLM in a child process


def llama_bench(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    command = [str(args.llama_cpp_bin / "llama-bench"), "-m", str(model), "-t", str(args.threads),
               "-p", str(args.prompt_tokens), "-n", str(args.decode_tokens), "-r", "1",
               "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    tests = json.loads(done.stdout)
    prefill = next(t for t in tests if t["n_prompt"] > 0)
    decode = next(t for t in tests if t["n_gen"] > 0)
    return {"prefill_s": prefill["avg_ns"] / 1e9,
            "decode_ms_per_token": decode["avg_ns"] / 1e6 / decode["n_gen"],
            "build": {k: tests[0].get(k) for k in ("build_commit", "build_number", "cpu_info",
                                                   "backends", "type_k", "n_batch", "n_ubatch")}}


def radixserve_offline(args: argparse.Namespace, model: Path, log: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--radixserve-child", "--model", str(model),
               "--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens),
               "--decode-tokens", str(args.decode_tokens)]
    with open(log, "a") as err:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=err, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith(CHILD_RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the radixserve child exited with {done.returncode}; see {log}")
    return json.loads(lines[-1][len(CHILD_RESULT):])


class PeakAnonymous:
    """The process's largest anonymous resident memory (RSS less its file-backed and shared
    pages) while the block runs, sampled every 10 ms. Peak RSS also counts the pages of the
    mapped GGUF file being read, which the page cache can drop; this is what a load needs."""

    def __enter__(self) -> PeakAnonymous:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._sample_once()
        self._thread.start()
        return self

    def _sample_once(self) -> None:
        info = psutil.Process().memory_info()
        self.peak = max(self.peak, info.rss - info.shared)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._sample_once()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample_once()


def child_measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs in the child: a fresh process, so RSS and peak RSS are this model's alone."""
    from radixserve import LLM, SamplingParams

    rng = random.Random(0)

    def tokens(n: int) -> list[int]:  # random ordinary ids: no prompt shares a prefix
        return [rng.randrange(1000, 40000) for _ in range(n)]

    before = psutil.Process().memory_info().rss / 1e9
    start = time.perf_counter()
    # A KV pool just large enough for the prefill, so that RSS is mostly the weights.
    with PeakAnonymous() as anonymous:
        llm = LLM(str(args.model[0]), quantization="auto", num_threads=args.threads,
                  kv_cache_tokens=args.prompt_tokens + args.decode_tokens + 256,
                  show_progress=False)
    result: dict[str, Any] = {"load_s": time.perf_counter() - start,
                              "rss_before_load_gb": before,
                              "rss_after_load_gb": psutil.Process().memory_info().rss / 1e9,
                              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                              * 1024 / 1e9,
                              "peak_anon_gb": anonymous.peak / 1e9}
    result["weights_read_gb_per_token"] = decode_weight_bytes(llm.engine.model) / 1e9
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": tokens(64)}], greedy, use_tqdm=False)  # warm-up

    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": tokens(16)}], decode, use_tqdm=False)[0]
    metrics, produced = out.metrics, len(out.outputs[0].token_ids)
    assert metrics and metrics.first_token_time and metrics.finished_time and produced > 1
    result["decode_ms_per_token"] = (
        1e3 * (metrics.finished_time - metrics.first_token_time) / (produced - 1))

    start = time.perf_counter()
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": tokens(args.prompt_tokens)}], first,
                       use_tqdm=False)[0]
    result["prefill_s"] = time.perf_counter() - start
    result["prefill_cached_tokens"] = out.num_cached_tokens
    return result


def decode_weight_bytes(model: Any) -> int:
    """Bytes of weights radixserve's model reads per decoded token: every projection as it is
    held (GGUF panels, float panels or a float weight), of a mixture-of-experts layer only the
    chosen experts' (`Experts.active_bytes`), not the embedding table (one row a token)."""
    from radixserve.layers.linear import Linear
    from radixserve.model.moe import MoEBlock

    total = 0
    for module in model.modules():
        if isinstance(module, MoEBlock):
            total += module.experts.active_bytes(module.routing.top_k)
        elif isinstance(module, Linear):
            held = module.packed.nbytes if module.packed is not None else sum(
                t.numel() * t.element_size() for t in (module.panels, module.weight)
                if t is not None)
            total += held
    return total


# ----- servers through the OpenAI chat API


def llama_server(args: argparse.Namespace, model: Path, context: int) -> System:
    command = [str(args.llama_cpp_bin / "llama-server"), "-m", str(model),
               "-t", str(args.threads), "-np", str(args.users), "-c", str(context),
               "-a", MODEL_NAME, "--host", "127.0.0.1", "--port", "{port}"]
    return System(LLAMA_CPP, command)


def radixserve_server(args: argparse.Namespace, model: Path, context: int) -> System:
    command = [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(model),
               "--quantization", "auto", "--num-threads", str(args.threads),
               "--kv-cache-tokens", str(context), "--served-model-name", MODEL_NAME,
               "--no-access-log", "--host", "127.0.0.1", "--port", "{port}",
               # Every workload's requests arrive at once by design, and llama-server queues
               # them all: admission control would refuse some (a 429 ends the run).
               "--max-queue-wait", "0", "--max-queued-tokens", str(1 << 30),
               "--queue-key-share", "1"]
    return System(RADIXSERVE, command)


def startup_round(system: System, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """Server start to healthy, and nothing else (--startup-only)."""
    start = time.perf_counter()
    with RunningServer(system, log, args.startup_timeout) as server:
        assert server.process is not None
        return {"server_ready_s": time.perf_counter() - start,
                "server_rss_gb": psutil.Process(server.process.pid).memory_info().rss / 1e9}


def serve_round(system: System, args: argparse.Namespace, bank: WordBank, round_index: int,
                log: Path) -> dict[str, Any]:
    start = time.perf_counter()
    with RunningServer(system, log, args.startup_timeout) as server:
        assert server.process is not None
        result: dict[str, Any] = {
            "server_ready_s": time.perf_counter() - start,
            "server_rss_gb": psutil.Process(server.process.pid).memory_info().rss / 1e9}
        rng = random.Random(f"{args.seed}-{round_index}")
        asyncio.run(run_level(server.url, MODEL_NAME, bank.text(rng, 16),
                              bank.distinct_texts(rng, 1, 16), 1, 4))  # warm-up
        workloads = {
            "shared_prefix": (bank.text(rng, args.prompt_tokens), args.users),
            "short": (bank.text(rng, 8), args.short_requests),
        }
        for name, (system_prompt, count) in workloads.items():
            if name not in args.workloads:
                continue
            questions = bank.distinct_texts(rng, count, args.question_tokens)
            samples, wall = asyncio.run(run_level(server.url, MODEL_NAME, system_prompt,
                                                  questions, count, args.output_tokens))
            produced = [s.completion_tokens for s in samples]
            result[f"{name}_tok_s"] = sum(produced) / wall
            result[f"{name}_wall_s"] = wall
            result[f"{name}_min_output_tokens"] = min(produced)
            result[f"{name}_ttft_max_s"] = max(s.ttft for s in samples)
    return result


# ----- rounds, summary, table


def run_model(args: argparse.Namespace, model: Path, bank: WordBank,
              log_dir: Path) -> dict[str, Any]:
    info = describe_model(model)
    # The same KV room for both. llama-server splits its context evenly among its USERS slots,
    # each padded to a multiple of 256 tokens.
    answer = args.question_tokens + args.output_tokens + TEMPLATE_TOKENS
    per_slot = -(-(args.prompt_tokens + answer) // 256) * 256
    context = max(args.users * per_slot, args.short_requests * answer)
    rounds = []
    for index in range(args.rounds):
        row: dict[str, dict[str, Any]] = {LLAMA_CPP: {}, RADIXSERVE: {}}
        step = f"{model.name} round {index + 1}/{args.rounds}"
        if args.startup_only:
            for system in (llama_server(args, model, context),
                           radixserve_server(args, model, context)):
                print(f"{step}: {system.name} server start", flush=True)
                row[system.name] |= startup_round(system, args,
                                                  log_dir / f"{system.name}-server.log")
            rounds.append(row)
            continue
        print(f"{step}: llama-bench", flush=True)
        row[LLAMA_CPP] |= llama_bench(args, model)
        print(f"{step}: radixserve LLM", flush=True)
        row[RADIXSERVE] |= radixserve_offline(args, model, log_dir / "radixserve-offline.log")
        for values in row.values():
            values["decode_gb_per_s"] = (info["weight_bytes_per_token"]
                                         / values["decode_ms_per_token"] / 1e6)
        row[LLAMA_CPP]["weights_read_gb_per_token"] = info["weight_bytes_per_token"] / 1e9
        row[RADIXSERVE]["rss_over_file"] = (row[RADIXSERVE]["rss_after_load_gb"] * 1e9
                                            / info["file_bytes"])
        if not args.skip_server:
            for system in (llama_server(args, model, context),
                           radixserve_server(args, model, context)):
                print(f"{step}: {system.name} server", flush=True)
                row[system.name] |= serve_round(system, args, bank, index,
                                                log_dir / f"{system.name}-server.log")
        rounds.append(row)
    return {**info, "rounds": rounds, "summary": summarise(rounds, figures(args))}


def summarise(rounds: list[dict[str, dict[str, Any]]],
              wanted: tuple[Figure, ...]) -> dict[str, dict[str, Any]]:
    """Per figure: each system's best round, and the median of the per-round ratios
    radixserve / llama.cpp (neighbouring runs, so drift between rounds cancels)."""
    summary = {}
    for figure in wanted:
        best = min if figure.lower_is_better else max
        entry: dict[str, Any] = {}
        for system in (LLAMA_CPP, RADIXSERVE):
            values = [r[system][figure.key] for r in rounds if figure.key in r[system]]
            entry[system] = best(values) if values else None
        ratios = [r[RADIXSERVE][figure.key] / r[LLAMA_CPP][figure.key] for r in rounds
                  if figure.key in r[RADIXSERVE] and r[LLAMA_CPP].get(figure.key)]
        entry["ratios"] = ratios
        entry["median_ratio"] = statistics.median(ratios) if ratios else None
        summary[figure.key] = entry
    return summary


def table(result: dict[str, Any], wanted: tuple[Figure, ...]) -> str:
    def cell(value: float | None) -> str:
        return "–" if value is None else f"{value:.3g}" if value < 100 else f"{value:.0f}"

    lines = [f"### {Path(result['path']).name}: {result['file_bytes'] / 1e9:.2f} GB, "
             f"{', '.join(f'{k} x{v}' for k, v in result['tensor_types'].items())}", "",
             "| figure | llama.cpp | radixserve | radixserve / llama.cpp (rounds) | target |",
             "|---|---|---|---|---|"]
    for figure in wanted:
        entry = result["summary"][figure.key]
        if entry[LLAMA_CPP] is None and entry[RADIXSERVE] is None:
            continue
        ratio = "–"
        if entry["median_ratio"] is not None:
            ratio = (f"{entry['median_ratio']:.2f} ("
                     + ", ".join(f"{r:.2f}" for r in entry["ratios"]) + ")")
        lines.append(f"| {figure.label} | {cell(entry[LLAMA_CPP])} | "
                     f"{cell(entry[RADIXSERVE])} | {ratio} | {figure.target} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", action="append", type=Path, default=[],
                   help="a .gguf file (repeatable); default: radixserve's default model")
    p.add_argument("--llama-cpp-bin", type=Path, default=None,
                   help="folder holding llama-bench and llama-server; default: found on PATH")
    p.add_argument("--rounds", type=int, default=2, help="rounds per model, systems alternating")
    p.add_argument("--threads", type=int, default=2, help="threads for both systems")
    p.add_argument("--prompt-tokens", type=int, default=2000,
                   help="prefill length, and the shared system prompt's")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens of the batch-1 decode")
    p.add_argument("--users", type=int, default=16,
                   help="concurrent users sharing the system prompt (llama-server's -np)")
    p.add_argument("--short-requests", type=int, default=32, help="concurrent short requests")
    p.add_argument("--question-tokens", type=int, default=32, help="each user's own question")
    p.add_argument("--output-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--skip-server", action="store_true", help="only llama-bench and LLM()")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                   help="the server workloads to run (llama-server's shared_prefix takes most "
                        "of a round: each of its slots prefills the prompt)")
    p.add_argument("--startup-only", action="store_true",
                   help="only each server's start to healthy (same context as a full run)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for a server to become healthy")
    p.add_argument("--seed", type=int, default=0, help="seed of the server prompts")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    p.add_argument("--radixserve-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.radixserve_child:
        print(CHILD_RESULT + json.dumps(child_measure(args)), flush=True)
        return 0
    if args.llama_cpp_bin is None:
        found = shutil.which("llama-bench")
        if found is None:
            print("error: llama-bench is not on PATH; pass --llama-cpp-bin", file=sys.stderr)
            return 2
        args.llama_cpp_bin = Path(found).parent
    models = args.model or [default_model_path()]
    cpu = cpu_summary()
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores, {cpu['kind']} "
          f"({' '.join(cpu['flags'])})", flush=True)
    wanted = figures(args)
    log_dir = (args.out.parent / f"{args.out.stem}-logs" if args.out
               else Path(tempfile.mkdtemp(prefix="vs_llama_cpp-")))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server and child logs in {log_dir}", flush=True)
    results = []
    for model in models:
        bank = WordBank.from_tokenizer(load_tokenizer(model))
        results.append(run_model(args, model, bank, log_dir))
    print()
    print(f"CPU: {cpu['kind']}, {args.threads} threads; best round of {args.rounds} per "
          "system, ratio = median over rounds of radixserve / llama.cpp")
    for result in results:
        print()
        print(table(result, wanted))
    if args.out:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                  if k not in ("out", "radixserve_child", "model")}
        args.out.write_text(json.dumps({"cpu": cpu, "config": config,
                                        "models": results}, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
