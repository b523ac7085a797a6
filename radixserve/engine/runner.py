"""Builds one step's batch tensors from the scheduler's decision, runs the model, samples.

Decode tokens come first in the flattened batch, then prefill chunks; only rows that end a
request's known tokens get logits (a mid-prompt chunk needs none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.engine.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.engine.sampler import SampleResult, sample
from radixserve.engine.scheduler import SchedulerOutput, common_prefix_len
from radixserve.model.llama import ForwardBatch, LlamaModel, PrefillSpan


@dataclass
class StepResult:
    # The requests whose newest token was computed this step, with the sampled next tokens.
    sampled: list[Request]
    samples: SampleResult


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.window = model.config.sliding_window
        # Below this, gathering a shared prefix once saves less than the extra matmuls cost.
        self.min_shared_prefix = 64

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def build_batch(self, plan: SchedulerOutput) -> tuple[ForwardBatch, list[Request]]:
        ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        logit_rows: list[int] = []
        wants_logits: list[Request] = []
        lengths: list[int] = []
        for request in plan.decodes:
            pos = request.num_computed
            ids.append(request.token_at(pos))
            positions.append(pos)
            write_slots.append(request.slots[pos])
            logit_rows.append(len(ids) - 1)
            wants_logits.append(request)
            lengths.append(pos + 1)
        decode_shared = decode_slots = decode_mask = None
        if plan.decodes:
            shared = self._shared_decode_prefix(plan.decodes, lengths)
            if shared:
                decode_shared = self._tensor(plan.decodes[0].slots[:shared])
            own = [n - shared for n in lengths]
            longest = max(own)
            # Padding reads slot 0 (any valid slot would do); the mask hides it.
            table = [r.slots[shared:shared + n] + [0] * (longest - n)
                     for r, n in zip(plan.decodes, own, strict=True)]
            decode_slots = torch.tensor(table, dtype=torch.int64).to(self.device)
            if min(own) != longest or (self.window and max(lengths) > self.window):
                cols = torch.arange(longest) + shared
                lens = torch.tensor(lengths).unsqueeze(1)
                mask = cols < lens
                if self.window:
                    mask &= cols >= lens - self.window
                decode_mask = mask[:, None, None, :].to(self.device)
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
                    context_slots=None if first == 0 else self._tensor(request.slots[:context]),
                    mask=mask,
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
            decode_shared_slots=decode_shared,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
            logit_rows=self._tensor(logit_rows),
        )
        return batch, wants_logits

    def _shared_decode_prefix(self, decodes: list[Request], lengths: list[int]) -> int:
        """Leading context slots that every decode request shares (0 if too few to matter).

        Shared slots mean shared KV: the prefix cache hands every request that hit one system
        prompt the same slots for it.
        """
        if len(decodes) < 2 or self.window:
            return 0
        first = decodes[0].slots
        shared = min(lengths) - 1  # each request's newest token is always its own
        for request in decodes[1:]:
            shared = common_prefix_len(first, request.slots, 0, shared)
            if shared < self.min_shared_prefix:
                return 0
        return shared

    def run(self, plan: SchedulerOutput, banned: list[set[int] | None]) -> StepResult:
        """Runs the plan; `banned` is per request wanting logits, in the order returned."""
        batch, wants_logits = self.build_batch(plan)
        logits = self.model(batch, self.pool.k, self.pool.v)
        if not wants_logits:
            return StepResult([], SampleResult([], []))
        with torch.inference_mode():
            samples = sample(
                logits.cpu(),
                [r.params for r in wants_logits],
                [r.generator for r in wants_logits],
                banned,
            )
        return StepResult(wants_logits, samples)

    def requests_wanting_logits(self, plan: SchedulerOutput) -> list[Request]:
        """The requests `run` will sample for, in its order (to prepare `banned`)."""
        return list(plan.decodes) + [c.request for c in plan.prefills if c.completes_prompt]
