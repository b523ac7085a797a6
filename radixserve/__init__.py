"""radixserve: an LLM serving engine built around prompt caching."""

from radixserve.llm import LLM
from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
