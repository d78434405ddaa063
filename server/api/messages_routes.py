"""`POST /v1/messages`: Anthropic's Messages API as a face of the chat path.

Blocks become chat messages (server/api/translate.py, by protocol/translation.py's rules), the
one path samples them (server/sampling/completions.py), and the choice comes back as content blocks
(thinking where the parser found reasoning, text, tool_use) with Anthropic's stop reasons.
Beside Anthropic's fields the message carries `prompt_token_ids`, `token_ids`, `logprobs` (one
number per token id) and `sampling`, as a chat choice does; a stream sends Anthropic's events,
with those in `message_start` and `message_delta`.

Anthropic's clients authenticate with `x-api-key` (server/api/auth.py takes it), and expect
`{"type": "error", ...}` bodies, which server/api/errors.py gives on these paths. Under
`/v1/sessions/{id}/` (and `/v1/sessions/{id}/v1/messages`, where Anthropic's SDK goes when its
base URL is the session's) every exchange is also recorded for the session.
`POST /v1/messages/count_tokens` gives the prompt's length as the same request would render it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server.api import translate
from server.api.auth import require_api_key
from server.api.deps import SessionId, State, open_session
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.api.messages_schemas import CountTokensRequest, MessagesRequest
from server.sampling import completions
from server.sampling.streaming import Completion
from server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


@router.post("/v1/messages", responses=documented(404, 409))
async def create_message(body: MessagesRequest, request: Request, state: State):
    return await _message(body, request, state, None)


@router.post("/v1/sessions/{session_id}/messages", responses=documented(403, 404, 409, 429))
@router.post("/v1/sessions/{session_id}/v1/messages", include_in_schema=False)
async def create_message_in_session(session_id: SessionId, body: MessagesRequest, request: Request, state: State):
    return await _message(body, request, state, open_session(state, session_id, request))


@router.post("/v1/messages/count_tokens", responses=documented(404))
@router.post("/v1/sessions/{session_id}/messages/count_tokens", include_in_schema=False)
@router.post("/v1/sessions/{session_id}/v1/messages/count_tokens", include_in_schema=False)
async def count_tokens(body: CountTokensRequest, request: Request, state: State) -> dict[str, int]:
    """The prompt's length as /v1/messages would render it (Claude Code asks, to know when to
    compact its context); under a session nothing is recorded."""
    chat = translate.messages_chat(body, answered=False)
    return {"input_tokens": len(await completions.prompt_ids(state, chat, require_api_key(request)))}


async def _message(body: MessagesRequest, request: Request, state: ServerState, record: completions.Recorder | None):
    chat = translate.messages_chat(body)
    c = await completions.start(state, chat, require_api_key(request), record)
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        return StreamingResponse(_events(state, c, request, msg_id, body), media_type="text/event-stream")
    [choice] = await completions.finish(state, c, request.is_disconnected)
    prompt_tokens, completion_tokens = completions.usage(c)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": body.model,
            "content": translate.anthropic_content(choice), **_stop(state, c, choice),
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            "prompt_token_ids": c.prompt_ids, **_training_fields(choice)}


def _stop(state: ServerState, c: Completion, choice: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's stop reason, and the stop sequence that ended the turn, if one did."""
    seq, matched = c.gen.sequences[0], None
    if seq.stop_text_end is not None:
        text = state.host.chat.text(seq.token_ids)
        matched = next((s for s in c.stops if text.startswith(s, seq.stop_text_end)), None)
    return {"stop_reason": translate.stop_reason(choice["finish_reason"], matched), "stop_sequence": matched}


def _training_fields(choice: dict[str, Any]) -> dict[str, Any]:
    # One logprob per token id, a plain list: what ART 0.5.23 reads from a Messages answer (its
    # stream capture drops an exchange whose `logprobs` is anything else).
    out = {"token_ids": choice["token_ids"], "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
           "sampling": choice["sampling"]}
    if choice.get("malformed_tool_call"):
        out["malformed_tool_call"] = True
    return out


_EMPTY = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(state: ServerState, c: Completion, request: Request, msg_id: str,
                  body: MessagesRequest) -> AsyncIterator[str]:
    """Anthropic's stream: thinking and text blocks as they decode (a block stops when the next
    starts), tool_use blocks whole at the end, then message_delta with the stop reason."""
    yield _sse("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": body.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(c.prompt_ids), "output_tokens": 0},
        "prompt_token_ids": c.prompt_ids}})
    blocks: list[str] = []  # kinds of the blocks started, in order

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        out = [_sse("content_block_stop", {"index": len(blocks) - 1})] if blocks else []
        blocks.append(kind)
        return out + [_sse("content_block_start", {"index": len(blocks) - 1, "content_block": block})]

    async for chunk in completions.stream(state, c, request.is_disconnected):
        if "error" in chunk:
            # overloaded_error: the type Anthropic's clients treat as passing (a replica lost)
            kind = "overloaded_error" if chunk["error"]["code"] == "replica_lost" else "api_error"
            yield _sse("error", {"type": "error", "error": {"type": kind, "message": chunk["error"]["message"]}})
            return
        delta = chunk["choices"][0]["delta"]
        for kind, key in (("thinking", "reasoning_content"), ("text", "content")):
            text = delta.get(key)
            if not text or (kind == "thinking" and "text" in blocks):
                continue
            if kind not in blocks:
                for e in start(kind, _EMPTY[kind]):
                    yield e
            yield _sse("content_block_delta", {"index": blocks.index(kind), "delta": {"type": f"{kind}_delta", kind: text}})
    choice = c.choices.get(0)
    if choice is None:  # the client went away
        return
    content = translate.anthropic_content(choice)
    if "text" not in blocks and any(b["type"] == "text" for b in content):
        for e in start("text", _EMPTY["text"]):
            yield e
    for block in content:
        if block["type"] != "tool_use":
            continue
        for e in start("tool_use", {**block, "input": {}}):
            yield e
        yield _sse("content_block_delta", {"index": len(blocks) - 1, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
    if blocks:
        yield _sse("content_block_stop", {"index": len(blocks) - 1})
    yield _sse("message_delta", {"delta": _stop(state, c, choice),
                                 "usage": {"output_tokens": len(choice["token_ids"])}, **_training_fields(choice)})
    yield _sse("message_stop", {})
