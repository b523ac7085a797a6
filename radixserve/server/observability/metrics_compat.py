"""vLLM's metric names beside ours (`--metrics-compat vllm`), for tools that read only `vllm:`
names: aiperf, vLLM's Grafana boards. A second view of the same registry: at scrape time each
family vLLM has a counterpart for is re-emitted under vLLM's name, so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

VLLM_PREFIX = "vllm:"

# Our family (without our prefix) -> vLLM's names for it, as vLLM 0.11's V1 engine exports them
# (vllm/v1/metrics/loggers.py). Ours already follow vLLM's names and counting rules; the second
# names are the deprecated ones that vLLM's example Grafana board still plots. Left out, for want
# of a counterpart: the queue/prefill/decode time histograms, the per-request token-count
# histograms, iteration_tokens_total, cache_config_info, and external_prefix_cache_* (a KV
# connector's hits; our disk tier counts loads, not queries).
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",
                                    "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}

# vLLM labels every sample with the engine's index (data-parallel ranks); we run one engine.
_ENGINE_LABEL = {"engine": "0"}


class VllmView(Collector):
    """`source`'s families, each followed by its `vllm:` twins (same samples, vLLM's names,
    vLLM's labels: model_name, engine, and finished_reason on request_success). `prefix` is
    our names' prefix."""

    def __init__(self, source: Collector, prefix: str) -> None:
        self.source = source
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield family
            if family.name.startswith(self.prefix):
                yield from vllm_twins(family, family.name.removeprefix(self.prefix))


def vllm_twins(family: Metric, ours: str) -> Iterator[Metric]:
    """The `vllm:` copies of `family` (named `ours` without its prefix); none when vLLM has
    no counterpart."""
    for name in VLLM_NAMES.get(ours, ()):
        twin = Metric(VLLM_PREFIX + name, family.documentation, family.type)
        for sample in family.samples:
            suffix = sample.name.removeprefix(family.name)  # _total, _bucket, _sum, ...
            twin.samples.append(Sample(twin.name + suffix, {**sample.labels, **_ENGINE_LABEL},
                                       sample.value, sample.timestamp, sample.exemplar,
                                       sample.native_histogram))
        yield twin
