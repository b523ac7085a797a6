"""Builds one step's batch tensors from the scheduler's decision, runs the model, samples.

Decode tokens come first in the flattened batch, then prefill chunks; only rows that end a
request's known tokens get logits (a mid-prompt chunk needs none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.engine.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.engine.sampler import SampleResult, sample
from radixserve.engine.scheduler import SchedulerOutput, common_prefix_len
from radixserve.kernels import SKINNY_MAX_ROWS
from radixserve.model.llama import (
    DecodeGroup,
    ForwardBatch,
    KernelDecode,
    KVGather,
    LlamaModel,
    PrefillSpan,
)


@dataclass
class StepResult:
    # The requests whose newest token was computed this step, with the sampled next tokens.
    sampled: list[Request]
    samples: SampleResult


def slot_run(slots: list[int], limit: int) -> int:
    """How many of the first `limit` slots continue slots[0] one by one (a view of the pool)."""
    if limit <= 0:
        return 0
    return common_prefix_len(slots, list(range(slots[0], slots[0] + limit)), 0, limit)


@dataclass
class _KeptKV:
    """One decode group's own-part keys and values per layer, kept from one step to the next."""

    members: list[Request]
    lengths: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor] | None]


class ModelRunner:
    def __init__(
        self, model: LlamaModel, pool: KVPool, device: torch.device,
        decode_kernel: Callable[..., torch.Tensor] | None = None,
        matmul_kernel: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        # The C++ decode attention (radixserve/kernels), or None for the PyTorch path below.
        self.decode_kernel = decode_kernel
        self.kernel_level = 2  # the kernel's most vectorised path allowed (see KernelDecode)
        # The C++ bfloat16 matmul for steps of at most SKINNY_MAX_ROWS tokens, or None.
        self.matmul_kernel = matmul_kernel
        self.pool = pool
        self.device = device
        self.window = model.config.sliding_window
        # Below these, gathering a shared prefix once saves less than the extra kernels cost
        # (measured: groups of two on 1,500-token prefixes made the step slower, not faster).
        self.min_shared_prefix = 64
        self.min_group_size = 3
        self.length_bucket = 16
        # Runs shorter than this are gathered with the scattered slots: slicing a view costs
        # Python time per run and layer, which a short run does not pay back.
        self.min_copy_run = 512
        self._kept: dict[tuple[int, ...], _KeptKV] = {}

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def build_batch(self, plan: SchedulerOutput) -> tuple[ForwardBatch, list[Request]]:
        # Kept own-part K/V lives exactly one step: what this batch does not reuse is dropped.
        previous, self._kept = self._kept, {}
        ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        logit_rows: list[int] = []
        wants_logits: list[Request] = []
        groups: list[DecodeGroup] = []
        if self.decode_kernel is not None and plan.decodes:
            kernel, ordered = self._kernel_decode(plan.decodes, ids, positions, write_slots)
            logit_rows.extend(range(len(ids)))
            wants_logits.extend(ordered)
            grouped: list[Request] = []
        else:  # the PyTorch path: decode groups over gathered K/V
            kernel, grouped = None, plan.decodes
        for members, shared, contiguous in self._group_decodes(grouped):
            start = len(ids)
            lengths = []
            for request in members:
                pos = request.num_computed
                ids.append(request.token_at(pos))
                positions.append(pos)
                write_slots.append(request.slots[pos])
                logit_rows.append(len(ids) - 1)
                wants_logits.append(request)
                lengths.append(pos + 1)
            group = self._decode_group(members, lengths, shared, contiguous, start)
            if not self._keep(group, members, lengths, shared, previous):
                tables = [r.slots[shared:n] for r, n in zip(members, lengths, strict=True)]
                group.own = self._gather_plan(tables, group.length)
            groups.append(group)
        prefills: list[PrefillSpan] = []
        for chunk in plan.prefills:
            request, n = chunk.request, chunk.num_tokens
            start, first = len(ids), request.num_computed
            ids.extend(request.all_token_ids[first : first + n])
            positions.extend(range(first, first + n))
            write_slots.extend(request.slots[first : first + n])
            context = first + n
            plain_causal = first == 0 and not (self.window and context > self.window)
            mask = None
            if not plain_causal:
                rows = torch.arange(first, context).unsqueeze(1)
                cols = torch.arange(context).unsqueeze(0)
                mask = cols <= rows
                if self.window:
                    mask &= cols > rows - self.window
                mask = mask.to(self.device)
            prefills.append(
                PrefillSpan(
                    start=start,
                    length=n,
                    context=None if first == 0
                    else self._gather_plan([request.slots[:context]], context),
                    mask=mask,
                    plain_causal_from=None if self.window and context > self.window else first,
                )
            )
            if chunk.completes_prompt:
                logit_rows.append(start + n - 1)
                wants_logits.append(request)
        batch = ForwardBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            write_slots=self._tensor(write_slots),
            num_decode=len(plan.decodes),
            decode_groups=groups,
            prefills=prefills,
            logit_rows=self._tensor(logit_rows),
            kernel_decode=kernel,
            matmul=self.matmul_kernel if len(ids) <= SKINNY_MAX_ROWS else None,
        )
        return batch, wants_logits

    def _kernel_decode(
        self, decodes: list[Request], ids: list[int], positions: list[int],
        write_slots: list[int],
    ) -> tuple[KernelDecode, list[Request]]:
        """Adds the decode rows and lays out every context's slots for the kernel; returns
        the kernel's inputs and the requests in row order."""
        # Requests on one cached prefix hold the same first slot: side by side in the batch,
        # the kernel thread that reads a prefix for one finds it in L2 for the next.
        ordered = sorted(decodes, key=lambda r: r.slots[0])
        tables: list[np.ndarray] = []
        starts = [0]
        for request in ordered:
            pos = request.num_computed
            ids.append(request.token_at(pos))
            positions.append(pos)
            write_slots.append(request.slots[pos])
            first = max(0, pos + 1 - self.window) if self.window else 0
            tables.append(request.slot_array(pos + 1, first))
            starts.append(starts[-1] + pos + 1 - first)
        kernel = KernelDecode(
            op=self.decode_kernel,  # type: ignore[arg-type]
            slots=torch.from_numpy(np.concatenate(tables)),
            starts=torch.tensor(starts, dtype=torch.int64),
            max_level=self.kernel_level,
        )
        return kernel, ordered

    def _group_decodes(self, decodes: list[Request]) -> list[tuple[list[Request], int, bool]]:
        """Splits decode requests into groups that share a context prefix, plus one group of
        the rest; returns (members, shared prefix length, whether that prefix is one slot run).

        Shared slots mean shared KV: the prefix cache hands every request that hit one prompt
        prefix the same slots for it, so requests are grouped by their first slot. A group's
        prefix is read once for all members (as a view of the pool when its slots are one run,
        else by one gather). Each group costs about twenty more kernels per layer, so groups
        start at three requests: pairs measured slower than no group at 300- and 1,500-token
        prefixes alike.
        """
        if self.window or not decodes:
            return [(decodes, 0, False)] if decodes else []
        by_first: dict[int, list[Request]] = {}
        for request in decodes:
            by_first.setdefault(request.slots[0], []).append(request)
        groups: list[tuple[list[Request], int, bool]] = []
        rest: list[Request] = []
        for members in by_first.values():
            shared = self._shared_prefix(members) if len(members) >= self.min_group_size else 0
            run = slot_run(members[0].slots, shared)
            if run >= self.min_shared_prefix:
                groups.append((members, run, True))
            elif shared >= self.min_shared_prefix:
                groups.append((members, shared, False))
            else:
                rest.extend(members)
        if rest:
            groups.append((rest, 0, False))
        return groups

    def _shared_prefix(self, members: list[Request]) -> int:
        """Leading context slots all members share (stops early once below any threshold)."""
        first = members[0].slots
        # Each request's newest token is always its own.
        shared = min(r.num_computed for r in members)
        for request in members[1:]:
            shared = common_prefix_len(first, request.slots, 0, shared)
            if shared < self.min_shared_prefix:
                return 0
        return shared

    def _decode_group(
        self, members: list[Request], lengths: list[int], shared: int, contiguous: bool,
        start: int,
    ) -> DecodeGroup:
        own = [n - shared for n in lengths]
        # Padded up to a multiple of 16: oneDNN builds a new matmul primitive for every new
        # shape (0.4-1.3 ms each in bfloat16, measured, against 17-55 us for a cached one), and
        # an unpadded length would be new at every step.
        longest = -(-max(own) // self.length_bucket) * self.length_bucket
        mask = None
        if min(own) != longest or (self.window and max(lengths) > self.window):
            cols = torch.arange(longest) + shared
            lens = torch.tensor(lengths).unsqueeze(1)
            keep = cols < lens
            if self.window:
                keep &= cols >= lens - self.window
            mask = keep[:, None, None, :].to(self.device)
        prefix = members[0].slots[:shared]
        return DecodeGroup(
            start=start,
            end=start + len(members),
            shared=None if not shared
            else KVGather(None, [(True, prefix[0], shared)]) if contiguous
            else KVGather(self._rows(prefix), None),
            own=None,  # planned by build_batch unless last step's K/V is kept
            length=longest,
            mask=mask,
        )

    def _keep(
        self, group: DecodeGroup, members: list[Request], lengths: list[int], shared: int,
        previous: dict[tuple[int, ...], _KeptKV],
    ) -> bool:
        """Lets the group reuse last step's own-part K/V when the same members, in the same
        order and padded length, are each exactly one token further (returns True); else the
        group gathers and keeps its K/V for the next step. At 32 steady requests this skips 15
        of every 16 gathers (the length bucket grows once per 16 tokens)."""
        key = (*(id(r) for r in members), shared, group.length)
        kept = previous.get(key)
        if (kept is not None and all(a is b for a, b in zip(kept.members, members, strict=True))
                and kept.lengths == [n - 1 for n in lengths]
                and all(layer is not None for layer in kept.layers)):  # a failed step keeps none
            width = group.length
            group.append_at = self._tensor([i * width + n - 1 - shared
                                            for i, n in enumerate(lengths)])
            reused = True
        else:
            reused = False
            # The entry holds the members themselves, so their id()s cannot be reused.
            kept = _KeptKV(members, lengths, [None] * len(self.pool.k))
        kept.lengths = lengths
        group.kept = kept.layers
        self._kept[key] = kept
        return reused

    def _gather_plan(self, tables: list[list[int]], length: int) -> KVGather:
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
        return KVGather(self._rows(gathered) if gathered else None, segments if has_runs else None)

    def _rows(self, slots: list[int]) -> torch.Tensor:
        """KVGather rows reading `slots` from every head of the pool."""
        heads, num_slots, _ = self.pool.k[0].shape
        return KVGather.rows_of(self._tensor(slots), heads, num_slots)

    def run(
        self, plan: SchedulerOutput, banned: Callable[[Request], set[int] | None]
    ) -> StepResult:
        """Runs the plan and samples; `banned(request)` lists tokens it may not produce yet."""
        batch, wants_logits = self.build_batch(plan)
        logits = self.model(batch, self.pool.k, self.pool.v)
        if not wants_logits:
            return StepResult([], SampleResult([], []))
        with torch.inference_mode():
            samples = sample(
                logits.cpu(),
                [r.params for r in wants_logits],
                [r.generator for r in wants_logits],
                [banned(r) for r in wants_logits],
            )
        return StepResult(wants_logits, samples)
