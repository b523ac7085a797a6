"""Counts the Python work an operation does, so tests can check how it grows with size instead
of timing it (a wall-clock bound fails on a loaded machine and passes a slow algorithm on a
fast one)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def count_steps(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Runs `fn` and returns its result with the number of Python lines and calls it executed
    (every frame, loop iterations included: a line re-run after a backward jump counts again)."""
    steps = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        result = fn()
    finally:
        sys.settrace(previous)
    return result, steps
