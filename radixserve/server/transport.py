"""HTTP plumbing every route needs: size-capped JSON bodies validated into request models (400
and 413 in the API's error shape, never FastAPI's 422), SSE framing, and running a handler only
while its client is still connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from radixserve.server.errors import APIError, bad_request

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
# Union members appear in pydantic's error locations ("prompt.list[int].0"); a client's
# parameter path has none of them.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


# Names what a request asked for that the server accepted without acting on (both APIs).
NOT_APPLIED_HEADER = "x-radixserve-not-applied"


class StrictModel(BaseModel):
    """A request body, OpenAI's or Anthropic's. Strict: a string where a number belongs is a
    400, as with the vendors. Unknown fields are accepted and ignored, because the SDKs pass new
    fields through and a strict server would break them."""

    model_config = ConfigDict(strict=True, extra="allow")


def request_body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body the route parses itself (the app adds the schema to the components)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event; `event` names it (Anthropic's SDK dispatches on that line)."""
    line = b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    return (f"event: {event}\n".encode() if event else b"") + line + b"\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) more than `limit` bytes before reading them all."""
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc
             if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    return ".".join(parts) or None


def parse_body(raw: bytes, model: type[ModelT]) -> ModelT:
    """Validates a JSON body into `model`; every failure is a 400 naming the parameter."""
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            raise bad_request(f"The request body is not valid JSON ({reason}).") from None
        if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
            raise bad_request("The request body must be a JSON object.") from None
        param = _param(tuple(first["loc"]))
        message = f"{param}: {first['msg']}" if param else first["msg"]
        raise bad_request(message, param) from None


async def _disconnected(request: Request) -> None:
    # The body is read already, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Runs `work` unless the client leaves first; then cancels it (aborting its engine work).

    Returns (True, result), or (False, None) when the client left.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return True, task.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task  # let its cleanup run before the handler returns
    return False, None
