"""Decode attention in PyTorch ops over K/V gathered from the pool: the portable path (any
device, any dtype), and the one CUDA runs.

One query per request against its gathered context, as batched matmuls over (kv head,
request): on CPU this beats SDPA's flash kernel (tuned for long queries) by an order of
magnitude, and the head-major pool makes the gather the only large copy. Requests that share
a context prefix (the prefix cache hands them the same slots for it) form a group whose
prefix is gathered and multiplied once for all members instead of once per request.
Attention sinks join each query head's softmax as one more score, whose weight is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.attention.base import AttentionBackend, AttentionEnv, LayerKV, SequenceSpan
from radixserve.layers.attention.gather import GatherPlanner, KVGather, slot_run
from radixserve.sequences import common_prefix_len

Rows = slice | torch.Tensor  # a group's rows in the step: a slice when consecutive


@dataclass(frozen=True)
class DecodeGroup:
    """Decode requests whose contexts begin with the same `prefix` KV slots."""

    rows: Rows
    size: int
    shared: KVGather | None  # the prefix all members share; None for a group sharing nothing
    own: KVGather  # each member's slots after the shared prefix, padded to `length`, in order
    length: int
    mask: torch.Tensor | None  # [b, 1, 1, length] bool; None when nothing is padded


class TorchDecode(AttentionBackend):
    name = "torch"
    role = "decode"

    def __init__(self, env: AttentionEnv) -> None:
        super().__init__(env)
        self.gathers = GatherPlanner(env.num_kv_heads, env.num_slots, env.device)
        # Below these, gathering a shared prefix once saves less than the extra kernels cost
        # (groups of two made the step slower, not faster).
        self.min_shared_prefix = 64
        self.min_group_size = 3
        # Own parts are padded to a multiple of 16: oneDNN builds a new matmul primitive for
        # every new shape (far dearer than reusing a cached one), and an unpadded length would
        # be new at every step.
        self.length_bucket = 16

    def plan(self, spans: list[SequenceSpan], window: int | None) -> list[DecodeGroup]:
        return [self._group(members, shared, contiguous, window)
                for members, shared, contiguous in self.group_decodes(spans, window)]

    def group_decodes(self, spans: list[SequenceSpan], window: int | None = None
                      ) -> list[tuple[list[SequenceSpan], int, bool]]:
        """Splits decode spans into groups that share a context prefix, plus one group of the
        rest; returns (members, shared prefix length, whether that prefix is one slot run).

        Requests are grouped by their first slot. Each group costs about twenty more kernels
        per layer, so groups start at three requests: pairs ran slower than no group, short
        prefixes and long alike. A sliding window (tokens) ends sharing: no group.
        """
        if window:
            return [(spans, 0, False)]
        by_first: dict[int, list[SequenceSpan]] = {}
        for span in spans:
            by_first.setdefault(span.table.slots[0], []).append(span)
        groups: list[tuple[list[SequenceSpan], int, bool]] = []
        rest: list[SequenceSpan] = []
        for members in by_first.values():
            shared = self._shared_prefix(members) if len(members) >= self.min_group_size else 0
            run = slot_run(members[0].table.slots, shared)
            if run >= self.min_shared_prefix:
                groups.append((members, run, True))
            elif shared >= self.min_shared_prefix:
                groups.append((members, shared, False))
            else:
                rest.extend(members)
        if rest:
            groups.append((rest, 0, False))
        return groups

    def _shared_prefix(self, members: list[SequenceSpan]) -> int:
        """Leading context slots all members share (stops early once below the threshold)."""
        first = members[0].table.slots
        shared = min(span.first for span in members)  # each newest token is its own
        for span in members[1:]:
            shared = common_prefix_len(first, span.table.slots, 0, shared)
            if shared < self.min_shared_prefix:
                return 0
        return shared

    def _group(self, members: list[SequenceSpan], shared: int, contiguous: bool,
               window: int | None) -> DecodeGroup:
        env = self.env
        lengths = [span.context for span in members]
        own = [n - shared for n in lengths]
        longest = -(-max(own) // self.length_bucket) * self.length_bucket
        mask = None
        if min(own) != longest or (window and max(lengths) > window):
            cols = torch.arange(longest) + shared
            lens = torch.tensor(lengths).unsqueeze(1)
            keep = cols < lens
            if window:
                keep &= cols >= lens - window
            mask = keep[:, None, None, :].to(env.device)
        prefix = members[0].table.slots[:shared]
        starts = [span.start for span in members]
        consecutive = starts == list(range(starts[0], starts[0] + len(starts)))
        return DecodeGroup(
            rows=slice(starts[0], starts[0] + len(starts)) if consecutive else env.tensor(starts),
            size=len(members),
            shared=None if not shared
            else KVGather(None, [(True, prefix[0], shared)]) if contiguous
            else KVGather(self.gathers.rows(prefix), None),
            own=self.gathers.plan([s.table.slots[shared:n] for s, n in zip(members, lengths,
                                                                            strict=True)], longest),
            length=longest,
            mask=mask,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                metadata: object, out: torch.Tensor, scale: float,
                sinks: torch.Tensor | None) -> None:
        assert isinstance(metadata, list)
        for group in metadata:
            if isinstance(group.rows, slice):
                out[group.rows] = self._attend(q[group.rows], group, cache, scale, sinks)
            else:
                out.index_copy_(0, group.rows, self._attend(q.index_select(0, group.rows), group,
                                                            cache, scale, sinks))

    def _softmax(self, scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax over the last axis of scores [H, b, G, L] (float32); a sink is one more
        score of its query head (h * G + g) whose weight goes nowhere."""
        if sinks is None:
            return torch.softmax(scores, dim=-1)
        heads, b, groups, _ = scores.shape
        column = sinks.to(scores.device).view(heads, 1, groups, 1).expand(heads, b, groups, 1)
        return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]

    def _attend(self, q: torch.Tensor, group: DecodeGroup, cache: LayerKV, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        env = self.env
        b, length = group.size, group.length
        heads, dim = env.num_kv_heads, env.head_dim
        groups = env.num_heads // heads
        keys = group.own.take(cache.k).view(heads * b, length, dim)
        values = group.own.take(cache.v).view(heads * b, length, dim)
        q_by_head = q.view(b, heads, groups, dim).transpose(0, 1)  # [H, b, G, D]
        own = q_by_head.reshape(heads * b, groups, dim)
        scores = torch.bmm(own, keys.transpose(1, 2)).float() * scale  # [H*b, G, L]
        if group.mask is not None:
            scores = scores.view(heads, b, groups, length).masked_fill(
                ~group.mask.view(1, b, 1, length), float("-inf")
            ).view(heads * b, groups, length)
        if group.shared is None:
            probs = self._softmax(scores.view(heads, b, groups, length), sinks)
            probs = probs.to(values.dtype).reshape(heads * b, groups, length)
            out = torch.bmm(probs, values).view(heads, b, groups, dim)
            return out.transpose(0, 1).reshape(b, env.num_heads, dim)
        # [H, P, D]: a view of the pool when the prefix is a run
        shared_keys, shared_values = group.shared.take(cache.k), group.shared.take(cache.v)
        prefix = shared_keys.shape[1]
        pooled = q_by_head.reshape(heads, b * groups, dim)
        # K @ q^T rather than q @ K^T: bmm copies a transposed view of the pool (several times
        # slower in bfloat16) but reads an untransposed one in place.
        shared_scores = torch.bmm(shared_keys, pooled.transpose(1, 2)).transpose(1, 2)
        shared_scores = shared_scores.float() * scale
        both = torch.cat(
            (shared_scores.view(heads, b, groups, prefix), scores.view(heads, b, groups, length)),
            dim=-1,
        )
        probs = self._softmax(both, sinks).to(values.dtype)
        shared_probs = probs[..., :prefix].reshape(heads, b * groups, prefix)
        own_probs = probs[..., prefix:].reshape(heads * b, groups, length)
        out = torch.bmm(shared_probs, shared_values).view(heads, b, groups, dim)
        out = out + torch.bmm(own_probs, values).view(heads, b, groups, dim)
        return out.transpose(0, 1).reshape(b, env.num_heads, dim)
