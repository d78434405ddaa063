"""`GET /v1/models` and `POST /v1/chat/completions`, OpenAI-compatible.

A request resolves its `model` to a policy (base, run or run@step), renders its prompt through
the model's chat template (splicing earlier sampled turns in as their exact ids), samples on the
engine while holding a lease on its policy, and answers with choices that carry what training
needs (server/api/chat_choices.py). The response carries `prompt_token_ids`.

A request with `tools` to a model whose template cannot show them is refused (unless the operator
passed --allow-unrendered-tools): the model would answer without ever seeing the tools, and an
agent trained that way cannot learn to call them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server.api.auth import require_api_key
from server.api.chat_choices import build_choice, sampling_info
from server.api.deps import ServerState, State
from server.api.engine_requests import check_params, resolve_policy, room, submit, wait_finished
from server.api.errors import APIError
from server.api.limits import GuardedRoute
from server.api.schemas import ChatCompletionRequest
from server.api.streaming import Completion, stream_chunks
from server.chat.render import RenderedPrompt
from server.chat.template import TemplateError
from server.chat.validate import RenderError, validate_messages
from server.engine.constraints import ConstraintError, constraint_for
from server.engine.sampling import SamplingParams

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute)


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    now = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": now, "owned_by": "artisan",
         "max_model_len": state.host.context_window} for name in state.served.names()]}


def unrendered_tools_message(model: str) -> str:
    return (f"model {model}: its chat template does not render tools, so the model would never see them; "
            f"restart art-server with --chat-template FILE (a template that renders tools), "
            f"or with --allow-unrendered-tools to accept them unseen")


def _prompt(state: ServerState, body: ChatCompletionRequest) -> RenderedPrompt:
    try:
        validate_messages(body.messages)
    except RenderError as e:
        raise APIError(400, str(e), param="messages", code="invalid_messages")
    vocab = state.host.vocab_size
    for i, m in enumerate(body.messages):
        ids = m.get("token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids)):
            raise APIError(400, f"messages[{i}].token_ids must be token ids below {vocab}", param=f"messages[{i}].token_ids")
    if body.tools and not state.host.chat.template.renders_tools and not state.settings.allow_unrendered_tools:
        raise APIError(400, unrendered_tools_message(state.host.name), param="tools", code="tools_not_rendered")
    try:
        return state.host.chat.turns.prompt(body.messages, body.tool_dicts(), body.chat_template_kwargs)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages", code="invalid_messages")


def _sampling_params(state: ServerState, body: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
    left = room(state, prompt_len, "messages")
    budget = body.token_budget()
    # A budget past the window is clamped, not refused: the choice then ends with "length".
    max_tokens = min(budget, left) if budget else left
    try:
        constraint = constraint_for(state.host.chat, body.response_format, body.tool_choice, body.tools,
                                    body.parallel_tool_calls)
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param, code="unsupported_constraint")
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, stop=body.stop,
                            seed=body.seed, top_logprobs=body.top_logprobs or 0, ignore_eos=body.ignore_eos,
                            constraint=constraint)
    check_params(state, params)
    return params


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    policy = await resolve_policy(state, body.model)
    prompt = _prompt(state, body)
    params = _sampling_params(state, body, len(prompt.ids))
    gen, events = submit(state, policy, prompt.ids, params, body.n, body.stream)
    c = Completion(gen, events, "chatcmpl-" + uuid.uuid4().hex, int(time.time()), body.model, prompt.ids,
                   sampling_info(state.host, policy, params, prompt.ids, body.chat_template_kwargs),
                   body.tools_enabled, body.stop, bool((body.stream_options or {}).get("include_usage")))
    if body.stream:
        return StreamingResponse(stream_chunks(state.host, c, request.is_disconnected, lambda: state.served.release(policy)),
                                 media_type="text/event-stream")
    try:
        await wait_finished(gen, events, request)
    finally:
        state.served.release(policy)
    completion_tokens = sum(len(s.token_ids) for s in gen.sequences)
    return {
        "id": c.id, "object": "chat.completion", "created": c.created, "model": body.model,
        "choices": [build_choice(state.host, s, c.sampling, c.tools_enabled) for s in gen.sequences],
        "usage": {"prompt_tokens": len(prompt.ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt.ids) + completion_tokens},
        "prompt_token_ids": prompt.ids,
    }

