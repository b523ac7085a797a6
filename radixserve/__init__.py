"""radixserve: an LLM serving engine built around prompt caching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.llm import LLM
    from radixserve.outputs import CompletionOutput, RequestOutput
    from radixserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# Imported on first use: the linter and the pytest plugin need no torch, which takes seconds.
_EXPORTS = {
    "LLM": "radixserve.llm",
    "SamplingParams": "radixserve.sampling_params",
    "RequestOutput": "radixserve.outputs",
    "CompletionOutput": "radixserve.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
