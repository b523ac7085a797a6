"""The server's own counters from its Prometheus `/metrics`, read before and after a run.

Names are matched without their namespace (`radixserve:`, `vllm:`, `sglang:`), and summed
over label sets, so any server using vLLM's names is read the same way. A counter exported
under two namespaces (radixserve's `--metrics-compat vllm` twins) is read from the first.
"""

from __future__ import annotations

import re

import httpx

# Counters worth a before/after difference; all in tokens except preemptions and requests.
COUNTERS = (
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions_total",
)

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS found in a Prometheus text exposition, each summed over its labels."""
    found: dict[str, float] = {}
    namespace_of: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        namespace, _, name = match.group(1).rpartition(":")
        if name not in COUNTERS or namespace_of.setdefault(name, namespace) != namespace:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        found[name] = found.get(name, 0.0) + value
    return found


async def scrape(client: httpx.AsyncClient, root_url: str) -> dict[str, float] | None:
    """The counters now, or None when the server has no Prometheus endpoint."""
    try:
        response = await client.get(root_url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_counters(response.text)


def counter_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {name: after[name] - before.get(name, 0.0) for name in after}
