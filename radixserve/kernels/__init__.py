"""C++ kernels for the CPU, compiled on first use with the machine's own compiler: attention
over the paged pool for decode and prefill rows (decode_attention.cpp), a decoder layer's
small ops in one call each (layer_ops.cpp), bfloat16 matmuls of a few rows
(skinny_matmul.cpp), float32 matmuls on 16-bit weights for CPUs without bfloat16 dot products
(skinny_float.cpp), matmuls with GGUF-quantized weights (gguf_pack.cpp, gguf_matmul*.cpp) and
a model's decoder layers run by one call of those kernels (decoder_stack.cpp), in one library.
Packed weights live on 2 MB pages where Linux gives them (huge_pages.cpp).

Each has a PyTorch fallback: when no compiler (or ninja) is at hand the loader returns None,
logs why once, and the engine keeps its PyTorch paths. The build lands under the radixserve
home (`$RADIXSERVE_HOME/kernels`), keyed by the sources, torch version and flags, so it
happens once per machine; later processes load the library directly.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.model.default_model import cache_home

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name)
            for name in ("decode_attention.cpp", "skinny_matmul.cpp", "gguf_pack.cpp",
                         "gguf_matmul.cpp", "gguf_matmul_avx2.cpp", "gguf_matmul_avx512.cpp",
                         "gguf_matmul_amx.cpp",
                         "skinny_float.cpp", "layer_ops.cpp", "decoder_stack.cpp",
                         "huge_pages.cpp")]
_HEADERS = [Path(__file__).with_name(name)
            for name in ("vector.h", "gguf_blocks.h", "skinny_float_paths.h",
                         "decode_attention_avx512.h", "decode_attention_amx.h", "amx.h",
                         "skinny_matmul_avx512bf16.h", "huge_pages.h")]


ATTENTION_PATHS = ("portable", "avx2", "avx512", "avx512-bf16", "avx512-amx")  # paged_attention's max_path


def paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.radixserve.paged_attention`, built if needed; None where it cannot be.

    Signature: (q [R, H, D], k_cache [Hkv, S, D], v_cache, slots int32 [N], begins int64 [R],
    lengths int64 [R], scale, max_path) -> [R, H, D]: row r attends to slots[begins[r] :
    begins[r] + lengths[r]]; decode and prefill rows alike, a row's result bitwise the same
    whatever else is in the call. See decode_attention.cpp; `attention_path()` says which
    vector path (an index of ATTENTION_PATHS) this CPU runs.
    """
    return torch.ops.radixserve.paged_attention if _library() else None


def attention_path() -> int:
    """The best vector path of paged_attention on this CPU (an index of ATTENTION_PATHS); 0
    where the kernels cannot be built."""
    return torch.ops.radixserve.attention_path() if _library() else 0


def attention_path_for(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                       max_path: int) -> int:
    """The path paged_attention runs at for this pool dtype and attention shape, capped at
    `max_path` (an index of ATTENTION_PATHS): not every path takes every shape."""
    if not _library():
        return 0
    return torch.ops.radixserve.attention_path_for(
        dtype == torch.bfloat16, num_heads // num_kv_heads, head_dim, max_path)


def skinny_matmul_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.radixserve.skinny_matmul` where the CPU has AVX512-BF16, else None.

    Signature: (x [M <= SKINNY_MAX_ROWS, K], weight [N, K], bias [N] or None) -> [M, N], all
    bfloat16, K a multiple of 32 and N of 16; see skinny_matmul.cpp.
    """
    if not _library() or torch.ops.radixserve.decode_attention_level() < 2:
        return None
    return torch.ops.radixserve.skinny_matmul


class LayerOps:
    """A decoder layer's small ops (layer_ops.cpp), each one call instead of the half-dozen
    PyTorch kernels it is made of: at decode their dispatch, not their arithmetic, is the cost.
    CPU tensors, float32 or bfloat16 computed in float32."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's LlamaRMSNorm of x [M, H] (contiguous) with weight [H] in x's dtype."""
        return torch.ops.radixserve.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + d, RMSNorm of it) for x and d [M, H] (contiguous): a residual add and the norm
        after it, in one call; the sum rounded to the dtype as PyTorch's add rounds it."""
        return torch.ops.radixserve.add_rms_norm(x, d, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """F.silu(gate) * up of gate_up [M, 2I] (gate first), the same bits, in one call."""
        return torch.ops.radixserve.silu_mul(gate_up)

    def rotary_embedding_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          heads: int) -> None:
        """Rotates heads [0, heads) of qkv [T, all heads, D] (contiguous) in place, "rotate
        half" style; cos and sin are float32 [T, D / 2]."""
        torch.ops.radixserve.rotary_embedding_(qkv, cos, sin, heads)


def decoder_stack(heads: int, kv_heads: int, head_dim: int, eps: float,
                  scale: float) -> torch.ScriptObject | None:
    """An empty `torch.classes.radixserve.DecoderStack` (decoder_stack.cpp), None where the
    kernels cannot be built: a model's decoder layers run by one call, `forward(x, cos, sin,
    k_caches, v_caches, write_slots, slots, begins, lengths, attention_path, output_rows)`
    (output_rows: the rows whose last-layer output it returns, None for all), after
    `add_projection` (qkv, o, gate_up, down) and `add_norms` for each layer."""
    if not _library():
        return None
    return torch.classes.radixserve.DecoderStack(heads, kv_heads, head_dim, eps, scale)


@functools.cache
def layer_ops() -> LayerOps | None:
    """The layer ops, built if needed; None where they cannot be."""
    return LayerOps() if _library() else None


def token_bitmask_op() -> Callable[..., None] | None:
    """`torch.ops.radixserve.apply_token_bitmask_` (layer_ops.cpp), None where the kernels
    cannot be built. Signature: (logits float32 [R, vocab], masks int32 [M, words], rows int64
    [M]) -> None: row rows[m] keeps only the tokens whose bit is set in mask m."""
    return torch.ops.radixserve.apply_token_bitmask_ if _library() else None


def argmax_op() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`torch.ops.radixserve.argmax_rows` (layer_ops.cpp), None where the kernels cannot be
    built: torch.argmax(logits, -1) of float32 [R, V] (the same indices, NaN first as torch),
    in one pass a row."""
    return torch.ops.radixserve.argmax_rows if _library() else None


@functools.cache  # looked up by every layer of every step
def kv_write_op() -> Callable[..., None] | None:
    """`torch.ops.radixserve.write_kv_` (layer_ops.cpp), None where the kernels cannot be
    built: (k_cache, v_cache [Hkv, S, D] contiguous, slots int64 [T], k, v [T, Hkv, D] in the
    caches' dtype, last dim contiguous) -> None, caches[h, slots[t]] = rows[t, h]."""
    return torch.ops.radixserve.write_kv_ if _library() else None


FLOAT_PATHS = ("portable", "avx2", "avx512")  # skinny_float_linear's paths, by max_path


class SkinnyFloatOps:
    """The float matmul of skinny_float.cpp: a weight packed once into panels of 16 output rows,
    k-major, in bfloat16, float16 or float32, multiplied in float32 arithmetic by x of any
    number of rows. Each output is one chain of FMAs over k, so a row's result is bitwise the
    same whatever the batch, thread count or path; `max_path` caps the path (an index of
    FLOAT_PATHS) so tests can run each one.
    """

    PANEL = 16  # output rows per panel

    def path(self) -> int:
        """The best path this CPU runs (an index of FLOAT_PATHS)."""
        return torch.ops.radixserve.skinny_float_path()

    def path_name(self, max_path: int | None = None) -> str:
        """The path `linear` takes on this CPU when capped at `max_path`."""
        best = self.path()
        return FLOAT_PATHS[best if max_path is None else min(max_path, best)]

    def pack(self, weight: torch.Tensor, dtype: torch.dtype,
             arena: PanelArena | None = None) -> torch.Tensor:
        """Panels [ceil(N / 16), K, 16] in `dtype` of a weight [N, K]: panel p holds rows
        16p..16p+15 k-major, rows past N are zero. On 2 MB pages (huge_pages.h), as a slice of
        the arena's buffers where one is given: a decode step streams the panels."""
        rows, cols = weight.shape
        count = -(-rows // self.PANEL)
        padded = weight.to(dtype)
        if rows % self.PANEL:
            padded = torch.cat([padded, padded.new_zeros(count * self.PANEL - rows, cols)])
        shape = [count, cols, self.PANEL]
        if arena is None:
            panels = empty_on_huge_pages(shape, dtype)
        else:
            size = count * cols * self.PANEL * padded.element_size()
            panels = arena.take(size).view(dtype).view(shape)
        return panels.copy_(padded.reshape(count, self.PANEL, cols).transpose(1, 2))

    def linear(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
               max_path: int) -> torch.Tensor:
        """x [M, K] float32 contiguous @ W^T + bias (float32 [n] or None) -> float32 [M, n], W
        the [n, K] weight `pack` made `panels` of."""
        return torch.ops.radixserve.skinny_float_linear(x, panels, n, bias, max_path)


@functools.cache
def skinny_float_ops() -> SkinnyFloatOps | None:
    """The float matmul kernel, built if needed; None where it cannot be."""
    return SkinnyFloatOps() if _library() else None


# The GGUF kernels' paths, by max_path.
QUANT_PATHS = ("portable", "avx2", "avx512-vnni", "avx512-amx")


class GGUFOps:
    """The GGUF kernels (gguf_pack.cpp, gguf_matmul*.cpp): weights kept as the file's blocks,
    repacked into 16-row panels, multiplied with int8-quantized activations.

    Types: Q8_0 (8), Q4_0 (2), Q4_1 (3), Q4_K (12), Q6_K (14). A row's result is bitwise the
    same whatever the batch, thread count or path; `max_path` caps the path (an index of
    QUANT_PATHS) so tests can run each one.
    """

    def path(self) -> int:
        """The best path this CPU runs (an index of QUANT_PATHS)."""
        return torch.ops.radixserve.gguf_quant_path()

    def path_name(self, max_path: int | None = None) -> str:
        """The path gguf_linear takes on this CPU when capped at `max_path`."""
        best = self.path()
        return QUANT_PATHS[best if max_path is None else min(max_path, best)]

    def pack(self, raw: torch.Tensor, ggml_type: int, row_order: torch.Tensor | None = None,
             arena: PanelArena | None = None) -> torch.Tensor:
        """Panels uint8 [ceil(N / 16), K / block * panel block bytes] of a GGUF tensor's blocks
        raw uint8 [N, row_bytes]; panel row n takes raw row row_order[n] where given. About the
        file's bytes (Q4_K: 1.03x); see gguf_blocks.h. With an arena, the panels are a slice of
        its buffers; else a buffer of their own."""
        if arena is None or raw.dim() != 2:  # (the op refuses a bad raw)
            return torch.ops.radixserve.gguf_pack(raw, ggml_type, row_order)
        rows, row_bytes = raw.shape
        out = arena.take(torch.ops.radixserve.gguf_packed_bytes(ggml_type, rows, row_bytes))
        torch.ops.radixserve.gguf_pack_into(raw, ggml_type, row_order, out)
        return out.view(-(-rows // 16), -1)

    def dequantize_rows(self, panels: torch.Tensor, ggml_type: int, n_rows: int, k: int,
                        ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of the packed [n_rows, k] weight, [T, k] in `dtype`: bitwise
        gguf.quants.dequantize's values, then cast."""
        return torch.ops.radixserve.gguf_dequantize_rows(panels, ggml_type, n_rows, k, ids, dtype)

    def linear(self, x: torch.Tensor, panels: torch.Tensor | list[torch.Tensor],
               ggml_types: int | list[int], rows: int | list[int], bias: torch.Tensor | None,
               max_path: int) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16, contiguous) @ W^T + bias -> [M, sum(rows)] in x's
        dtype. W is one part (panels, type, rows) or a list of parts side by side, such as a
        fused qkv whose parts differ in type: x is quantized once and nothing is concatenated."""
        if isinstance(panels, torch.Tensor):
            panels, ggml_types, rows = [panels], [ggml_types], [rows]
        return torch.ops.radixserve.gguf_linear(x, panels, ggml_types, rows, bias, max_path)


class PanelArena:
    """A model's small packed weights side by side in buffers of 2 MB pages (huge_pages.h): a
    weight under 4 MB gets no huge page of its own (SmolLM2-135M's are all under 1 MB, a 1B
    model's k and v 1.1 MB), and side by side they share them, in the order the layers are
    prepared. A weight of 4 MB or more gets a buffer of its own. One that does not fit the
    current buffer starts the next; the rest of the old one is never touched, so it holds at
    most the huge page its last weight ends in."""

    SMALL_BYTES = 4 << 20  # below this a weight shares a buffer

    def __init__(self, buffer_bytes: int = 32 << 20) -> None:
        self.buffer_bytes = buffer_bytes
        self._buffer: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 [nbytes] slice, contiguous, 64-byte aligned."""
        if nbytes >= self.SMALL_BYTES:
            return empty_on_huge_pages([nbytes], torch.uint8)
        if self._buffer is None or self._used + nbytes > self._buffer.numel():
            self._buffer = empty_on_huge_pages([max(self.buffer_bytes, nbytes)], torch.uint8)
            self._used = 0
        out = self._buffer[self._used:self._used + nbytes]
        self._used += -(-nbytes // 64) * 64  # the next weight starts on a cache line
        return out


def empty_on_huge_pages(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on 2 MB pages where the kernels' library is built and Linux
    gives them (huge_pages.cpp); torch.empty's otherwise."""
    if not _library():
        return torch.empty(shape, dtype=dtype)
    return torch.ops.radixserve.empty_on_huge_pages(shape, dtype)


@functools.cache
def gguf_ops() -> GGUFOps | None:
    """The GGUF kernels, built if needed; None where they cannot be."""
    return GGUFOps() if _library() else None


SKINNY_MAX_ROWS = 48  # measured faster than oneDNN up to here, even at 64 (bench_skinny_matmul)


@functools.cache
def _library() -> bool:
    """Loads the kernels' library, building it first if this machine has none; False (and one
    warning) where it cannot be built."""
    try:
        # at::parallel_for is inline OpenMP: without -fopenmp it would run on one thread. The
        # library links libgomp.so.1, which resolves to the copy torch already loaded.
        flags = ["-O3", "-fopenmp"]
        digest = hashlib.sha256(torch.__version__.encode() + " ".join(flags).encode())
        for source in _SOURCES + _HEADERS:
            digest.update(source.read_bytes())
        tag = digest.hexdigest()[:12]
        library = cache_home() / "kernels" / f"kernels-{tag}.so"
        if library.exists() or not _build(library, tag, flags):
            torch.ops.load_library(str(library))
        return True
    except Exception as error:  # no compiler, no ninja, headers missing: keep PyTorch's path
        log.warning("C++ kernels unavailable (%s); using the PyTorch path",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False


def _build(library: Path, tag: str, flags: list[str]) -> bool:
    """Compiles the kernels in a private folder, publishes the library with one rename and
    loads it (True); False where another process built it meanwhile (not loaded).

    Concurrent first uses (test workers, server processes) take turns on a file lock: one
    builds, the others wait and then find the library. The lock is an flock, which the
    kernel drops when its holder dies, so a killed build never blocks the next one.
    """
    from torch.utils import cpp_extension

    # torch runs `ninja` from PATH; the one pip installed beside this interpreter counts even
    # when the virtual environment was never activated.
    scripts = sysconfig.get_path("scripts")
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [os.environ.get("PATH"), scripts]))
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built while we waited
            return False
        log.info("building the C++ kernels (first use here, about a minute on 2 cores)")
        name = f"radixserve_kernels_{tag}"
        with tempfile.TemporaryDirectory(dir=library.parent, prefix="build-") as build:
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in _SOURCES],
                build_directory=build,
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            os.replace(Path(build) / f"{name}.so", library)
    return True
