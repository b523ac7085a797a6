"""Rotary position embeddings: the inverse frequencies of a `RopeConfig` with its scaling
(linear, Llama 3.1, Phi-3's LongRoPE, GGUF's per-frequency factors), and the scale LongRoPE
puts on cos and sin. Made once when a model is built; a step turns them into angles.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.model.config import RopeConfig

SCALINGS = ("linear", "llama3", "longrope", "yarn", "factors")


@dataclass(frozen=True)
class RopeTable:
    """A rotary embedding as a step uses it: angles = position * inv_freq, and cos and sin
    multiplied by `magnitude` (LongRoPE's attention factor; 1 otherwise)."""

    inv_freq: torch.Tensor  # float32 [rotary_dim / 2], on the CPU
    magnitude: float = 1.0


def rotary_identity(tables: Sequence[RopeTable]) -> str:
    """A digest of rotary tables (each one's per-frequency angles and magnitude), as an engine
    computes them for its context length: the disk tier's fingerprint names it."""
    digest = hashlib.blake2b(digest_size=16)
    for table in tables:
        digest.update(table.inv_freq.double().numpy().tobytes())
        digest.update(struct.pack("<d", table.magnitude))
    return digest.hexdigest()


def rope_table(rope: RopeConfig, rotary_dim: int, max_context: int) -> RopeTable:
    """The table of `rope` over `rotary_dim` dimensions for contexts up to `max_context`
    tokens. LongRoPE picks its long factors when `max_context` exceeds the pretraining length
    (llama.cpp's rule: the choice is fixed per engine, so a cached prefix's keys never change
    rotation; transformers switches per forward call, by the longest sequence in it).

    Computed on the CPU whatever the default device (on the meta device, where a model is
    built before its weights load, arange goes through torch._refs, which import
    torch._dynamo, slowing every start)."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (rope.theta ** (steps / rotary_dim))
    scaling = rope.scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    magnitude = 1.0
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    elif kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if max_context > original else "short_factor"]
        inv = inv / torch.tensor(factors, dtype=torch.float64, device="cpu")
        magnitude = _longrope_magnitude(scaling)
    elif kind == "yarn":
        inv, magnitude = _yarn(rope.theta, rotary_dim, scaling)
    elif kind == "factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        inv = inv / torch.tensor(scaling["factors"], dtype=torch.float64, device="cpu")
        magnitude = scaling.get("attention_factor", 1.0)
    elif kind is not None:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: "
                         f"{', '.join(SCALINGS[:4])})")
    if inv.numel() != rotary_dim // 2:
        raise ValueError(f"rope scaling gives {inv.numel()} frequencies for {rotary_dim} "
                         "rotary dimensions")
    return RopeTable(inv.float(), magnitude)


def _llama3(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    inv = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, blended, inv)


def _longrope_magnitude(scaling: dict) -> float:
    """LongRoPE's attention factor: given, or from the context's growth over pretraining."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor") or 1.0
    original = scaling["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


def _yarn(theta: float, dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss; Qwen3 past its native context), as transformers computes it: each
    frequency blended between itself (fast rotations, beyond `beta_fast` turns over the
    original context) and itself / `factor` (slow ones, under `beta_slow` turns), linearly in
    between; cos and sin scaled by 0.1 ln(factor) + 1 unless an attention factor is given.
    `truncate` (default true) rounds the blend's ends outward to whole dimensions; gpt-oss's
    config turns it off."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(turns: float) -> float:  # where a frequency makes `turns` over `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low)
            / ((high - low) or 0.001)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    inv = (1 / (factor * base)) * ramp + (1 / base) * (1 - ramp)
    magnitude = scaling.get("attention_factor")
    if magnitude is None:
        magnitude = _yarn_mscale(factor, scaling.get("mscale") or 1)
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            magnitude /= _yarn_mscale(factor, scaling["mscale_all_dim"])
    return inv, float(magnitude)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
