"""`GET /v1/models`, `GET /v1/models/{model}` and `POST /v1/chat/completions`, OpenAI-compatible.

The request goes the one path every face shares (server/sampling/completions.py) and is answered with
choices that carry what training needs (server/sampling/choices.py); the response carries
`prompt_token_ids`. Under `/v1/sessions/{id}/` (and `/v1/sessions/{id}/v1/`, for a session base URL
given with the `/v1` an OpenAI base URL usually ends in) the same routes record every exchange for
the session (server/harness/sessions.py).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server.api.auth import CallerDep, require_api_key
from server.api.deps import SessionId, State, open_session
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.sampling import completions
from server.sampling.chat_request import ChatCompletionRequest
from server.sampling.engine_requests import check_served, served_names
from server.sampling.streaming import stream_chunks
from server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


def _card(name: str, state: ServerState) -> dict[str, Any]:
    """A model as OpenAI's and vLLM's clients read it, and as Anthropic's do (`type`, `display_name`,
    `created_at`, `max_input_tokens`: Claude Code sizes its context by them): one route serves both."""
    now, window = time.time(), state.host.context_window
    return {"id": name, "object": "model", "created": int(now), "owned_by": "artisan", "max_model_len": window,
            "type": "model", "display_name": name, "max_input_tokens": window, "max_tokens": window,
            "created_at": datetime.fromtimestamp(int(now), timezone.utc).isoformat().replace("+00:00", "Z")}


@router.get("/v1/models")
async def list_models(state: State, who: CallerDep) -> dict[str, Any]:
    cards = [_card(name, state) for name in served_names(state, who)]
    ends = {"first_id": cards[0]["id"], "last_id": cards[-1]["id"]} if cards else {"first_id": None, "last_id": None}
    return {"object": "list", "data": cards, "has_more": False, **ends}  # has_more, first_id, last_id: Anthropic's


@router.get("/v1/models/{model:path}", responses=documented(404, 409))
async def retrieve_model(model: str, state: State, who: CallerDep) -> dict[str, Any]:
    """Any name chat would sample from (`run@step` too), resolved as chat resolves it."""
    await check_served(state, model, who)
    return _card(model, state)


@router.get("/v1/sessions/{session_id}/models")
@router.get("/v1/sessions/{session_id}/v1/models", include_in_schema=False)
async def list_models_in_session(session_id: SessionId, state: State, who: CallerDep) -> dict[str, Any]:
    return await list_models(state, who)


@router.post("/v1/chat/completions", responses=documented(404, 409))
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    return await _chat(body, request, state, None)


@router.post("/v1/sessions/{session_id}/chat/completions", responses=documented(403, 404, 409, 429))
@router.post("/v1/sessions/{session_id}/v1/chat/completions", include_in_schema=False)
async def chat_completions_in_session(session_id: SessionId, body: ChatCompletionRequest, request: Request,
                                      state: State):
    return await _chat(body, request, state, open_session(state, session_id, request))


async def _chat(body: ChatCompletionRequest, request: Request, state: ServerState,
                record: completions.Recorder | None):
    c = await completions.start(state, body, require_api_key(request), record)
    if body.stream:
        return StreamingResponse(stream_chunks(state.host, c, request.is_disconnected), media_type="text/event-stream")
    choices = await completions.finish(state, c, request.is_disconnected)
    prompt_tokens, completion_tokens = completions.usage(c)
    return {
        "id": c.id, "object": "chat.completion", "created": c.created, "model": body.model, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "prompt_token_ids": c.prompt_ids,
    }
