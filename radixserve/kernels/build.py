"""Compiles the kernels' C++ sources into one library on first use and loads it.

The build lands under the radixserve home (`$RADIXSERVE_HOME/kernels`), keyed by the sources,
torch version and flags, so it happens once per machine; later processes load the library
directly. Where no compiler (or ninja) is at hand, `load_library` says False and logs why once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sysconfig
import tempfile
from pathlib import Path

import torch

from radixserve.home import cache_home

log = logging.getLogger(__name__)

# The sources, a folder per kernel family (csrc/<family>/, its portable, avx2, avx512 and amx
# files named alike) and csrc/common/ for what they share; includes are relative to csrc/.
CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*/*.cpp"))
HEADERS = sorted(CSRC.glob("*/*.h"))


@functools.cache
def load_library() -> bool:
    """Loads the kernels' library, building it first if this machine has none; False (and one
    warning) where it cannot be built."""
    try:
        # at::parallel_for is inline OpenMP: without -fopenmp it would run on one thread. The
        # library links libgomp.so.1, which resolves to the copy torch already loaded.
        flags = ["-O3", "-fopenmp"]
        digest = hashlib.sha256(torch.__version__.encode() + " ".join(flags).encode())
        for source in SOURCES + HEADERS:
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
                sources=[str(source) for source in SOURCES],
                build_directory=build,
                extra_cflags=flags,
                extra_include_paths=[str(CSRC)],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            os.replace(Path(build) / f"{name}.so", library)
    return True
