"""The kernels' vector paths by family ("attention", "gguf", "float_panels"), as the library
names and ranks them (csrc/common/cpu_features.cpp): a call's `max_path` is an index into its family's
names, 0 (portable C++) everywhere, and this CPU runs up to `best_path`.
"""

from __future__ import annotations

import functools

import torch

from radixserve.kernels.build import load_library


@functools.cache
def path_names(family: str) -> tuple[str, ...]:
    """The family's paths in max_path order; ("portable",) where the library cannot be built."""
    if not load_library():
        return ("portable",)
    return tuple(torch.ops.radixserve.kernel_path_names(family))


@functools.cache
def best_path(family: str) -> int:
    """The highest path of the family this CPU runs (an index of `path_names(family)`)."""
    return torch.ops.radixserve.kernel_best_path(family) if load_library() else 0


@functools.cache
def cpu_features() -> frozenset[str]:
    """What the library's one probe found (/proc/cpuinfo's names; AMX only where usable)."""
    return frozenset(torch.ops.radixserve.cpu_feature_names()) if load_library() else frozenset()
