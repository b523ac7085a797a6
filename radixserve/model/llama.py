"""Our Llama-family forward pass (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5) over a paged KV pool.

One call runs a variable-length batch: decode tokens of many requests and prefill chunks of
others, flattened into one token axis (no padding of the projections or the MLP). Attention
reads each request's keys and values through its slot table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.config import ModelConfig


@dataclass
class KVGather:
    """How to read the keys (or values) of a list of slots out of a layer's pool.

    Scattered slots are gathered in one index_select; long runs of consecutive slots (a
    prompt is allocated as one run) are sliced out of the pool as views. The result is the
    concatenation, in order, of `segments`: (from_pool, start, length), where from_pool says
    a view of the pool at `start` and otherwise rows of the gathered tensor. Copying a
    1,500-slot run as a view costs 40% less than gathering it slot by slot (measured).
    """

    # [heads * G] rows of the pool seen as `[heads * slots, dim]`: head h's copy of slot s is
    # row h * slots + s. One index_select over rows of that 2-D view runs 35% faster than
    # index_select along the slot axis of the 3-D pool (measured: 6.8 vs 10.9 ms per decode
    # step at 32 requests).
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


@dataclass
class PrefillSpan:
    """One request's prefill chunk inside the flattened batch."""

    start: int  # first row of the chunk in the batch
    length: int  # chunk tokens
    context: KVGather | None  # all context tokens (cached + chunk); None: no cache to read
    mask: torch.Tensor | None  # [length, context] bool, None when plain causal works
    # The chunk's first position when its mask is plain causal over the whole context (no
    # sliding window cuts it): lets attention build the mask itself, block by block.
    plain_causal_from: int | None = None


@dataclass
class DecodeGroup:
    """Decode requests in rows [start, end) whose contexts begin with the same KV slots.

    The shared prefix (a system prompt held once in the prefix cache) is gathered and
    multiplied once for the group; each request's own slots follow, padded to the longest.
    """

    start: int
    end: int
    shared: KVGather | None  # the prefix all members share; None for a group sharing nothing
    # Each request's slots after the shared prefix, padded to `length`, in order; None when
    # `append_at` reuses the K/V kept from the last step.
    own: KVGather | None
    length: int
    mask: torch.Tensor | None  # [b, 1, 1, L] bool; None when nothing is padded
    # Per layer, the own-part keys and values read for this group at the previous step, kept
    # by the runner; filled in here when None. With `append_at`, the same members are one
    # token further: only this step's tokens are written, at these columns of [b * length],
    # instead of gathering every context again.
    kept: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    append_at: torch.Tensor | None = None


@dataclass
class KernelDecode:
    """Decode rows [0, num_decode) attend through the C++ kernel (radixserve/kernels), which
    reads K/V where they lie in the pool: no gather, no padding, no mask. Request b's context
    is slots[starts[b]:starts[b + 1]], in position order (a sliding window already applied)."""

    op: Callable[..., torch.Tensor]
    slots: torch.Tensor  # int32
    starts: torch.Tensor  # int64 [num_decode + 1]
    # Most vectorised code path allowed: 0 portable C++, 1 AVX-512, 2 AVX-512 BF16 (the kernel
    # also stops at what the CPU has). Tests lower it to check each path against the others.
    max_level: int = 2


@dataclass
class ForwardBatch:
    """Everything the forward pass needs about where tokens sit and what they attend to.

    Rows [0, num_decode) are decode tokens (one per request); prefill chunks follow.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] int64: the KV slot each new token's K/V is written to
    num_decode: int
    decode_groups: list[DecodeGroup]  # cover rows [0, num_decode) unless kernel_decode does
    prefills: list[PrefillSpan]
    logit_rows: torch.Tensor  # [R] rows whose next-token logits are wanted
    kernel_decode: KernelDecode | None = None
    # y = x W^T (+ b) for this batch's projections when it has few rows (the C++ skinny
    # matmul, which streams the weights once where oneDNN reads them at half the bandwidth);
    # None: nn.Linear.
    matmul: Callable[..., torch.Tensor] | None = None


def project(layer: nn.Linear, x: torch.Tensor, matmul: Callable[..., torch.Tensor] | None
            ) -> torch.Tensor:
    """layer(x), through `matmul` where it takes the shapes (K % 32 == 0, N % 16 == 0)."""
    out_features, in_features = layer.weight.shape
    if matmul is not None and in_features % 32 == 0 and out_features % 16 == 0:
        return matmul(x.contiguous(), layer.weight, layer.bias)
    return layer(x)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the model's scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, blended, inv)
    elif kind == "factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        inv = inv / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind is not None:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    return inv.float()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as HF does, so bfloat16 runs stay close to the float32 ones.
        # One fused kernel instead of six elementwise ones: at decode, the per-kernel overhead
        # of small ops is a good part of the step.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q, k and v in one matmul: one weight read per token instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = project(self.qkv_proj, x, batch.matmul).view(tokens, -1, self.head_dim)
        # q and k heads rotate together: one set of elementwise kernels instead of two.
        qk = _rotate(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        k_cache.index_copy_(1, batch.write_slots, k.transpose(0, 1))
        v_cache.index_copy_(1, batch.write_slots, v.transpose(0, 1))

        out = torch.empty_like(q)
        if batch.kernel_decode is not None:
            run = batch.kernel_decode
            rows = slice(0, batch.num_decode)
            out[rows] = run.op(q[rows].contiguous(), k_cache, v_cache, run.slots, run.starts,
                               self.scale, run.max_level)
        for group in batch.decode_groups:
            rows = slice(group.start, group.end)
            out[rows] = self._decode_attention(q[rows], k[rows], v[rows], group, k_cache, v_cache)
        for span in batch.prefills:
            rows = slice(span.start, span.start + span.length)
            if span.context is None:
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:  # [heads, context, dim], straight from the head-major pool
                keys, values = span.context.take(k_cache), span.context.take(v_cache)
            if self._blocked_prefill(q) and span.plain_causal_from is not None:
                out[rows] = self._prefill_attention(q[rows], keys, values, span.plain_causal_from)
                continue
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        return project(self.o_proj, out.view(tokens, -1), batch.matmul)

    @staticmethod
    def _blocked_prefill(q: torch.Tensor) -> bool:
        # PyTorch's CPU flash-attention kernel computes bfloat16/float16 in float32 matmuls
        # (measured: the same 33 ms per layer for a 2,000-token prompt in either dtype), so on
        # CPU half precision runs our own blocked attention on the fast bfloat16 matmuls
        # (13 ms). Float32 and CUDA keep SDPA, which is as fast or faster there.
        return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)

    def _prefill_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int
    ) -> torch.Tensor:
        """Causal attention of a prefill chunk whose first query sits at position `first`.

        q: [n, H, D]; keys/values: [Hkv, first + n, D]. Queries go in blocks of 256 rows so the
        scores of a block stay in cache; a block reads only the keys up to its own last
        position (the causal upper triangle is never computed), and the query heads of one KV
        head are stacked into a single matmul instead of repeating K and V.
        """
        n = q.shape[0]
        heads, groups, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        # Scaling q once (n x H x D values) is far cheaper than scaling every score.
        q_by_head = (q * self.scale).transpose(0, 1).reshape(heads, groups, n, dim)
        out = torch.empty(heads, groups, n, dim, dtype=q.dtype, device=q.device)
        block = 256
        above_diagonal = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
        keys_t = keys.transpose(1, 2)
        for s in range(0, n, block):
            e = min(n, s + block)
            rows, end = e - s, first + e
            qb = q_by_head[:, :, s:e].reshape(heads, groups * rows, dim)
            scores = torch.bmm(qb, keys_t[:, :, :end]).view(heads, groups, rows, end)
            scores[..., end - rows :].masked_fill_(above_diagonal[:rows, :rows], float("-inf"))
            # Softmax reads bfloat16 scores and accumulates in float32 internally.
            probs = torch.softmax(scores, dim=-1).view(heads, groups * rows, end)
            out[:, :, s:e] = torch.bmm(probs, values[:, :end]).view(heads, groups, rows, dim)
        return out.view(self.num_heads, n, dim).transpose(0, 1)

    def _own_kv(
        self, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's own-part keys and values, `[heads, b * length, dim]` each."""
        kept = group.kept
        if kept is not None and group.append_at is not None:
            previous = kept[self.layer]
            assert previous is not None, "append_at without kept keys"
            keys, values = previous
            keys.index_copy_(1, group.append_at, k.transpose(0, 1))
            values.index_copy_(1, group.append_at, v.transpose(0, 1))
            return keys, values
        assert group.own is not None, "a group that keeps nothing must plan its reads"
        keys, values = group.own.take(k_cache), group.own.take(v_cache)
        if kept is not None:
            # Kept tensors are written into next step: never let them alias the pool.
            if keys.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr():
                keys, values = keys.clone(), values.clone()
            kept[self.layer] = (keys, values)
        return keys, values

    def _decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        # One query per request against its gathered context, as batched matmuls over
        # (kv head, request): on CPU this beats SDPA's flash kernel (tuned for long queries) by
        # an order of magnitude, and the head-major pool makes the gather the only large copy.
        # A prefix shared by the group is gathered and multiplied once for all of it instead of
        # once per request: with one long system prompt under every chat, that gather
        # dominated the step.
        b, length = group.end - group.start, group.length
        heads, groups, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        keys, values = self._own_kv(k, v, group, k_cache, v_cache)
        keys, values = keys.view(heads * b, length, dim), values.view(heads * b, length, dim)
        q_by_head = q.view(b, heads, groups, dim).transpose(0, 1)  # [H, b, G, D]
        own = q_by_head.reshape(heads * b, groups, dim)
        scores = torch.bmm(own, keys.transpose(1, 2)).float() * self.scale  # [H*b, G, L]
        if group.mask is not None:
            scores = scores.view(heads, b, groups, length).masked_fill(
                ~group.mask.view(1, b, 1, length), float("-inf")
            ).view(heads * b, groups, length)
        if group.shared is not None:  # [H, P, D]: a view of the pool when the prefix is a run
            shared_keys, shared_values = group.shared.take(k_cache), group.shared.take(v_cache)
            prefix = shared_keys.shape[1]
        else:
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            out = torch.bmm(probs, values).view(heads, b, groups, dim)
            return out.transpose(0, 1).reshape(b, self.num_heads, dim)
        pooled = q_by_head.reshape(heads, b * groups, dim)
        # K @ q^T rather than q @ K^T: bmm copies a transposed view of the pool (4x slower
        # in bfloat16, measured) but reads an untransposed one in place.
        shared_scores = torch.bmm(shared_keys, pooled.transpose(1, 2)).transpose(1, 2)
        shared_scores = shared_scores.float() * self.scale
        both = torch.cat(
            (shared_scores.view(heads, b, groups, prefix), scores.view(heads, b, groups, length)),
            dim=-1,
        )
        probs = torch.softmax(both, dim=-1).to(values.dtype)
        shared_probs = probs[..., :prefix].reshape(heads, b * groups, prefix)
        own_probs = probs[..., prefix:].reshape(heads * b, groups, length)
        out = torch.bmm(shared_probs, shared_values).view(heads, b, groups, dim)
        out = out + torch.bmm(own_probs, values).view(heads, b, groups, dim)
        return out.transpose(0, 1).reshape(b, self.num_heads, dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        # gate and up in one matmul, for the same reason as qkv.
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, matmul: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x, matmul).split(self.intermediate, dim=-1)
        return project(self.down_proj, F.silu(gate) * up, matmul)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; see `forward`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """Runs the batch, writing its K/V into the caches; returns float32 logits [R, vocab]."""
        x = self.embed_tokens(batch.input_ids)
        angles = batch.positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [T, 1, D]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        residual = x
        for i, layer in enumerate(self.layers):
            h = layer.self_attn(
                layer.input_layernorm(residual), cos, sin, batch, k_caches[i], v_caches[i]
            )
            residual = residual + h
            residual = residual + layer.mlp(layer.post_attention_layernorm(residual),
                                            batch.matmul)
        last = self.norm(residual[batch.logit_rows])
        return project(self.lm_head, last, batch.matmul).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Takes HF-named float tensors, fusing q/k/v and gate/up; casts to `dtype`."""
        cfg = self.config
        state: dict[str, torch.Tensor] = {
            "embed_tokens.weight": weights["model.embed_tokens.weight"],
            "norm.weight": weights["model.norm.weight"],
        }
        head = weights.get("lm_head.weight")
        state["lm_head.weight"] = head if head is not None and not cfg.tie_word_embeddings else (
            weights["model.embed_tokens.weight"]
        )
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            ours = f"layers.{i}."
            state[ours + "input_layernorm.weight"] = weights[p + "input_layernorm.weight"]
            state[ours + "post_attention_layernorm.weight"] = weights[
                p + "post_attention_layernorm.weight"
            ]
            state[ours + "self_attn.qkv_proj.weight"] = torch.cat(
                [weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            )
            if cfg.attention_bias:
                state[ours + "self_attn.qkv_proj.bias"] = torch.cat(
                    [weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]
                )
            state[ours + "self_attn.o_proj.weight"] = weights[p + "self_attn.o_proj.weight"]
            state[ours + "mlp.gate_up_proj.weight"] = torch.cat(
                [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
            )
            state[ours + "mlp.down_proj.weight"] = weights[p + "mlp.down_proj.weight"]
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if m != "inv_freq"]
        if missing or unexpected:
            raise ValueError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
        self.to(dtype)
        self.inv_freq = rope_inv_freq(cfg).to(self.embed_tokens.weight.device)
