"""The per-request preamble strip on the OpenAI chat route: proxies that turn Claude Code's
Anthropic requests into chat completions put its billing header at the head of the system
message; it goes before the body is read, as on the Anthropic route (`anthropic.prompt`).
"""

from __future__ import annotations

import json

from radixserve.provider_caching.preambles import strip_preambles
from radixserve.server.context import ServerContext


def strip_chat_preamble(ctx: ServerContext, raw: bytes) -> bytes:
    """`raw` without a known preamble in its leading system message (counted in the metrics);
    a body that is not a JSON object is returned as is, for the parser to refuse."""
    if not ctx.settings.preambles:
        return raw
    try:
        data = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(data, dict):
        return raw
    data, stripped = strip_preambles(data, "openai", ctx.settings.preambles)
    for preamble in stripped:
        tokens = len(ctx.tokenizer.encode(preamble.text, add_special_tokens=False))
        ctx.metrics.preamble_stripped(preamble.name, tokens)
    return json.dumps(data, ensure_ascii=False).encode() if stripped else raw
