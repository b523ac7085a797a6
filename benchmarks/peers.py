"""radixserve (radix, hash, off) beside its peers, same workloads, same machine, one run.

Sets up each peer in its own virtual environment under results/peers/ (git-ignored), starts every
server fresh on a loopback port for every run (so no run inherits another's cache), drives it
with `radixserve bench`, and writes the results and the report. Any other OpenAI-compatible
server can join with --peer NAME=URL (it is not restarted between runs).

    python benchmarks/peers.py --preset quick            # a few minutes on a laptop CPU
    python benchmarks/peers.py --systems radix,off --only shared-prefix,unique
    python benchmarks/peers.py --peer vllm=http://127.0.0.1:8001 --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PEERS_HOME = REPO / "results" / "peers"
LLAMA_CPP_VERSION = "0.3.36"
RADIXSERVE_MODES = ("radix", "hash", "off")
# radixserve in radix mode reporting usage by a vendor's documented caching rules
# (--cache-accounting vendor): the "concurrent identical requests all miss" column.
VENDOR = "vendor"
LLAMA_CPP = "llama-cpp-python"


@dataclass(frozen=True)
class BenchRun:
    """One `radixserve bench` invocation, the same for every system."""

    workload: str
    concurrency: int
    args: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.workload}__c{self.concurrency}"


def _preset(size: dict[str, int], small_conversations: dict[str, int]) -> list[BenchRun]:
    def flags(values: dict[str, int]) -> tuple[str, ...]:
        return tuple(x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v)))

    common = flags(size)
    conversations = flags({**size, **small_conversations})
    runs = []
    for workload in ("shared-prefix", "unique", "prefix-repetition"):
        runs += [BenchRun(workload, c, common) for c in (1, 5)]
    runs += [BenchRun("multi-turn", c, conversations) for c in (1, 5)]
    runs += [BenchRun("agent", c, flags({**size, "num_prompts": 2, "num_turns": 3}))
             for c in (1, 5)]
    for workload in ("tools-sorted", "trap-timestamp", "trap-unsorted-tools", "salted"):
        runs.append(BenchRun(workload, 1, common))
    # Below a 16-token block once the template's few tokens are added.
    runs.append(BenchRun("trap-short-prefix", 1, flags({**size, "prefix_len": 8})))
    # N identical first requests at once: concurrency = N.
    identical = 8
    runs.append(BenchRun("identical", identical, flags({**size, "num_prompts": identical})))
    return runs


PRESETS = {
    "quick": _preset({"num_prompts": 8, "prefix_len": 128, "suffix_len": 16, "output_len": 8},
                     {"num_prompts": 3, "num_turns": 3}),
    "full": _preset({"num_prompts": 32, "prefix_len": 512, "suffix_len": 32, "output_len": 32},
                    {"num_prompts": 8, "num_turns": 4}),
}


@dataclass
class System:
    """Something to benchmark: a server we start (command) or one already running (url)."""

    name: str
    command: list[str] = field(default_factory=list)  # with {port} to fill in
    url: str = ""
    health_path: str = "/health"
    metadata: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def radixserve_system(mode: str, model: str, args: argparse.Namespace) -> System:
    command = [sys.executable, "-m", "radixserve.cli", "serve", "--model", model,
               "--host", "127.0.0.1", "--port", "{port}", "--prefix-cache", mode]
    if args.kv_cache_tokens:
        command += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    page_size = args.hash_page_size if mode == "hash" else args.page_size
    if page_size:
        command += ["--page-size", str(page_size)]
    for extra in args.serve_arg:
        command += shlex.split(extra)
    return System(f"radixserve-{mode}", command,
                  metadata={"prefix_cache": mode, "engine": "radixserve"})


def vendor_system(model: str, args: argparse.Namespace) -> System:
    base = radixserve_system("radix", model, args)
    # A low minimum so the quick preset's short prompts are cacheable under the vendor's rules.
    command = [*base.command, "--cache-accounting", "vendor", "--min-cacheable-tokens", "64"]
    return System(f"radixserve-{VENDOR}", command,
                  metadata={"prefix_cache": "radix", "accounting": "vendor",
                            "engine": "radixserve"})


def llama_cpp_system(venv: Path, model: str) -> System:
    command = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", model,
               "--host", "127.0.0.1", "--port", "{port}", "--n_ctx", "8192",
               "--n_threads", str(os.cpu_count() or 1), "--interrupt_requests", "False"]
    # A single-user runtime: one sequence at a time, the role Ollama plays on a laptop. Its
    # default drops the request in flight when another arrives; queueing them, as Ollama
    # does, is the fair baseline for latency under concurrent users.
    return System(LLAMA_CPP, command, health_path="/v1/models",
                  metadata={"runtime": "single-user", "engine": "llama.cpp"})


def setup_llama_cpp(version: str, log: Path) -> Path:
    """Its own virtual environment, so its dependencies never meet radixserve's."""
    venv = PEERS_HOME / "venvs" / f"{LLAMA_CPP}-{version}"
    stamp = venv / ".installed"
    if stamp.exists():
        return venv
    print(f"setting up {LLAMA_CPP}=={version} in {venv} (compiles llama.cpp: minutes)",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    with open(log, "ab") as out:
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        f"{LLAMA_CPP}[server]=={version}"], check=True, stdout=out,
                       stderr=subprocess.STDOUT)
    stamp.write_text(version + "\n")
    return venv


class RunningServer:
    """A server process on a fresh loopback port; stopped on exit, even after an error."""

    def __init__(self, system: System, log: Path, startup_timeout: float) -> None:
        self.system, self.log, self.startup_timeout = system, log, startup_timeout
        self.port = free_port()
        self.command = [part.replace("{port}", str(self.port)) for part in system.command]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RunningServer:
        with open(self.log, "ab") as out:
            out.write(f"\n$ {shlex.join(self.command)}\n".encode())
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            cwd=REPO)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.system.name} exited with {self.process.returncode}; "
                                   f"see {self.log}")
            try:
                health = httpx.get(self.url + self.system.health_path, timeout=2.0,
                                   trust_env=False)
                if health.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.system.name} not ready after {self.startup_timeout:.0f} s; "
                           f"see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def readable(command: list[str]) -> str:
    """`radixserve ...` rather than this interpreter's path, for the report's rerun list."""
    if command[:3] == [sys.executable, "-m", "radixserve.cli"]:
        command = ["radixserve", *command[3:]]
    return shlex.join(command)


def bench_command(system: System, url: str, run: BenchRun, model: str, result: Path,
                  time_limit: float, server_command: list[str] | None = None) -> list[str]:
    command = [sys.executable, "-m", "radixserve.cli", "bench", "--base-url", url,
               "--workload", run.workload, "--max-concurrency", str(run.concurrency),
               *run.args, "--tokenizer", model, "--system", system.name, "--no-progress",
               "--time-limit", str(time_limit), "--result-file", str(result)]
    metadata = dict(system.metadata)
    if server_command:
        metadata["server_command"] = readable(server_command)
    for key, value in metadata.items():
        command += ["--metadata", f"{key}={value}"]
    return command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path,
                   help="run directory (default: results/peers/run-YYYYmmdd-HHMMSS)")
    p.add_argument("--model", help="the .gguf every system serves (default: radixserve's "
                                   "default model, SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--systems", default=",".join([*RADIXSERVE_MODES, VENDOR, LLAMA_CPP]),
                   help="comma list from radix, hash, off, vendor, llama-cpp-python "
                        "(default: %(default)s)")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                   help="any other OpenAI-compatible server already running (repeatable)")
    p.add_argument("--preset", choices=list(PRESETS), default="quick",
                   help="workload sizes (default: %(default)s)")
    p.add_argument("--only", help="comma list of workloads to keep from the preset")
    p.add_argument("--kv-cache-tokens", type=int, help="radixserve's KV pool, in tokens")
    p.add_argument("--page-size", type=int,
                   help="radixserve's page size in radix and off modes (default: its own)")
    p.add_argument("--hash-page-size", type=int, default=16,
                   help="page (block) size in hash mode; 16 is vLLM's default block "
                        "(default: %(default)s)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARGS",
                   help="extra arguments for every `radixserve serve` (repeatable)")
    p.add_argument("--llama-cpp-version", default=LLAMA_CPP_VERSION,
                   help="llama-cpp-python version to install (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=900.0,
                   help="seconds per bench run (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds for a server to become healthy (default: %(default)s)")
    p.add_argument("--setup-only", action="store_true", help="install the peers and stop")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and the commands, start nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out: Path = args.out or PEERS_HOME / f"run-{stamp}"
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(wanted) - {*RADIXSERVE_MODES, VENDOR, LLAMA_CPP}
    if unknown:
        print(f"error: unknown systems {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.model:
        model = args.model
    elif args.dry_run:
        model = "DEFAULT_MODEL.gguf"
    else:
        from radixserve.model.default_model import default_model_path

        model = str(default_model_path())

    systems = [radixserve_system(m, model, args) for m in RADIXSERVE_MODES if m in wanted]
    if VENDOR in wanted:
        systems.append(vendor_system(model, args))
    if LLAMA_CPP in wanted:
        venv = PEERS_HOME / "venvs" / f"{LLAMA_CPP}-{args.llama_cpp_version}"
        if not args.dry_run:
            out.mkdir(parents=True, exist_ok=True)
            venv = setup_llama_cpp(args.llama_cpp_version, out / "setup.log")
        systems.append(llama_cpp_system(venv, model))
    for item in args.peer:
        name, found, url = item.partition("=")
        if not found:
            print(f"error: --peer must be NAME=URL, got {item!r}", file=sys.stderr)
            return 2
        systems.append(System(name, url=url.rstrip("/"),
                              metadata={"engine": name, "server": url.rstrip("/")}))
    if args.setup_only:
        return 0

    runs = PRESETS[args.preset]
    if args.only:
        keep = {w.strip() for w in args.only.split(",")}
        runs = [r for r in runs if r.workload in keep]

    if args.dry_run:
        for system in systems:
            for run in runs:
                result = out / "results" / f"{system.name}__{run.key}.json"
                print(f"# {system.name} / {run.key}")
                if system.command:
                    print(readable(system.command))
                print(readable(bench_command(system, system.url or "http://127.0.0.1:{port}",
                                             run, model, result, args.time_limit,
                                             system.command or None)))
        return 0

    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps({
        "command": shlex.join([sys.executable, *sys.argv]),
        "model": model,
        "systems": [asdict(s) for s in systems],
        "runs": [asdict(r) for r in runs],
    }, indent=1))
    failures = []
    for system in systems:
        for run in runs:
            result = out / "results" / f"{system.name}__{run.key}.json"
            log = out / "logs" / f"{system.name}__{run.key}.log"
            print(f"=== {system.name}: {run.workload}, concurrency {run.concurrency}", flush=True)
            try:
                if system.command:
                    with RunningServer(system, log, args.startup_timeout) as server:
                        code = subprocess.run(bench_command(
                            system, server.url, run, model, result, args.time_limit,
                            server.command), cwd=REPO).returncode
                else:
                    code = subprocess.run(bench_command(
                        system, system.url, run, model, result, args.time_limit),
                        cwd=REPO).returncode
            except RuntimeError as exc:
                code = -1
                print(f"error: {exc}", file=sys.stderr)
            if code != 0:
                failures.append(f"{system.name}/{run.key} (exit {code})")

    results = sorted(str(p) for p in (out / "results").glob("*.json"))
    if results:
        subprocess.run([sys.executable, "-m", "radixserve.cli", "bench", "report", *results,
                        "--out", str(out / "report"),
                        "--title", "radixserve and peers, same workloads, same machine"],
                       cwd=REPO, check=False)
    if failures:
        print("runs that failed: " + ", ".join(failures), file=sys.stderr)
    print(f"results in {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
