"""Errors as values with an HTTP status, rendered in OpenAI's shape by default:
`{"error": {"message", "type", "param", "code"}}`, which the official SDKs map to exception classes.

Installed handlers turn bad input, unknown routes and bugs into that shape (never a bare 500
page). Another API mounted on the same app (Anthropic) registers its own renderer for its paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# OpenAI's error `type` by status; its 401s are invalid_request_error with code invalid_api_key.
_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error response: raise it anywhere in a route; the app renders it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def render_openai(error: APIError) -> Response:
    return JSONResponse(error.openai_body(), status_code=error.status, headers=error.headers)


ErrorRenderer = Callable[[APIError], Response]


def register_error_renderer(app: FastAPI, path_prefix: str, renderer: ErrorRenderer) -> None:
    """Errors on paths under `path_prefix` are rendered by `renderer` (longest prefix wins)."""
    renderers: list[tuple[str, ErrorRenderer]] = app.state.error_renderers
    renderers.append((path_prefix, renderer))
    renderers.sort(key=lambda item: -len(item[0]))


def _render(request: Request, error: APIError) -> Response:
    for prefix, renderer in request.app.state.error_renderers:
        if request.url.path.startswith(prefix):
            return renderer(error)
    return render_openai(error)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    return f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}", param


def install_error_handlers(app: FastAPI) -> None:
    app.state.error_renderers = []

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI answers 422 by default; OpenAI clients expect 400 for a malformed request.
        message, param = _validation_message(exc)
        return _render(request, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return _render(request, APIError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _render(request, APIError(500, "The server had an error while processing your "
                                              "request; it has been logged.", type="server_error"))
