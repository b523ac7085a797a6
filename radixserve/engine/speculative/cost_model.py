"""How long a step takes against the rows it computes, for this model on this machine: the
forward measured once at start-up (a few uncached steps of 1 to 64 one-token rows, each with
its logits, as in a decode or verify step), interpolated in between; plus the step's own work
beside the forward (scheduling, sampling, detokenizing), which the engine measures as it runs
and passes in as `overhead`.

On a CPU a step of a few rows reads every weight once, so rows are nearly free until the
matmuls become compute-bound; from there each row costs its share. Speculation pays exactly
in the first regime, and this table is how `auto` tells which one a step is in.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class StepCostModel:
    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def measure(cls, forward: Callable[[int], None], repeats: int = 3,
                rows: tuple[int, ...] = MEASURED_ROWS) -> StepCostModel:
        """Times `forward(n)` (one step of n rows) for each n: the best of `repeats` runs after
        one warm-up, so a busy moment does not make the model look compute-bound."""
        seconds = []
        for n in rows:
            forward(n)
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                forward(n)
                best = min(best, time.perf_counter() - started)
            seconds.append(best)
        # Costs never fall with more rows; timing noise can say otherwise.
        for i in range(1, len(seconds)):
            seconds[i] = max(seconds[i], seconds[i - 1])
        return cls(tuple(rows), tuple(seconds))

    def step_seconds(self, rows: int) -> float:
        """A step's time at `rows` rows: linear between measured points, and beyond the last
        at the last segment's per-row cost."""
        xs, ys = self.rows, self.seconds
        if rows <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, rows), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def best_draft_length(self, rows: int, acceptance: float, available: int,
                          overhead: float = 0.0) -> int:
        """How many of `available` draft tokens one request should verify in a step of `rows`
        other rows: the k whose expected extra tokens buy the most time, and 0 unless those
        tokens cost less than the step's average token (so a compute-bound step never drafts).
        `overhead` is the step's time beside the forward: a drafted token saves its share of
        that too, and adds nothing to it.

        With per-token acceptance a, k drafted tokens yield a + a^2 + ... + a^k extra tokens
        on average (the first mismatch ends the run)."""
        base = self.step_seconds(rows)
        per_token = (base + overhead) / rows
        best_k, best_saving = 0, 0.0
        extra = 0.0
        for k in range(1, available + 1):
            extra += acceptance ** k
            saving = extra * per_token - (self.step_seconds(rows + k) - base)
            if saving > best_saving:
                best_k, best_saving = k, saving
        return best_k
