"""Runs one step: lays out the scheduler's decision as a flat batch, has the attention backends
plan it once, runs the model and samples.

Decode tokens come first in the flattened batch, then prefill chunks; only rows that end a
request's known tokens get logits (a mid-prompt chunk needs none).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from radixserve.engine.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.engine.sampler import SampleResult, SampleRow, sample
from radixserve.engine.scheduler import SchedulerOutput
from radixserve.engine.structured_output import fill_masks
from radixserve.layers.attention import SequenceSpan, StepAttention, StepLayout
from radixserve.model.llama import ForwardBatch, LlamaModel


@dataclass(frozen=True)
class StepResult:
    # The requests whose newest token was computed this step, with the sampled next tokens.
    sampled: list[Request]
    samples: SampleResult


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, attention: StepAttention,
                 device: torch.device, generator: torch.Generator | None = None) -> None:
        self.model = model
        self.pool = pool
        self.attention = attention
        self.device = device
        # Draws the samples of requests without a seed of their own (EngineConfig.seed).
        self.generator = generator
        self._masks: ThreadPoolExecutor | None = None  # started by the first constrained step

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def build_batch(self, plan: SchedulerOutput) -> tuple[ForwardBatch, list[Request]]:
        """The step's batch, and the requests whose logits it returns, in row order."""
        ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        logit_rows: list[int] = []
        wants_logits: list[Request] = []
        decodes: list[SequenceSpan] = []
        # Requests on one cached prefix hold the same first slot: side by side in the batch,
        # whatever reads a prefix for one finds it in cache for the next.
        for request in sorted(plan.decodes, key=lambda r: r.slots[0]):
            pos = request.num_computed
            decodes.append(SequenceSpan(request, len(ids), 1, pos))
            logit_rows.append(len(ids))
            wants_logits.append(request)
            ids.append(request.token_at(pos))
            positions.append(pos)
            write_slots.append(request.slots[pos])
        prefills: list[SequenceSpan] = []
        for chunk in plan.prefills:
            request, n = chunk.request, chunk.num_tokens
            first = request.num_computed
            prefills.append(SequenceSpan(request, len(ids), n, first))
            ids.extend(request.token_ids[first : first + n])
            positions.extend(range(first, first + n))
            write_slots.extend(request.slots[first : first + n])
            if chunk.completes_prompt:
                logit_rows.append(len(ids) - 1)
                wants_logits.append(request)
        layout = StepLayout(decodes, prefills, self._tensor(write_slots))
        batch = ForwardBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            logit_rows=self._tensor(logit_rows),
            attention=self.attention,
            attention_plan=self.attention.plan(layout),
        )
        return batch, wants_logits

    def forward(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Float32 logits [R, vocab] of the step, and the requests they belong to."""
        batch, wants_logits = self.build_batch(plan)
        return self.model(batch, self.pool.layers), wants_logits

    def run(
        self, plan: SchedulerOutput, banned: Callable[[Request], set[int] | None]
    ) -> StepResult:
        """Runs the plan and samples; `banned(request)` lists tokens it may not produce yet."""
        batch, wants_logits = self.build_batch(plan)
        # The grammar masks depend only on tokens already taken: they are computed on another
        # thread while the model runs (llguidance releases the GIL, as do torch's kernels).
        constrained = [r for r in wants_logits if r.matcher is not None]
        masks = (self._mask_worker().submit(fill_masks, [r.matcher for r in constrained])
                 if constrained else None)
        logits = self.model(batch, self.pool.layers)
        if not wants_logits:
            return StepResult([], SampleResult([], []))
        allowed = dict(zip(map(id, constrained), masks.result(), strict=True)) if masks else {}
        rows = [SampleRow(r.params, r.generator or self.generator, banned(r), r.token_ids,
                          len(r.prompt_token_ids), allowed.get(id(r)))
                for r in wants_logits]
        with torch.inference_mode():
            samples = sample(logits.cpu(), rows)
        return StepResult(wants_logits, samples)

    def _mask_worker(self) -> ThreadPoolExecutor:
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masks
