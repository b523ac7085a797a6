"""C++ kernels for the CPU, compiled on first use with the machine's own compiler: decode
attention over the paged pool (decode_attention.cpp), bfloat16 matmuls of a few rows
(skinny_matmul.cpp) and matmuls with GGUF-quantized weights (gguf_pack.cpp, gguf_matmul*.cpp),
in one library.

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
                         "gguf_matmul.cpp", "gguf_matmul_avx2.cpp", "gguf_matmul_avx512.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("vector.h", "gguf_blocks.h")]


def decode_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.radixserve.decode_attention`, built if needed; None where it cannot be.

    Signature: (q [B, H, D], k_cache [Hkv, S, D], v_cache, slots int32 [N],
    starts int64 [B + 1], scale, max_level) -> [B, H, D]; see decode_attention.cpp.
    `torch.ops.radixserve.decode_attention_level()` says which vector path this CPU runs.
    """
    return torch.ops.radixserve.decode_attention if _library() else None


def skinny_matmul_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.radixserve.skinny_matmul` where the CPU has AVX512-BF16, else None.

    Signature: (x [M <= SKINNY_MAX_ROWS, K], weight [N, K], bias [N] or None) -> [M, N], all
    bfloat16, K a multiple of 32 and N of 16; see skinny_matmul.cpp.
    """
    if not _library() or torch.ops.radixserve.decode_attention_level() < 2:
        return None
    return torch.ops.radixserve.skinny_matmul


QUANT_PATHS = ("portable", "avx2", "avx512-vnni")  # the GGUF kernels' paths, by max_path


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

    def pack(self, raw: torch.Tensor, ggml_type: int,
             row_order: torch.Tensor | None = None) -> torch.Tensor:
        """Panels uint8 [ceil(N / 16), K / block * panel block bytes] of a GGUF tensor's blocks
        raw uint8 [N, row_bytes]; panel row n takes raw row row_order[n] where given. About the
        file's bytes (Q4_K: 1.03x); see gguf_blocks.h."""
        return torch.ops.radixserve.gguf_pack(raw, ggml_type, row_order)

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
