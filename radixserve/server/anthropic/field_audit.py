"""What an agent client's Messages request asks for that this server does not act on, said in
a response header rather than silently dropped: the fields and `anthropic-beta` values Claude
Code and the Agent SDK send by default, each either acted on or listed here.

Acted on: context_management (context_editing), cache_control and its 1h TTL, count_tokens,
output_config.format (structured output), service_tier (one tier: standard). Listed when sent:
thinking and output_config.effort on a model without a reasoning mode (THINKING_HEADER),
metadata (nothing here reads the user id), other output_config keys, every beta value outside
ACTED_BETAS, and any top-level field this server does not know (the SDKs pass new ones
through, so they are said rather than refused). Refused with a 400: the vendor's server-side
tool features (REFUSED_FIELDS), which a request cannot do without.
"""

from __future__ import annotations

from radixserve.server.anthropic.protocol import MessagesRequest
from radixserve.server.errors import bad_request

# Betas whose features this server implements (a beta for a feature it refuses in the body,
# such as mid-conversation tool changes, is listed as not applied: the body says the rest).
ACTED_BETAS = frozenset({
    "context-management-2025-06-27",
    "prompt-caching-2024-07-31",
    "extended-cache-ttl-2025-04-11",
    "token-counting-2024-11-01",
    "structured-outputs-2025-11-13",
})
SERVICE_TIERS = ("auto", "standard_only")  # both are served at the one tier there is
_OUTPUT_CONFIG_ACTED = ("format", "effort")  # effort: THINKING_HEADER reports it
# Features run on the vendor's side (MCP servers it connects to, its code-execution container):
# nothing here can run them, and the answer would silently lack what they return.
REFUSED_FIELDS = ("mcp_servers", "container")


def thinking_asked(body: MessagesRequest) -> bool:
    """Extended thinking or a reasoning effort was asked for (this model has neither)."""
    return (body.thinking or {}).get("type") in ("enabled", "adaptive") or \
        "effort" in (body.output_config or {})


def not_applied(body: MessagesRequest, beta_header: str | None) -> list[str]:
    """The request's fields and betas this server accepts without acting on them (in the
    order the header lists them); 400 for a service_tier the vendor does not define."""
    if body.service_tier is not None and body.service_tier not in SERVICE_TIERS:
        raise bad_request(f"service_tier: expected one of {', '.join(SERVICE_TIERS)}",
                          "service_tier")
    extra = body.model_extra or {}
    for name in REFUSED_FIELDS:
        if extra.get(name):
            raise bad_request(f"{name} is not supported by this server: it runs no "
                              "server-side tools (MCP connectors, code execution); give the "
                              "model client tools instead.", name)
    items = []
    if body.metadata:
        items.append("metadata")
    items += [f"output_config.{key}" for key in (body.output_config or {})
              if key not in _OUTPUT_CONFIG_ACTED]
    betas = [b.strip() for b in (beta_header or "").split(",") if b.strip()]
    items += [f"anthropic-beta={b}" for b in dict.fromkeys(betas) if b not in ACTED_BETAS]
    items += sorted(name for name, value in extra.items() if value is not None)
    return items
