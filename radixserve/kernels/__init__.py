"""C++ kernels for the CPU, compiled on first use with the machine's own compiler.

Each has a PyTorch fallback: when no compiler (or ninja) is at hand the loader returns None,
logs why once, and the engine keeps its PyTorch paths. The build lands under the radixserve
home (`$RADIXSERVE_HOME/kernels`), keyed by the source, torch version and flags, so it
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

_SOURCE = Path(__file__).with_name("decode_attention.cpp")


@functools.cache
def decode_attention_op() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.radixserve.decode_attention`, built if needed; None where it cannot be.

    Signature: (q [B, H, D], k_cache [Hkv, S, D], v_cache, slots int32 [N],
    starts int64 [B + 1], scale, max_level) -> [B, H, D]; see decode_attention.cpp.
    `torch.ops.radixserve.decode_attention_level()` says which vector path this CPU runs.
    """
    try:
        # at::parallel_for is inline OpenMP: without -fopenmp it would run on one thread. The
        # library links libgomp.so.1, which resolves to the copy torch already loaded.
        flags = ["-O3", "-fopenmp"]
        tag = hashlib.sha256(
            _SOURCE.read_bytes() + torch.__version__.encode() + " ".join(flags).encode()
        ).hexdigest()[:12]
        library = cache_home() / "kernels" / f"decode_attention-{tag}.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(library, tag, flags)  # also loads it
        return torch.ops.radixserve.decode_attention
    except Exception as error:  # no compiler, no ninja, headers missing: keep PyTorch's path
        log.warning("decode attention kernel unavailable (%s); using the PyTorch path",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None


def _build(library: Path, tag: str, flags: list[str]) -> None:
    """Compiles the kernel in a private folder and publishes the library with one rename.

    Concurrent first uses (test workers, server processes) each build their own copy and the
    last rename wins; none waits on a lock that a killed build could leave behind.
    """
    from torch.utils import cpp_extension

    # torch runs `ninja` from PATH; the one pip installed beside this interpreter counts even
    # when the virtual environment was never activated.
    scripts = sysconfig.get_path("scripts")
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [os.environ.get("PATH"), scripts]))
    log.info("building the decode-attention kernel (first use here, about 10 s)")
    library.parent.mkdir(parents=True, exist_ok=True)
    name = f"radixserve_decode_attention_{tag}"
    with tempfile.TemporaryDirectory(dir=library.parent, prefix="build-") as build:
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            build_directory=build,
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        os.replace(Path(build) / f"{name}.so", library)
