"""OpenAI-compatible routes: POST /v1/chat/completions (`chat`), POST /v1/completions
(`completions`), the Responses API under /v1/responses (`responses`), GET /v1/models.

Usage is engine truth by default: `prompt_tokens_details.cached_tokens` is exactly the prompt
tokens the prefix cache supplied (as llama.cpp, and vLLM with --enable-prompt-tokens-details,
report it), not rounded to OpenAI's 128-token steps, and 0 (never omitted) when nothing was
reused; --cache-accounting vendor reports OpenAI's rules instead (`accounting`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from radixserve.server.auth import authenticate
from radixserve.server.context import ServerContext, context_of
from radixserve.server.openai.chat import create_chat_completion
from radixserve.server.openai.completions import create_completion
from radixserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.openai.responses import build_responses_router
from radixserve.server.transport import request_body_doc


def build_openai_router() -> APIRouter:
    router = APIRouter(dependencies=[Depends(_authenticate)], tags=["openai"])
    router.add_api_route("/v1/models", list_models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    router.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"],
                         openapi_extra=request_body_doc(ChatCompletionRequest))
    router.add_api_route("/v1/completions", create_completion, methods=["POST"],
                         openapi_extra=request_body_doc(CompletionRequest))
    router.include_router(build_responses_router())
    return router


async def _authenticate(request: Request) -> None:
    request.state.api_key = authenticate(request, context_of(request).settings)


# ----- models -----


def _model_card(ctx: ServerContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": ctx.created,
            "owned_by": ctx.settings.owned_by, "max_model_len": ctx.max_model_len}


async def list_models(request: Request) -> dict[str, Any]:
    ctx = context_of(request)
    return {"object": "list",
            "data": [_model_card(ctx, name) for name in ctx.settings.served_model_names]}


async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    ctx = context_of(request)
    return _model_card(ctx, ctx.check_model(model_id))
