"""Per-layer attention (`LayerAttention`: sliding window, scale, attention sinks) through every
attention backend against a plain float64 reference, layers of different windows served by one
step plan, and the kernel's rows bitwise the same decoded, prefilled in one chunk or in several
with all three set (what keeps cache on == cache off exact for Gemma 3 and gpt-oss)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from radixserve.kernels import path_names
from radixserve.layers.attention import (
    AttentionEnv,
    LayerAttention,
    LayerKV,
    SequenceSpan,
    StepAttention,
    StepLayout,
    choose_attention,
    choose_backend,
)
from radixserve.layers.attention.blocked_prefill import BlockedPrefill

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 64, 2048


@dataclass
class Table:
    """A request's slot table, as the engine's Request offers it."""

    slots: list[int]

    def slot_array(self, end: int, start: int = 0) -> np.ndarray:
        return np.asarray(self.slots[start:end], dtype=np.int32)


def _env(dtype: torch.dtype, window: int | None = None, dim: int = DIM) -> AttentionEnv:
    return AttentionEnv(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=dim, window=window,
                        num_slots=SLOTS, device=torch.device("cpu"), dtype=dtype,
                        native_bf16=False)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int],
               positions: list[int], layer: LayerAttention) -> torch.Tensor:
    """Float64 attention of rows at `positions` (q [n, H, D]) over slots[:position + 1] each,
    as HF computes it: the window keeps positions p - window < j <= p, a sink is a softmax
    column dropped after the softmax."""
    context = max(positions) + 1
    idx = torch.tensor(slots[:context])
    groups = HEADS // KV_HEADS
    keys = k[:, idx].double().repeat_interleave(groups, 0)  # [H, context, D]
    values = v[:, idx].double().repeat_interleave(groups, 0)
    scale = q.shape[-1]**-0.5 if layer.scale is None else layer.scale
    scores = torch.einsum("nhd,hcd->hnc", q.double(), keys) * scale
    cols, rows = torch.arange(context)[None, :], torch.tensor(positions)[:, None]
    allowed = cols <= rows
    if layer.window is not None:
        allowed &= cols > rows - layer.window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.double()[:, None, None].expand(HEADS, len(positions), 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :context]
    return torch.einsum("hnc,hcd->nhd", probs, values)


def _reference_step(q: torch.Tensor, cache: LayerKV, rows: list[tuple],
                    layer: LayerAttention) -> torch.Tensor:
    """_reference over a step's rows, a request's consecutive rows at once."""
    out, start = [], 0
    while start < len(rows):
        end = start
        while end < len(rows) and rows[end][0] is rows[start][0]:
            end += 1
        positions = [position for _, position in rows[start:end]]
        out.append(_reference(q[start:end], cache.k, cache.v, rows[start][0], positions, layer))
        start = end
    return torch.cat(out)


def _step(requests: list[tuple[list[int], int, int]]) -> tuple[StepLayout, list[tuple]]:
    """A step over (slot table, first position, rows) per request, decodes (one row) first.
    Returns its layout and, per row, (table, position)."""
    decodes, prefills, rows, write = [], [], [], []
    ordered = sorted(requests, key=lambda r: r[2] != 1)
    start = 0
    for slots, first, length in ordered:
        span = SequenceSpan(Table(slots), start, length, first)
        (decodes if length == 1 and not prefills else prefills).append(span)
        rows += [(slots, first + i) for i in range(length)]
        write += slots[first:first + length]
        start += length
    return StepLayout(decodes, prefills, torch.tensor(write)), rows


LAYERS = [
    None,  # the model's default: full attention here, head_dim**-0.5, no sinks
    LayerAttention(window=16),
    LayerAttention(scale=0.3),
    LayerAttention(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, -4.0])),
    LayerAttention(window=7, scale=0.2, sinks=torch.tensor([1.0, 0.2, -0.3, 4.0, 0.0, 1.5])),
    LayerAttention(window=300),  # wider than most contexts: the same as none for them
]

BACKENDS = [("kernel", "kernel"), ("torch", "sdpa"), ("kernel", "sdpa"), ("torch", "kernel"),
            ("torch", "blocked")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("decode", "prefill"), BACKENDS)
def test_every_backend_honours_each_layers_window_scale_and_sinks(dtype, decode, prefill):
    # One step: two decode rows (contexts 40 and 333), a prompt's first chunk and a later
    # chunk of another; each layer asks the same plan for its own window.
    if prefill == "blocked":  # built directly: the chooser offers it only on native-bf16 CPUs
        if dtype != torch.bfloat16:
            pytest.skip("the blocked prefill is for half precision")
        attention = StepAttention(choose_backend("decode", decode, _env(dtype)),
                                  BlockedPrefill(_env(dtype)))
    else:
        attention = choose_attention(_env(dtype), decode, prefill)
    rng = random.Random(0)
    pool = rng.sample(range(1, SLOTS), 40 + 333 + 50 + 150)
    tables = [pool[:40], pool[40:373], pool[373:423], pool[423:]]
    layout, rows = _step([(tables[0], 39, 1), (tables[1], 332, 1), (tables[2], 0, 50),
                          (tables[3], 120, 30)])
    plan = attention.plan(layout)
    gen = torch.Generator().manual_seed(1)
    tolerance = 3e-5 if dtype == torch.float32 else 3e-2
    for layer in LAYERS:
        cache = LayerKV(torch.randn(KV_HEADS, SLOTS, DIM, generator=gen).to(dtype),
                        torch.randn(KV_HEADS, SLOTS, DIM, generator=gen).to(dtype))
        q = torch.randn(len(rows), HEADS, DIM, generator=gen).to(dtype)
        k = torch.randn(len(rows), KV_HEADS, DIM, generator=gen).to(dtype)
        v = torch.randn(len(rows), KV_HEADS, DIM, generator=gen).to(dtype)
        got = attention.forward(q, k, v, cache, plan, layer)
        want = _reference_step(q, cache, rows, layer or LayerAttention())
        error = (got.double() - want).abs().max().item()
        assert error < tolerance, (layer, error)
    # Each window was planned once for the step, whatever number of layers used it.
    assert set(plan.by_window) == {None, 16, 7, 300}


# Head dims of the vector paths (64, 96, 128, 256) the engine serves: small models' and
# gpt-oss's 64, Gemma 3's 256 (test_paged_attention covers all four without a layer's
# parameters).
DIMS = [64, 256]


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", range(len(path_names("attention"))))
def test_every_kernel_path_honours_window_scale_and_sinks(dtype, path, dim):
    # The portable, AVX2 and AVX-512 paths each against the reference (a path above this
    # CPU's runs as the best it has; the AVX-512 ones also run emulated in
    # test_emulated_avx512.py).
    attention = choose_attention(_env(dtype, dim=dim), "kernel", "kernel")
    for backend in (attention.decode, attention.prefill):
        backend.max_path = path  # type: ignore[attr-defined]
    slots = random.Random(6).sample(range(1, SLOTS), 200)
    layout, rows = _step([(slots, 150, 1), (slots[:120], 90, 30)])
    gen = torch.Generator().manual_seed(path)
    cache = LayerKV(torch.randn(KV_HEADS, SLOTS, dim, generator=gen).to(dtype),
                    torch.randn(KV_HEADS, SLOTS, dim, generator=gen).to(dtype))
    q, k, v = (torch.randn(31, h, dim, generator=gen).to(dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    for layer in LAYERS[3:5]:
        got = attention.forward(q, k, v, cache, attention.plan(layout), layer)
        want = _reference_step(q, cache, rows, layer)
        tolerance = 3e-5 if dtype == torch.float32 else 3e-2
        assert (got.double() - want).abs().max().item() < tolerance, layer


def test_a_mistake_in_window_scale_or_sinks_shows():
    # The reference above is not blind to the parameters: dropping any one changes the
    # result well past the tolerance.
    attention = choose_attention(_env(torch.float32), "kernel", "kernel")
    slots = list(range(1, 101))
    layout, rows = _step([(slots, 60, 40)])
    plan = attention.plan(layout)
    gen = torch.Generator().manual_seed(2)
    cache = LayerKV(torch.randn(KV_HEADS, SLOTS, DIM, generator=gen),
                    torch.randn(KV_HEADS, SLOTS, DIM, generator=gen))
    q, k, v = (torch.randn(40, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    full = LAYERS[4]
    got = attention.forward(q, k, v, cache, plan, full)
    for wrong in (LayerAttention(scale=full.scale, sinks=full.sinks),
                  LayerAttention(window=full.window, sinks=full.sinks),
                  LayerAttention(window=full.window, scale=full.scale)):
        other = attention.forward(q, k, v, cache, plan, wrong)
        assert (got - other).abs().max().item() > 1e-2, wrong


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", range(len(path_names("attention"))))
def test_kernel_rows_are_bitwise_the_same_decoded_or_prefilled_in_any_chunks(dtype, path, dim):
    # A 120-token prompt with a 16-token window, a scale and sinks: one chunk, three chunks
    # and one row at a time (each beside another request's decode row) give the same bits, on
    # every vector path (a path above this CPU's runs as the best it has), and match the
    # float64 reference.
    layer = LAYERS[4]
    attention = choose_attention(_env(dtype, dim=dim), "kernel", "kernel")
    for backend in (attention.decode, attention.prefill):
        backend.max_path = path  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(3)
    cache = LayerKV(torch.randn(KV_HEADS, SLOTS, dim, generator=gen).to(dtype),
                    torch.randn(KV_HEADS, SLOTS, dim, generator=gen).to(dtype))
    prompt = random.Random(4).sample(range(1, 1000), 120)
    other = list(range(1000, 1300))
    q = torch.randn(120, HEADS, dim, generator=gen).to(dtype)
    q_other = torch.randn(1, HEADS, dim, generator=gen).to(dtype)

    def run(parts: list[tuple[int, int]]) -> torch.Tensor:
        outs = []
        for first, length in parts:
            requests = [(prompt, first, length)] + ([(other, 299, 1)] if length == 1 else [])
            layout, rows = _step(requests)
            mine = [i for i, (slots, _) in enumerate(rows) if slots is prompt]
            queries = torch.cat([q[position:position + 1] if slots is prompt else q_other
                                 for slots, position in rows])
            # K/V are already in the pool: write them again, unchanged.
            write = layout.write_slots
            k, v = cache.k[:, write].transpose(0, 1), cache.v[:, write].transpose(0, 1)
            out = attention.forward(queries, k.contiguous(), v.contiguous(), cache,
                                    attention.plan(layout), layer)
            outs.append(out[mine])
        return torch.cat(outs)

    whole = run([(0, 120)])
    want = _reference(q, cache.k, cache.v, prompt, list(range(120)), layer)
    tolerance = 3e-5 if dtype == torch.float32 else 3e-2
    assert (whole.double() - want).abs().max().item() < tolerance
    assert torch.equal(run([(0, 17), (17, 64), (81, 39)]), whole)
    assert torch.equal(run([(0, 100)] + [(i, 1) for i in range(100, 120)]), whole)


def test_layer_attention_refuses_what_cannot_be_meant():
    with pytest.raises(ValueError, match="window"):
        LayerAttention(window=0)
    with pytest.raises(ValueError, match="scale"):
        LayerAttention(scale=-1.0)
    with pytest.raises(ValueError, match="num_heads"):
        LayerAttention(sinks=torch.zeros(2, 3))
    sinks = torch.tensor([1, 2], dtype=torch.bfloat16)
    assert LayerAttention(sinks=sinks).sinks.dtype == torch.float32  # held as the kernel reads


def test_the_model_default_window_still_applies_without_a_layer_attention():
    # Mistral's global sliding window comes from the env: a layer passing nothing gets it.
    attention: StepAttention = choose_attention(_env(torch.float32, window=8), "kernel",
                                                "kernel")
    slots = list(range(1, 41))
    layout, rows = _step([(slots, 0, 40)])
    plan = attention.plan(layout)
    gen = torch.Generator().manual_seed(5)
    cache = LayerKV(torch.randn(KV_HEADS, SLOTS, DIM, generator=gen),
                    torch.randn(KV_HEADS, SLOTS, DIM, generator=gen))
    q, k, v = (torch.randn(40, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    got = attention.forward(q, k, v, cache, plan)
    assert torch.equal(got, attention.forward(q, k, v, cache, plan, LayerAttention(window=8)))
    want = _reference_step(q, cache, rows, LayerAttention(window=8))
    assert (got.double() - want).abs().max().item() < 3e-5


def test_a_windowed_chunk_reads_only_the_keys_its_rows_can_see():
    # A 400-token chunk after 1,500 cached tokens, in a 512-token window's layer: its first
    # row sees positions 989..1,500, so 911 keys are read and scored, not 1,900.
    backend = choose_backend("prefill", "sdpa", _env(torch.float32))
    span = SequenceSpan(Table(list(range(SLOTS))), 0, 400, 1500)
    (windowed,) = backend.plan([span], 512)
    assert windowed.mask is not None and windowed.mask.shape == (400, 911)
    assert windowed.mask[0].sum() == 512 and windowed.mask[0, 0] and windowed.mask[-1, -1]
    (full,) = backend.plan([span], None)  # a global layer reads the whole context
    assert full.mask is not None and full.mask.shape == (400, 1900)
