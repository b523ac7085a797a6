"""Reading a list of KV slots out of the head-major pool: views for runs, one gather for the
rest. Shared by the backends that compute attention with PyTorch ops over copied K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.sequences import common_prefix_len

# Runs shorter than this are gathered with the scattered slots: slicing a view costs Python
# time per run and layer, which a short run does not pay back.
MIN_COPY_RUN = 512


@dataclass(frozen=True)
class KVGather:
    """How to read the keys (or values) of a list of slots out of a layer's pool.

    Scattered slots are gathered in one index_select; long runs of consecutive slots (a
    prompt is allocated as one run) are sliced out of the pool as views. The result is the
    concatenation, in order, of `segments`: (from_pool, start, length), where from_pool says
    a view of the pool at `start` and otherwise rows of the gathered tensor. A run copied as
    a view skips index_select's per-slot indexing.
    """

    # [heads * G] rows of the pool seen as `[heads * slots, dim]`: head h's copy of slot s is
    # row h * slots + s. One index_select over rows of that 2-D view is cheaper than
    # index_select along the slot axis of the 3-D pool, which walks the slots per head.
    gathered: torch.Tensor | None
    segments: list[tuple[bool, int, int]] | None  # None: the gathered tensor is the whole result

    @staticmethod
    def rows_of(slots: torch.Tensor, heads: int, num_slots: int) -> torch.Tensor:
        """The `gathered` rows that read `slots` for every head."""
        offsets = torch.arange(heads, dtype=slots.dtype, device=slots.device) * num_slots
        return (offsets.unsqueeze(1) + slots.unsqueeze(0)).view(-1)

    def take(self, cache: torch.Tensor) -> torch.Tensor:
        """Reads from a head-major pool `[heads, slots, dim]`; returns `[heads, len, dim]`."""
        heads, _, dim = cache.shape
        rows = None
        if self.gathered is not None:
            rows = cache.view(-1, dim).index_select(0, self.gathered).view(heads, -1, dim)
        if self.segments is None:
            assert rows is not None
            return rows
        parts = [cache[:, a : a + n] if from_pool else rows[:, a : a + n]  # type: ignore[index]
                 for from_pool, a, n in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def slot_run(slots: list[int], limit: int) -> int:
    """How many of the first `limit` slots continue slots[0] one by one (a view of the pool)."""
    if limit <= 0:
        return 0
    return common_prefix_len(slots, list(range(slots[0], slots[0] + limit)), 0, limit)


@dataclass
class GatherPlanner:
    """Plans KV reads for one pool: `[heads, num_slots, dim]` per layer, on `device`."""

    heads: int
    num_slots: int
    device: torch.device
    min_copy_run: int = MIN_COPY_RUN

    def rows(self, slots: list[int]) -> torch.Tensor:
        """KVGather rows reading `slots` from every head of the pool."""
        index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        return KVGather.rows_of(index, self.heads, self.num_slots)

    def plan(self, tables: list[list[int]], length: int) -> KVGather:
        """Reads each table's slots, padded to `length`, one table after another.

        A table that starts with a run of at least `min_copy_run` consecutive slots has that
        run read as a view; everything else goes into one index_select. Padding reads slot 0
        (any valid slot would do); attention masks it.
        """
        segments: list[tuple[bool, int, int]] = []
        gathered: list[int] = []
        for table in tables:
            run = slot_run(table, len(table)) if len(table) >= self.min_copy_run else 0
            if run < self.min_copy_run:
                run = 0
            else:
                segments.append((True, table[0], run))
            rest = table[run:] + [0] * (length - len(table))
            if not rest:
                continue
            if segments and not segments[-1][0]:  # extends the previous gathered segment
                _, at, n = segments[-1]
                segments[-1] = (False, at, n + len(rest))
            else:
                segments.append((False, len(gathered), len(rest)))
            gathered.extend(rest)
        has_runs = any(from_pool for from_pool, _, _ in segments)
        return KVGather(self.rows(gathered) if gathered else None, segments if has_runs else None)
