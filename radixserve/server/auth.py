"""API keys: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic).

The key a request authenticated with is also its tenant when tenants are isolated.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from radixserve.server.errors import APIError
from radixserve.server.settings import ServerSettings

# A request's prefix-cache namespace: None (shared), the client's cache_salt, or with isolated
# tenants ("tenant", hash of its API key, cache_salt).
CacheNamespace = str | tuple[str, str, str | None] | None


def presented_key(request: Request) -> str | None:
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def authenticate(request: Request, settings: ServerSettings) -> str | None:
    """The request's valid API key (None when the server has none); 401 otherwise."""
    if not settings.api_keys:
        return None
    key = presented_key(request)
    if key is None:
        raise APIError(401, "No API key provided. Send it as 'Authorization: Bearer KEY'.",
                       code="invalid_api_key")
    # Compare against every key, in constant time, so timing reveals nothing about them.
    matches = [hmac.compare_digest(key.encode(), k.encode()) for k in settings.api_keys]
    if not any(matches):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return key


def cache_namespace(settings: ServerSettings, api_key: str | None, cache_salt: str | None) -> CacheNamespace:
    """The prefix-cache namespace of a request.

    With isolated tenants the key decides it whatever the client sends (its cache_salt only
    splits its own space further), so no tenant can time another's prompts. The key is hashed
    so the raw secret is not kept in the cache's structures.
    """
    if settings.isolate_tenants and api_key is not None:
        return ("tenant", hashlib.sha256(api_key.encode()).hexdigest()[:32], cache_salt)
    return cache_salt
