"""The watchdog: a thread that reads the engine's heartbeat. Once warm-up has run, a step
running past the stall limit gets every thread's stack logged and the server marked not ready (liveness 503 too);
past the exit limit, or once the engine thread has died, the process exits non-zero so that a
supervisor restarts it, rather than leaving routes waiting on an engine that will not answer.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from radixserve.engine.heartbeat import Heartbeat
from radixserve.server.serving import Lifecycle

logger = logging.getLogger(__name__)

EXIT_ENGINE_DIED = 70  # the engine thread raised
EXIT_ENGINE_STUCK = 71  # one step ran past the exit limit
# After the engine died: time for the open requests' errors (503) to reach their clients.
DEATH_GRACE_S = (0.5, 3.0)  # once none is in flight, and at most


def thread_stacks() -> str:
    """Every thread's current stack, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, ident)} ---\n{stack}")
    return "\n".join(parts)


def _exit_now(status: int) -> None:
    logging.shutdown()  # flush the log before leaving
    os._exit(status)  # the engine thread cannot be joined: it is stuck or gone


class Watchdog:
    """Started by the serving process; `stop` before the engine shuts down on purpose."""

    def __init__(self, heartbeat: Heartbeat, lifecycle: Lifecycle, engine_alive: Callable[[], bool],
                 armed: Callable[[], bool], stall_s: float, exit_s: float,
                 period_s: float = 0.2, exit_process: Callable[[int], None] = _exit_now) -> None:
        """`armed`: whether step times count yet (after warm-up: a cold first step may build
        kernels or wait on another process building them)."""
        self.heartbeat = heartbeat
        self.armed = armed
        self.lifecycle = lifecycle
        self.engine_alive = engine_alive
        self.stall_s = stall_s
        self.exit_s = exit_s
        self.period_s = period_s
        self.exit_process = exit_process
        self._stopped = threading.Event()
        self._died_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="radixserve-watchdog",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            self.check()

    def check(self) -> None:
        if not self.engine_alive():
            now = time.monotonic()
            if self._died_at is None:
                self._died_at = now
            settled, longest = DEATH_GRACE_S
            waited = now - self._died_at
            if waited < longest and (self.lifecycle.in_flight or waited < settled):
                return
            logger.critical("the engine thread has died (its error is logged above as 'engine "
                            "loop died'); exiting with status %d so that a supervisor restarts "
                            "the server", EXIT_ENGINE_DIED)
            self.exit_process(EXIT_ENGINE_DIED)
            return
        running = self.heartbeat.step_running_s() if self.armed() else 0.0
        if running > self.stall_s and not self.lifecycle.stalled:
            self.lifecycle.stalled = True
            logger.error("an engine step has run for %.1f s (stall limit %.0f s): not ready "
                         "until it ends; thread stacks:\n%s", running, self.stall_s,
                         thread_stacks())
        elif running <= self.stall_s and self.lifecycle.stalled:
            self.lifecycle.stalled = False
            logger.warning("the stalled engine step ended; ready again")
        if self.exit_s and running > self.exit_s:
            logger.critical("an engine step has run for %.1f s (exit limit %.0f s); exiting "
                            "with status %d so that a supervisor restarts the server", running,
                            self.exit_s, EXIT_ENGINE_STUCK)
            self.exit_process(EXIT_ENGINE_STUCK)
