"""Runs `radixserve serve` as a child process on a free loopback port, ready when
/health/ready says so, and reads its /metrics; for tests and benchmarks that need a real
server per configuration."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The engine thread or a route failing, or asyncio finding a task left behind.
SERIOUS = ("engine loop died", "unhandled error", "engine request failed", "Exception in thread",
           "Task exception was never retrieved", "Task was destroyed but it is pending")


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def serious_errors(self) -> list[str]:
        """Log lines that mean a bug in the server, whatever the responses looked like."""
        return [line for line in self.log().splitlines() if any(s in line for s in SERIOUS)]

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait (SIGKILL after `timeout_s`); returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    args: list[str], log_path: Path, startup_timeout_s: float = 300.0,
    env: dict[str, str | None] | None = None, wait_ready: bool = True,
) -> ServerProcess:
    """Starts `python -m radixserve.cli serve --port <free> ARGS`; raises if it is not ready
    (/health/ready: warm-up done) within `startup_timeout_s` (the log is in the message).
    `env` adds to this process's environment (None removes a variable).
    `wait_ready=False` returns once it is live (/health), while it may still be warming up."""
    port = free_port()
    command = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={k: v for k, v in {**os.environ, **(env or {})}.items()
                                        if v is not None})
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            route = "/health/ready" if wait_ready else "/health"
            if httpx.get(server.base_url + route, timeout=2.0, trust_env=False).is_success:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop(timeout_s=5)
    raise RuntimeError(f"the server was not healthy after {startup_timeout_s:.0f} s:\n"
                       f"{server.log()}")


_SAMPLE = re.compile(r"^radixserve:([A-Za-z0-9_:]+)(?:\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str, by_replica: bool = False) -> dict[str, float]:
    """`radixserve:` samples keyed by name without the prefix, plus labels other than
    model_name: `kv_cache_tokens{state=free}`, `request_success_total{finished_reason=stop}`.
    Behind replicas, engine figures are summed over the `replica` label (the cluster's), unless
    `by_replica` keeps it."""
    found: dict[str, float] = {}
    dropped = {"model_name"} if by_replica else {"model_name", "replica"}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        pairs = [f"{k}={v}" for k, v in _LABEL.findall(labels or "") if k not in dropped]
        key = f"{name}{{{','.join(pairs)}}}" if pairs else name
        found[key] = found.get(key, 0.0) + float(value)
    return found


def read_metrics(base_url: str, by_replica: bool = False) -> dict[str, float]:
    response = httpx.get(base_url + "/metrics", timeout=60.0, trust_env=False)
    response.raise_for_status()
    return parse_metrics(response.text, by_replica)


def wait_idle(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The metrics once no request is running or waiting; raises TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics(base_url)
        if metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is still busy after {timeout_s:.0f} s: {metrics}")
        time.sleep(0.1)
