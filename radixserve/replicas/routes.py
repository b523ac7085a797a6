"""The routes only an ingress over replicas has: GET /v1/replicas (who serves, and the router's
cost) and POST /v1/replicas/match (how much of a prompt each replica holds). The server's app
knows nothing of replicas; `launch` adds these to it."""

from __future__ import annotations

from typing import Any


def add_replica_routes(app: Any, directory: Any, front: Any) -> None:
    app.add_api_route("/v1/replicas", _replicas_route(directory, front), methods=["GET"],
                      tags=["ops"])
    app.add_api_route("/v1/replicas/match", _match_route(directory, front), methods=["POST"],
                      tags=["ops"])


def _replicas_route(directory: Any, front: Any) -> Any:
    from fastapi import Request

    from radixserve.server.auth import authenticate
    from radixserve.server.context import context_of

    async def replicas(request: Request) -> dict[str, Any]:
        """The replicas behind this ingress: their KV-event endpoints (for an external router),
        process ids, queues as last reported, and the router's own cost. Authenticated like
        the API: it names internal addresses."""
        authenticate(request, context_of(request).settings)
        routed, seconds = directory.route_cost()
        return {
            "replicas": directory.describe(),
            "router": {"requests": routed,
                       "mean_ms": seconds * 1e3 / routed if routed else 0.0,
                       "retried_requests": front.retries},
        }

    replicas.__annotations__["request"] = Request  # see _match_route
    return replicas


def _match_route(directory: Any, front: Any) -> Any:
    from fastapi import Request
    from pydantic import BaseModel, ValidationError

    from radixserve.kv_events import block_hashes
    from radixserve.server.auth import authenticate, cache_namespace
    from radixserve.server.context import context_of
    from radixserve.server.errors import APIError, bad_request

    class MatchRequest(BaseModel):
        prompt: str | list[int]
        cache_salt: str | None = None

    async def match(request: Request) -> dict[str, Any]:
        """How many leading tokens of a prompt each replica holds, as the router's index
        knows it from their KV events (body: `prompt`, text or token ids, completions-style,
        and `cache_salt`; the namespace is the one a request with this key and salt gets)."""
        ctx = context_of(request)
        try:
            body = MatchRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise bad_request(f"invalid body: {exc.errors()[0]['msg']}") from None
        namespace = cache_namespace(ctx.settings, authenticate(request, ctx.settings),
                                    body.cache_salt)
        ids = front.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        router = directory.router()
        if router is None or not hasattr(router, "held_tokens"):
            raise APIError(501, "only the prefix router keeps an index of what replicas hold",
                           type="not_implemented", code="no_prefix_index")
        size = front.facts.block_size
        held = router.held_tokens(block_hashes(ids, namespace, size), size)
        return {"prompt_tokens": len(ids), "block_size": size, "replicas": held}

    # This module's annotations are strings (postponed), and Request is imported here, not at
    # module level (`radixserve --help` stays fast): give FastAPI the class itself.
    match.__annotations__["request"] = Request
    return match
