"""GET /v1/cache/stats: the cache dashboard's data (the README's "Cache statistics endpoint"
documents every field). Authenticated like the API; with --isolate-tenants a key sees only its
own namespace in `tenants`, `tree` and `recent`: the other figures hold no prompt text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from radixserve.cache.base import Namespace, TreeSummary
from radixserve.engine.async_engine import EngineDeadError
from radixserve.engine.engine import LLMEngine
from radixserve.engine.speculative.stats import SpeculationCounters
from radixserve.provider_caching import profile_for_model
from radixserve.server.auth import CacheNamespace, authenticate, cache_namespace
from radixserve.server.context import ServerContext, context_of
from radixserve.server.errors import APIError, bad_request
from radixserve.server.observability.cache_stats import (
    WINDOWS,
    CacheStatsBook,
    Tally,
    namespace_label,
)
from radixserve.server.observability.metrics import EngineSnapshot, take_snapshot

# The tree view's caps: nodes shown, and nodes looked at to choose them (about 1 us each on
# the engine thread; see benchmarks/bench_dashboard.py).
TREE_NODES_SHOWN = 64
TREE_NODES_VISITED = 2048

TenantFilter = Callable[[CacheNamespace], bool]


def install_cache_stats(app: FastAPI, ctx: ServerContext) -> CacheStatsBook:
    """Books every job the app serves and mounts the route; the app's lifespan runs the
    book's pool sampler (`CacheStatsBook.sampling`)."""
    book = CacheStatsBook()
    ctx.service.on_job_end = book.record
    app.state.cache_stats = book
    app.add_api_route("/v1/cache/stats", cache_stats, methods=["GET"], tags=["ops"])
    return book


async def cache_stats(request: Request, window: str = "5m") -> dict[str, Any]:
    """The cache's state and history: series over `window` (5m: 1 s buckets, 1h: 60 s)."""
    ctx = context_of(request)
    api_key = authenticate(request, ctx.settings)
    if window not in WINDOWS:
        raise bad_request(f"window must be one of {', '.join(WINDOWS)}", param="window")
    book: CacheStatsBook = request.app.state.cache_stats
    mine = _tenant_filter(ctx, api_key)
    snapshot, tree, speculative = await _engine_view(ctx, mine)
    now = book.clock()
    pool = snapshot.pool
    money = book.money
    return {
        "now": now, "model": ctx.settings.model_name, "uptime_s": now - book.started_at,
        "window": window,
        "totals": {**_tally(book.totals), "computed_prompt_tokens": snapshot.computed_prompt_tokens,
                   "kv_tier_hits": snapshot.kv_tier_hits},
        "series": _series(book, window, now),
        "pool": {"total": pool.total, "free": pool.free, "evictable": pool.evictable,
                 "protected": pool.protected, "pinned": pool.pinned, "private": pool.private},
        "cost": {"profile": ", ".join(sorted(money.profiles)) or _default_profile(ctx),
                 "with_cache_usd": money.with_cache_usd,
                 "without_cache_usd": money.without_cache_usd, "saved_usd": money.saved_usd,
                 "saved_usd_per_hour": book.saved_usd_per_hour()},
        "tenants": [{"namespace": namespace_label(ns), **_tally(tally),
                     "tokens_saved": tally.cached_tokens}
                    for ns, tally in sorted(book.tenants.items(),
                                            key=lambda item: -item[1].prompt_tokens)
                    if mine is None or mine(ns)],
        "speculation": _speculation(speculative, snapshot.speculation),
        "tree": _tree(ctx, tree),
        "recent": [{"id": r.request_id, "api": r.api, "at": r.at, "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens, "ttft_s": r.ttft_s, "cost_usd": r.cost_usd,
                    "miss_at": r.miss_at, "miss_text": _text(ctx, r.miss_token_ids),
                    "notes": list(r.notes),
                    "namespace": namespace_label(r.namespace)}
                   for r in reversed(book.recent) if mine is None or mine(r.namespace)],
    }


def _tenant_filter(ctx: ServerContext, api_key: str | None) -> TenantFilter | None:
    """With isolated tenants, the namespaces of the caller's key (any cache_salt); else None."""
    if not ctx.settings.isolate_tenants or api_key is None:
        return None
    own = cache_namespace(ctx.settings, api_key, None)
    assert isinstance(own, tuple)
    return lambda ns: isinstance(ns, tuple) and ns[:2] == own[:2]


def _request_namespace(namespace: Namespace) -> CacheNamespace:
    # The engine files a request under (model, its namespace) (LLMEngine.add_request).
    return namespace[1] if isinstance(namespace, tuple) and len(namespace) == 2 else namespace


async def _engine_view(
    ctx: ServerContext, mine: TenantFilter | None
) -> tuple[EngineSnapshot, TreeSummary, str]:
    """The engine's snapshot, its tree summary and its speculation mode (`--speculative`)."""
    visible = None if mine is None else (lambda ns: mine(_request_namespace(ns)))

    def view(engine: LLMEngine) -> tuple[EngineSnapshot, TreeSummary, str]:
        tree = engine.cache.top_prefixes(TREE_NODES_SHOWN, TREE_NODES_VISITED, visible)
        return take_snapshot(engine), tree, engine.config.speculative

    if ctx.replicas is not None:
        # The tree and the pool series are one engine's; the ingress has no per-replica channel
        # for them yet. /metrics carries every replica's figures, labelled by replica.
        raise APIError(501, "/v1/cache/stats describes one engine; behind --replicas, read "
                       "/metrics (each replica's figures, labelled replica).",
                       type="not_implemented", code="not_available_with_replicas")
    if not ctx.aengine.alive:
        raise _engine_stopped()
    # Shielded: a cancelled engine call would break the engine thread (see serving._pump).
    call = asyncio.ensure_future(ctx.aengine.run(view))
    try:
        return await asyncio.shield(call)
    except EngineDeadError:
        raise _engine_stopped() from None


def _engine_stopped() -> APIError:
    return APIError(503, "The engine has stopped; there are no cache statistics.",
                    code="engine_stopped")


def _tally(tally: Tally) -> dict[str, Any]:
    return {"requests": tally.requests, "prompt_tokens": tally.prompt_tokens,
            "cached_tokens": tally.cached_tokens, "hit_rate": tally.hit_rate or 0.0}


def _series(book: CacheStatsBook, window: str, now: float) -> dict[str, Any]:
    series = book.series[window]
    points = series.points(now)
    buckets = [b for _, b in points]
    pools = [b.pool if b is not None else None for b in buckets]
    return {
        "interval_s": series.interval_s,
        "t": [t for t, _ in points],
        "requests": [b.requests if b else 0 for b in buckets],
        "prompt_tokens": [b.prompt_tokens if b else 0 for b in buckets],
        "cached_tokens": [b.cached_tokens if b else 0 for b in buckets],
        "hit_rate": [b.hit_rate if b else None for b in buckets],
        "ttft_p50_s": [b.percentile(0.50) if b else None for b in buckets],
        "ttft_p99_s": [b.percentile(0.99) if b else None for b in buckets],
        "pool": {state: [getattr(p, state) if p else None for p in pools]
                 for state in ("free", "evictable", "protected", "pinned", "private")},
    }


def _speculation(mode: str, counters: SpeculationCounters) -> dict[str, Any]:
    """Draft-and-verify since start (requests may speculate by `extra_body` whatever `mode`)."""
    return {"mode": mode, "drafts": counters.drafts, "draft_tokens": counters.draft_tokens,
            "accepted_tokens": counters.accepted_tokens,
            "acceptance_rate": counters.acceptance_rate,
            "mean_acceptance_length": counters.mean_acceptance_length,
            "steps": counters.steps, "speculative_steps": counters.speculative_steps}


def _tree(ctx: ServerContext, tree: TreeSummary) -> dict[str, Any]:
    roots: list[dict[str, Any]] = []
    by_id: dict[int, dict[str, Any]] = {}
    for node in tree.prefixes:  # best-first: a parent always comes before its children
        entry = by_id[node.node_id] = {
            "id": f"n{node.node_id}", "text": _text(ctx, node.first_token_ids),
            "tokens": node.tokens, "depth": node.depth, "hits": node.hits,
            "served_tokens": node.served_tokens, "last_used_s_ago": node.last_used_s_ago,
            "locks": node.locks, "pinned_for_s": node.pinned_for_s,
            "namespace": namespace_label(_request_namespace(node.namespace)), "children": []}
        siblings = roots if node.parent_id is None else by_id[node.parent_id]["children"]
        siblings.append(entry)
    return {"nodes": tree.nodes, "shown": len(tree.prefixes), "truncated": tree.truncated,
            "roots": roots}


def _text(ctx: ServerContext, token_ids: tuple[int, ...]) -> str:
    return ctx.tokenizer.decode(list(token_ids), skip_special_tokens=False) if token_ids else ""


def _default_profile(ctx: ServerContext) -> str:
    """Before anything is billed: the profile the served model's OpenAI requests price at."""
    return profile_for_model(ctx.settings.model_name, "openai").name
