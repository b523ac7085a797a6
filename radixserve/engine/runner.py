"""Runs one step: lays out the scheduler's decision as a flat batch, has the attention backends
plan it once, runs the model and samples.

Decode tokens come first in the flattened batch, then prefill chunks; only rows that end a
request's known tokens get logits for sampling (a mid-prompt chunk needs none, nor a prompt with
max_tokens 0, which is computed to be scored). A speculating request's row (its newest token
and a draft) runs as a short chunk after the decode rows, with logits at every position, each
verified as if the draft before it were the output (radixserve/engine/speculative). A request that
asks for prompt log-probabilities also has its prompt rows scored, a slice at a time, so a long
chunk never holds its [rows, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from radixserve.engine.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.engine.sampler import (
    SamplerKernels,
    sample,
    sampling_distributions,
    top_logprobs,
)
from radixserve.engine.sampling_rows import SampleResult, SampleRow
from radixserve.engine.scheduler import ScheduledDraft, SchedulerOutput
from radixserve.engine.speculative.verify import accept_greedy, accept_sampled
from radixserve.engine.structured_output import fill_draft_masks, fill_masks
from radixserve.engine.window_kv import FullKV
from radixserve.kernels import argmax_op, token_bitmask_op
from radixserve.layers.attention import SequenceSpan, StepAttention, StepLayout
from radixserve.model.decoder import DecoderModel
from radixserve.model.forward_batch import ForwardBatch
from radixserve.outputs import TokenLogprob

# Prompt rows projected to logits at once: 256 x a 49k vocabulary is 50 MB of float32 (twice
# that with the log-softmax), whatever the chunk's length.
PROMPT_LOGPROB_ROWS = 256


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Rows of a step that score prompt tokens: row `first_row + i` holds position
    `first_target + i - 1`, whose logits give prompt token `first_target + i` its logprob."""

    request: Request
    first_row: int
    first_target: int
    count: int


class StepBatch(NamedTuple):
    batch: ForwardBatch
    # Whose sampling logits the batch returns, in row order: one row per request, then
    # 1 + len(draft) rows per speculating request.
    wants_logits: list[Request]
    prompt_spans: list[PromptLogprobSpan]
    verifies: list[ScheduledDraft]


@dataclass(frozen=True)
class VerifiedRow:
    """A speculating request's draft and the tokens verification gave it: the accepted draft
    tokens and then the model's own (with their logprobs, when asked for)."""

    request: Request
    draft: list[int]
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(frozen=True)
class StepResult:
    # The requests whose newest token was computed this step, with the sampled next tokens.
    sampled: list[Request]
    samples: SampleResult
    # Prompt log-probabilities computed this step: each request's next entries, in order.
    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)
    verified: list[VerifiedRow] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: DecoderModel, pool: KVPool, attention: StepAttention,
                 device: torch.device, generator: torch.Generator | None = None,
                 window_kv: FullKV | None = None) -> None:
        self.model = model
        self.pool = pool
        # Where sliding-window layers have a slot space of their own, it lays out their rows.
        self.window_kv = window_kv or FullKV(pool.allocator.release)
        self.attention = attention
        self.device = device
        # Draws the samples of requests without a seed of their own (EngineConfig.seed).
        self.generator = generator
        self._masks: ThreadPoolExecutor | None = None  # started by the first constrained step
        # Logits are sampled on the CPU: the C++ ops where the kernels are built (always on
        # CPU engines, which use them for the model).
        self._sampler_kernels = (SamplerKernels(token_bitmask_op(), argmax_op())
                                 if device.type == "cpu" else SamplerKernels())

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def build_batch(self, plan: SchedulerOutput) -> StepBatch:
        """The step's batch, the requests whose logits it returns, and its prompt rows to
        score."""
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
        verify_rows: list[int] = []
        for item in plan.verifies:
            request, first, n = item.request, item.request.num_computed, 1 + len(item.draft)
            prefills.append(SequenceSpan(request, len(ids), n, first))
            verify_rows.extend(range(len(ids), len(ids) + n))
            ids.append(request.token_at(first))
            ids.extend(item.draft)
            positions.extend(range(first, first + n))
            write_slots.extend(request.slots[first : first + n])
        prompt_spans: list[PromptLogprobSpan] = []
        for chunk in plan.prefills:
            request, n = chunk.request, chunk.num_tokens
            first = request.num_computed
            prefills.append(SequenceSpan(request, len(ids), n, first))
            span = _prompt_span(request, len(ids), first, n)
            if span is not None:
                prompt_spans.append(span)
            ids.extend(request.token_ids[first : first + n])
            positions.extend(range(first, first + n))
            write_slots.extend(request.slots[first : first + n])
            if chunk.completes_prompt and request.params.max_tokens > 0 and not request.finished:
                logit_rows.append(len(ids) - 1)
                wants_logits.append(request)
        logit_rows.extend(verify_rows)
        layout = StepLayout(decodes, prefills, self._tensor(write_slots),
                            self.window_kv.local_layout(decodes, prefills, self.device))
        # The last layer runs only for the rows something reads: those sampled from and those
        # scoring prompt tokens. The others' K/V is all the step keeps of them.
        wanted = sorted({*logit_rows, *(row for span in prompt_spans
                                        for row in range(span.first_row,
                                                         span.first_row + span.count))})
        output_rows = None
        if len(wanted) < len(ids):
            # Row indices become indices into the hidden states returned; a span's rows stay
            # adjacent, since all of them are kept and in order.
            at = {row: i for i, row in enumerate(wanted)}
            logit_rows = [at[row] for row in logit_rows]
            prompt_spans = [replace(span, first_row=at[span.first_row]) for span in prompt_spans]
            output_rows = self._tensor(wanted)
        batch = ForwardBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            logit_rows=self._tensor(logit_rows),
            attention=self.attention,
            attention_plan=self.attention.plan(layout),
            output_rows=output_rows,
        )
        return StepBatch(batch, wants_logits, prompt_spans, list(plan.verifies))

    def forward(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Float32 logits [R, vocab] of the step, and the requests they belong to."""
        batch, wants_logits, _, _ = self.build_batch(plan)
        return self.model(batch, self.pool.layers), wants_logits

    def run(
        self, plan: SchedulerOutput, banned: Callable[[Request, int], set[int] | None]
    ) -> StepResult:
        """Runs the plan and samples; `banned(request, ahead)` lists tokens it may not produce
        `ahead` tokens from now."""
        batch, wants_logits, prompt_spans, verifies = self.build_batch(plan)
        # The grammar masks depend only on tokens already taken: they are computed on another
        # thread while the model runs (llguidance releases the GIL, as do torch's kernels).
        constrained = [r for r in wants_logits if r.matcher is not None]
        masks = (self._mask_worker().submit(fill_masks, [r.matcher for r in constrained])
                 if constrained else None)
        drafted = [v for v in verifies if v.request.matcher is not None]
        draft_masks = (self._mask_worker().submit(
            fill_draft_masks, [(v.request.matcher, v.draft) for v in drafted])
            if drafted else None)
        hidden = self.model.hidden_states(batch, self.pool.layers)
        prompt_logprobs = [(span.request, self._score_prompt(hidden, span))
                           for span in prompt_spans]
        if not wants_logits and not verifies:
            return StepResult([], SampleResult([], []), prompt_logprobs)
        logits = self.model.compute_logits(hidden[batch.logit_rows])
        allowed = dict(zip(map(id, constrained), masks.result(), strict=True)) if masks else {}
        rows = [SampleRow(r.params, r.generator or self.generator, banned(r, 0), r.token_ids,
                          len(r.prompt_token_ids), allowed.get(id(r)))
                for r in wants_logits]
        logits = logits.cpu()
        # Row j of a draft samples as plain decoding would after the draft's first j tokens
        # (penalties read them, min_tokens counts them, a grammar's mask is its state after
        # them).
        row_masks = dict(zip(map(id, drafted), draft_masks.result(), strict=True)
                         ) if draft_masks else {}
        draft_rows = []
        for item in verifies:
            r = item.request
            grammar = row_masks.get(id(item))
            draft_rows.append([SampleRow(r.params, r.generator or self.generator, banned(r, j),
                                         r.token_ids + item.draft[:j], len(r.prompt_token_ids),
                                         None if grammar is None else grammar[j])
                               for j in range(1 + len(item.draft))])
        # Greedy drafts' rows are argmaxes, batched with the plain rows.
        greedy = [i for i, item in enumerate(verifies) if item.request.params.greedy]
        first_row = [len(rows)]
        for item in verifies:
            first_row.append(first_row[-1] + 1 + len(item.draft))
        at = list(range(len(rows))) + [row for i in greedy
                                       for row in range(first_row[i], first_row[i + 1])]
        with torch.inference_mode():
            samples = (sample(logits[at], rows + [row for i in greedy for row in draft_rows[i]],
                              self._sampler_kernels) if at else SampleResult([], []))
            verified = []
            done = len(rows)
            for i, item in enumerate(verifies):
                n = 1 + len(item.draft)
                if item.request.params.greedy:
                    tokens = accept_greedy(item.draft, samples.token_ids[done : done + n])
                    logprobs = samples.logprobs[done : done + len(tokens)]
                    done += n
                else:
                    tokens, logprobs = self._verify_sampled(
                        item, logits[first_row[i] : first_row[i + 1]], draft_rows[i])
                verified.append(VerifiedRow(item.request, item.draft, tokens, logprobs))
        return StepResult(wants_logits,
                          SampleResult(samples.token_ids[: len(rows)],
                                       samples.logprobs[: len(rows)]),
                          prompt_logprobs, verified)

    def _verify_sampled(self, item: ScheduledDraft, logits: torch.Tensor,
                        rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """A sampled request's tokens from its draft rows, by the exact acceptance rule."""
        adjusted, probs = sampling_distributions(logits, rows, self._sampler_kernels)
        tokens = accept_sampled(item.draft, probs, rows[0].generator)
        logprobs = top_logprobs(adjusted[: len(tokens)], tokens, rows[: len(tokens)])
        return tokens, logprobs

    @torch.inference_mode()
    def _score_prompt(self, hidden: torch.Tensor, span: PromptLogprobSpan) -> list[TokenLogprob]:
        """The span's prompt tokens' float32 log-probabilities with their top alternatives,
        PROMPT_LOGPROB_ROWS rows at a time."""
        request = span.request
        top_k = request.params.prompt_logprobs or 0
        targets = request.prompt_token_ids[span.first_target : span.first_target + span.count]
        entries: list[TokenLogprob] = []
        for start in range(0, span.count, PROMPT_LOGPROB_ROWS):
            stop = min(start + PROMPT_LOGPROB_ROWS, span.count)
            rows = hidden[span.first_row + start : span.first_row + stop]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            index = torch.tensor(targets[start:stop], device=logprobs.device).unsqueeze(1)
            chosen = logprobs.gather(1, index).squeeze(1).tolist()
            if top_k:
                top = torch.topk(logprobs, top_k, dim=-1)
                tops = [dict(zip(ids, values, strict=True)) for ids, values in
                        zip(top.indices.tolist(), top.values.tolist(), strict=True)]
            else:
                tops = [{} for _ in chosen]
            entries.extend(zip(chosen, tops, strict=True))
        return entries

    def _mask_worker(self) -> ThreadPoolExecutor:
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masks


def _prompt_span(request: Request, first_row: int, first: int, n: int) -> PromptLogprobSpan | None:
    """The rows of a prefill chunk (positions first .. first + n - 1, from `first_row`) that
    score prompt tokens the request still needs logprobs of (position p scores token p + 1);
    None when there are none."""
    if not request.needs_prompt_logprobs:
        return None
    have = len(request.prompt_logprobs or ())
    # These requests compute their whole prompt (no cache hit), chunk after chunk, so nothing
    # before this chunk's first target can be missing; after a preemption, more may be had.
    assert have >= first + 1, (request.request_id, have, first)
    start, stop = have, min(first + n + 1, len(request.prompt_token_ids))
    if start >= stop:
        return None
    return PromptLogprobSpan(request, first_row + start - 1 - first, start, stop - start)
