"""C++ kernels for the CPU, compiled on first use with the machine's own compiler: decode
attention over the paged pool (decode_attention.cpp) and bfloat16 matmuls of a few rows
(skinny_matmul.cpp), in one library.

Each has a PyTorch fallback: when no compiler (or ninja) is at hand the loader returns None,
logs why once, and the engine keeps its PyTorch paths. The build lands under the radixserve
home (`$RADIXSERVE_HOME/kernels`), keyed by the sources, torch version and flags, so it
happens once per machine; later processes load the library directly.
"""

from __future__ import annotations

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
            for name in ("decode_attention.cpp", "skinny_matmul.cpp")]
_HEADERS = [Path(__file__).with_name("vector.h")]


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
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(library, tag, flags)  # also loads it
        return True
    except Exception as error:  # no compiler, no ninja, headers missing: keep PyTorch's path
        log.warning("C++ kernels unavailable (%s); using the PyTorch path",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False


def _build(library: Path, tag: str, flags: list[str]) -> None:
    """Compiles the kernels in a private folder and publishes the library with one rename.

    Concurrent first uses (test workers, server processes) each build their own copy and the
    last rename wins; none waits on a lock that a killed build could leave behind.
    """
    from torch.utils import cpp_extension

    # torch runs `ninja` from PATH; the one pip installed beside this interpreter counts even
    # when the virtual environment was never activated.
    scripts = sysconfig.get_path("scripts")
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [os.environ.get("PATH"), scripts]))
    log.info("building the C++ kernels (first use here, about 15 s)")
    library.parent.mkdir(parents=True, exist_ok=True)
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
