"""Chaos: faults injected into a server under steady load, and what clients saw.

Scenarios (--scenario, repeatable; default all):
- replica-kill: `--replicas 2`; one replica's process gets SIGKILL mid-run. Reports every
  in-flight request's outcome and end time (none may hang past the client timeout), how soon a
  new request succeeds, how soon Ray Serve has two replicas again, and the cached-token share
  of a repeated prefix before the kill and after the restart.
- replica-term: the same with SIGTERM (Ray Serve's graceful shutdown of the replica).
- disk-tier: a single server with `--kv-offload-dir`; mid-run the directory is swapped for a
  plain file, so every tier write and read fails (as a full or read-only filesystem would; a
  permission change would not stop root). Requests must keep succeeding.
- kv-events: a single server publishing KV events; one subscriber follows throughout, another
  is closed mid-run (its sockets dropped) and reopened. Once idle, both indexes must agree:
  the replay socket resynchronises the dropped one.
- drain: a single server with --drain-streams streams in flight gets SIGTERM: every stream must
  end complete, a request sent after the signal must get 503 with retry-after, and the
  process must exit 0.

    python benchmarks/chaos.py --seconds 40 --out results/chaos.json
    python benchmarks/chaos.py --scenario disk-tier --scenario kv-events
    python benchmarks/chaos.py --scenario drain --drain-streams 16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from radixserve.kv_events import BlockIndex, KVEventSubscriber
from radixserve.testing.server import free_port, start_server, wait_idle

MODEL = "SmolLM2-135M-Instruct"
SCENARIOS = ("replica-kill", "replica-term", "disk-tier", "kv-events", "drain")


@dataclass
class Result:
    status: int  # HTTP status; 0: transport error; -1: no answer within the timeout
    started: float
    ended: float
    streamed_error: bool = False  # a stream that ended with an error event


class Load:
    """`concurrency` clients sending chat requests (half streamed) that share one of a few
    long prefixes, until stopped; every request's outcome is kept."""

    def __init__(self, base_url: str, concurrency: int, timeout_s: float) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency)
        self._workers = [self._pool.submit(self._run, i) for i in range(concurrency)]
        prefixes = random.Random(0)
        self.prefixes = [" ".join(f"topic{prefixes.randrange(999)}" for _ in range(300))
                         for _ in range(3)]

    def _run(self, worker: int) -> None:
        rng = random.Random(worker)
        with httpx.Client(base_url=self.base_url, timeout=self.timeout_s, trust_env=False) as http:
            while not self._stop.is_set():
                self.results.append(self._one(http, rng))

    def _one(self, http: httpx.Client, rng: random.Random) -> Result:
        body = {"model": MODEL, "max_tokens": rng.randint(8, 32), "temperature": 0.5,
                "stream": rng.random() < 0.5,
                "messages": [{"role": "system", "content": rng.choice(self.prefixes)},
                             {"role": "user", "content": f"question {rng.randrange(10**6)}"}]}
        started = time.monotonic()
        result = Result(0, started, started)
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                result.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith('data: {"error"'):
                        result.streamed_error = True
        except httpx.TimeoutException:
            result.status = -1
        except httpx.HTTPError:
            result.status = 0
        result.ended = time.monotonic()
        return result

    def stop(self) -> list[Result]:
        self._stop.set()
        for worker in self._workers:
            worker.result()
        self._pool.shutdown()
        return self.results


def _summary(results: list[Result], fault_at: float) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for r in results:
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    spanning = [r for r in results if r.started <= fault_at <= r.ended]
    return {"requests": len(results), "by_status": by_status,
            "hangs": sum(1 for r in results if r.status == -1),
            "5xx": sum(1 for r in results if r.status >= 500),
            "streams_ended_with_error_event": sum(r.streamed_error for r in results),
            "in_flight_at_fault": len(spanning),
            "in_flight_longest_s_after_fault": max((r.ended - fault_at for r in spanning),
                                                   default=0.0),
            "in_flight_outcomes": sorted(f"{r.status}{'+error_event' * r.streamed_error}"
                                         for r in spanning)}


def _until(check: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until `check` holds, or None."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if check():
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return None


def _chat_ok(base_url: str, content: str = "ping") -> bool:
    response = httpx.post(base_url + "/v1/chat/completions", timeout=30, trust_env=False,
                          json={"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": content}]})
    return response.status_code == 200


def _cached_share(base_url: str, prefix: str) -> float:
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": prefix},
        {"role": "user", "content": f"probe {random.randrange(10**6)}"}]}
    for _ in range(30):  # under load admission may refuse it: wait as it asks, as an SDK would
        response = httpx.post(base_url + "/v1/chat/completions", timeout=120, trust_env=False,
                              json=body)
        if response.status_code != 429:
            break
        time.sleep(int(response.headers.get("retry-after-ms", "1000")) / 1000)
    response.raise_for_status()
    usage = response.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]


def _replicas(base_url: str) -> list[dict[str, Any]]:
    response = httpx.get(base_url + "/v1/replicas", timeout=30, trust_env=False)
    return response.json()["replicas"]


def replica_fault(args: argparse.Namespace, tmp: Path, sig: int) -> dict[str, Any]:
    proc = start_server(["--replicas", "2", "--cpus-per-replica", "0.5", "--num-threads", "1",
                         "--kv-cache-tokens", "8192", "--no-access-log",
                         *shlex.split(args.replica_flags)], tmp / "server.log")
    try:
        load = Load(proc.base_url, args.concurrency, args.client_timeout)
        time.sleep(args.seconds / 2)
        share_before = _cached_share(proc.base_url, load.prefixes[0])
        victim = _replicas(proc.base_url)[0]
        fault_at, fault_wall = time.monotonic(), time.time()
        os.kill(victim["pid"], sig)
        serving_s = _until(lambda: _chat_ok(proc.base_url), 60)
        restored_s = _until(lambda: len(_replicas(proc.base_url)) == 2
                            and victim["replica"] not in {r["replica"] for r in
                                                          _replicas(proc.base_url)}, 180)
        time.sleep(args.seconds / 2)
        results = load.stop()
        share_after = _cached_share(proc.base_url, load.prefixes[0])
        return {**_summary(results, fault_at), "fault_at_unix": fault_wall,
                "answers_new_requests_after_s": serving_s,
                "two_replicas_again_after_s": restored_s,
                "cached_share_before": share_before, "cached_share_after": share_after,
                "server_alive": proc.process.poll() is None}
    finally:
        proc.stop()


def disk_tier(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    tier = tmp / "tier"
    proc = start_server(["--kv-cache-tokens", "4096", "--num-threads", "2", "--no-access-log",
                         "--kv-offload-dir", str(tier)], tmp / "server.log")
    try:
        load = Load(proc.base_url, args.concurrency, args.client_timeout)
        time.sleep(args.seconds / 2)
        fault_at = time.monotonic()
        shutil.rmtree(tier)
        tier.write_text("not a directory")  # every write and read under it now fails
        time.sleep(args.seconds / 2)
        results = load.stop()
        healthy = httpx.get(proc.base_url + "/health", trust_env=False).status_code == 200
        metrics = wait_idle(proc.base_url)
        return {**_summary(results, fault_at), "healthy_after": healthy,
                "pool_idle": metrics["kv_cache_tokens{state=private}"] == 0
                and metrics["kv_cache_tokens{state=protected}"] == 0}
    finally:
        exit_status = proc.stop()
        if exit_status != 0:
            print(f"disk-tier: the server exited with {exit_status}", file=sys.stderr)


def kv_events(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    pub, replay = free_port(), free_port()
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    proc = start_server(["--kv-cache-tokens", "4096", "--num-threads", "2", "--no-access-log",
                         "--kv-events-endpoint", f"tcp://*:{pub}",
                         "--kv-events-replay-endpoint", f"tcp://*:{replay}"], tmp / "server.log")
    steady, dropped = BlockIndex(), BlockIndex()
    follower = KVEventSubscriber(endpoint, replay_endpoint,
                                 lambda seq, batch: steady.apply("server", batch))
    victim = KVEventSubscriber(endpoint, replay_endpoint,
                               lambda seq, batch: dropped.apply("server", batch))
    try:
        load = Load(proc.base_url, args.concurrency, args.client_timeout)
        time.sleep(args.seconds / 3)
        fault_at = time.monotonic()
        victim.close()  # its sockets go; the server keeps publishing
        dropped = BlockIndex()
        time.sleep(args.seconds / 3)
        victim = KVEventSubscriber(endpoint, replay_endpoint,
                                   lambda seq, batch: dropped.apply("server", batch))
        time.sleep(args.seconds / 3)
        results = load.stop()
        wait_idle(proc.base_url)
        agreed_s = _until(lambda: steady.block_count("server") == dropped.block_count("server")
                          and steady.block_count("server") > 0, 30)
        return {**_summary(results, fault_at), "indexes_agree_after_s": agreed_s,
                "blocks": [steady.block_count("server"), dropped.block_count("server")]}
    finally:
        follower.close()
        victim.close()
        proc.stop()


def drain(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    proc = start_server(["--kv-cache-tokens", "16384", "--num-threads", "2", "--no-access-log",
                         "--max-num-seqs", str(max(args.drain_streams, 16)),
                         "--shutdown-timeout", "120"], tmp / "server.log")
    tokens = 64
    started = threading.Barrier(args.drain_streams + 1)

    def stream(i: int) -> dict[str, Any]:
        body = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Story number {i}, please."}]}
        usage, error, first = None, False, False
        with httpx.stream("POST", proc.base_url + "/v1/chat/completions", json=body,
                          timeout=args.client_timeout, trust_env=False) as response:
            for line in response.iter_lines():
                if not first and line.startswith("data: {"):
                    first = True
                    started.wait()
                if line.startswith('data: {"error"'):
                    error = True
                elif line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                    usage = json.loads(line[6:]).get("usage") or usage
            return {"status": response.status_code, "error_event": error,
                    "completion_tokens": (usage or {}).get("completion_tokens")}

    with concurrent.futures.ThreadPoolExecutor(args.drain_streams) as pool:
        futures = [pool.submit(stream, i) for i in range(args.drain_streams)]
        started.wait(timeout=args.client_timeout)  # every stream has its first token
        signalled = time.monotonic()
        proc.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = httpx.post(proc.base_url + "/v1/chat/completions", timeout=30, trust_env=False,
                          json={"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "late"}]})
        results = [f.result(timeout=args.client_timeout) for f in futures]
    exit_status = proc.process.wait(timeout=180)
    return {"streams": len(results),
            "complete": sum(r["status"] == 200 and not r["error_event"]
                            and r["completion_tokens"] == tokens for r in results),
            "late_request_status": late.status_code,
            "late_request_retry_after": late.headers.get("retry-after"),
            "exit_status": exit_status, "exit_after_signal_s": time.monotonic() - signalled}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", choices=SCENARIOS, default=None)
    p.add_argument("--seconds", type=float, default=40.0, help="load per scenario")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--client-timeout", type=float, default=120.0)
    p.add_argument("--drain-streams", type=int, default=16)
    p.add_argument("--replica-flags", default="",
                   help="more `radixserve serve` flags for the replica scenarios")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep each scenario's server log here (<scenario>.log)")
    args = p.parse_args()
    report: dict[str, Any] = {"command": " ".join(sys.argv)}
    for scenario in args.scenario or SCENARIOS:
        print(f"{scenario}...", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            if scenario == "replica-kill":
                report[scenario] = replica_fault(args, Path(tmp), signal.SIGKILL)
            elif scenario == "replica-term":
                report[scenario] = replica_fault(args, Path(tmp), signal.SIGTERM)
            elif scenario == "disk-tier":
                report[scenario] = disk_tier(args, Path(tmp))
            elif scenario == "drain":
                report[scenario] = drain(args, Path(tmp))
            else:
                report[scenario] = kv_events(args, Path(tmp))
            if args.log_dir:  # the server's log, to read beside the figures
                args.log_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(tmp) / "server.log", args.log_dir / f"{scenario}.log")
        print(json.dumps(report[scenario], indent=2), file=sys.stderr)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
