"""The engine thread's heartbeat, read by the server's watchdog and liveness route: when its
loop last turned and how long the step now running has taken. Also the test-only fault hook
that makes a step stall or raise, so that tests can watch the watchdog act.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# TESTS ONLY. A path; while a file exists there, every engine step first reads it: "stall"
# holds the step until the file is removed, "raise" makes the step raise.
FAULT_FILE_ENV = "RADIXSERVE_TEST_FAULT_FILE"


class InjectedFault(RuntimeError):
    """Raised by a step when the test-only fault file says "raise"."""


@dataclass
class Heartbeat:
    """Written by the engine thread only; float stores are atomic, so readers need no lock."""

    beat_at: float = 0.0  # monotonic time the loop last turned
    step_started_at: float | None = None  # None: between steps
    steps: int = 0

    def beat(self) -> None:
        self.beat_at = time.monotonic()

    def step_begun(self) -> None:
        self.step_started_at = time.monotonic()

    def step_ended(self) -> None:
        self.step_started_at = None
        self.steps += 1
        self.beat()

    def step_running_s(self) -> float:
        """How long the current step has run; 0 between steps."""
        started = self.step_started_at
        return 0.0 if started is None else time.monotonic() - started


@dataclass(frozen=True)
class FaultInjector:
    """The test-only fault file (`FAULT_FILE_ENV`); inert unless the variable is set."""

    path: str | None

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(os.environ.get(FAULT_FILE_ENV) or None)

    def before_step(self) -> None:
        if self.path is None:
            return
        fault = self._read()
        if fault == "raise":
            raise InjectedFault(f"fault injected through {FAULT_FILE_ENV}")
        while fault == "stall":
            time.sleep(0.05)
            fault = self._read()

    def _read(self) -> str | None:
        try:
            with open(self.path or "") as f:
                return f.read().strip()
        except OSError:
            return None
