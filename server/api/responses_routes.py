"""`POST /v1/responses`: OpenAI's Responses API as a face of the chat path.

Input items become chat messages (server/api/translate.py, by protocol/translation.py's rules),
the one path samples them (server/sampling/completions.py), and the choice comes back as output
items: reasoning where the parser found it, the message, one function_call per call. Beside
OpenAI's fields the response carries what training needs: `prompt_token_ids`, `token_ids`,
`logprobs` and `sampling`, as a chat choice does; with `include: ["message.output_text.logprobs"]`
the message's text also carries the logprobs of its own tokens, as OpenAI gives them. A stream
sends Responses' events; `response.completed` holds all of that.

A response is kept (server/harness/responses.py) unless `store` is false: for `previous_response_id`,
and for `GET` and `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`, as OpenAI's.
Under `/v1/sessions/{id}/` (or `/v1/sessions/{id}/v1/`) every exchange is also recorded for the
session (server/harness/sessions.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse
from openai.types.responses import ResponseIncludable

from server.api import translate
from server.api.auth import caller, require_api_key
from server.api.deps import SessionId, State, open_session
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.api.responses_schemas import TEXT_LOGPROBS, ResponsesRequest
from server.harness.responses import StoredResponse
from server.request_errors import APIError
from server.sampling import completions
from server.sampling.choices import content_logprobs
from server.sampling.streaming import Completion
from server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


@router.post("/v1/responses", responses=documented(404, 409))
async def create_response(body: ResponsesRequest, request: Request, state: State):
    return await _respond(body, request, state, None)


@router.post("/v1/sessions/{session_id}/responses", responses=documented(403, 404, 409, 429))
@router.post("/v1/sessions/{session_id}/v1/responses", include_in_schema=False)
async def create_response_in_session(session_id: SessionId, body: ResponsesRequest, request: Request, state: State):
    return await _respond(body, request, state, open_session(state, session_id, request))


async def _respond(body: ResponsesRequest, request: Request, state: ServerState,
                   record: completions.Recorder | None):
    owner = caller(request)
    previous: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id, owner)
        if stored is None:
            raise APIError(400, f"previous_response_id: response {body.previous_response_id!r} is not kept here "
                                f"(unknown, expired, created with store: false, or another API key's)",
                           param="previous_response_id", code="previous_response_not_found")
        previous = list(stored.messages)
    history, chat = translate.responses_chat(body, previous)
    try:
        c = await completions.start(state, chat, require_api_key(request), record)
    except APIError as e:
        raise _as_text_format(e)
    r = _Response(body, "resp_" + uuid.uuid4().hex, int(time.time()), c, state.host.chat.text)

    async def keep(choice: dict[str, Any], answered: dict[str, Any]) -> None:
        """Kept before the client has the whole answer, so that it can be continued or retrieved at once."""
        if body.store:
            await asyncio.to_thread(state.responses.put, r.id, owner, body.model, [*history, choice["message"]],
                                    answered, translate.input_items(body))

    if body.stream:
        return StreamingResponse(_events(state, r, request, keep), media_type="text/event-stream")
    [choice] = await completions.finish(state, c, request.is_disconnected)
    answered = r.body(choice)
    await keep(choice, answered)
    return answered


@router.get("/v1/responses/{response_id}", responses=documented(400, 404))
@router.get("/v1/sessions/{session_id}/responses/{response_id}", include_in_schema=False)
@router.get("/v1/sessions/{session_id}/v1/responses/{response_id}", include_in_schema=False)
async def retrieve_response(response_id: str, request: Request, state: State,
                            include: Annotated[list[ResponseIncludable] | None, Query(alias="include[]")] = None,
                            stream: bool = False):
    """A kept response, as it was answered; `include` (as the `openai` SDK sends it) can add the
    text's logprobs to one created without them."""
    if stream:
        raise APIError(400, "stream: a kept response is retrieved whole; art-server does not replay its events",
                       param="stream")
    kept = _kept(state, response_id, request)
    if TEXT_LOGPROBS not in (include or ()):
        return Response(kept.body, media_type="application/json")
    return _with_text_logprobs(json.loads(kept.body), state.host.chat.text)


@router.delete("/v1/responses/{response_id}", responses=documented(404))
@router.delete("/v1/sessions/{session_id}/responses/{response_id}", include_in_schema=False)
@router.delete("/v1/sessions/{session_id}/v1/responses/{response_id}", include_in_schema=False)
async def delete_response(response_id: str, request: Request, state: State):
    """Forget a kept response: it can no longer be retrieved or continued."""
    if not await asyncio.to_thread(state.responses.delete, response_id, caller(request)):
        raise _not_kept(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", responses=documented(400, 404))
@router.get("/v1/sessions/{session_id}/responses/{response_id}/input_items", include_in_schema=False)
@router.get("/v1/sessions/{session_id}/v1/responses/{response_id}/input_items", include_in_schema=False)
async def list_input_items(response_id: str, request: Request, state: State,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Literal["asc", "desc"] = "desc", after: str | None = None):
    """The request's own input items (not those of the responses it continued), a page at a time."""
    items = list(_kept(state, response_id, request).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _kept(state: ServerState, response_id: str, request: Request) -> StoredResponse:
    stored = state.responses.get(response_id, caller(request))
    if stored is None:
        raise _not_kept(response_id)
    return stored


def _with_text_logprobs(body: dict[str, Any], text_of: Callable[[list[int]], str]) -> dict[str, Any]:
    """A kept body whose message text carries its tokens' logprobs, as `include` would have given
    them at creation: the body keeps the sampled ids and their logprobs, the text's are among them."""
    reasoning = "".join(part["text"] for item in body["output"] if item["type"] == "reasoning"
                        for part in item.get("content") or [])
    for item in body["output"]:
        if item["type"] == "message" and "logprobs" not in item["content"][0]:
            text = item["content"][0]
            choice = {"token_ids": body["token_ids"], "logprobs": body["logprobs"],
                      "message": {"content": text["text"], "reasoning_content": reasoning}}
            text["logprobs"] = content_logprobs(text_of, choice)
    return body


def _not_kept(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} is not kept here (unknown, expired, created with store: "
                         f"false, deleted, or another API key's)", param="response_id", code="response_not_found")


def _as_text_format(e: APIError) -> APIError:
    """A chat `response_format` error is the Responses request's `text.format`."""
    if e.param != "response_format":
        return e
    message = e.message.removeprefix("response_format").lstrip(": ")
    return APIError(e.status, f"text.format: {message}", param="text.format", code=e.code, headers=e.headers)


class _Response:
    """One response's fixed fields, shared by its events and its final body."""

    def __init__(self, req: ResponsesRequest, id_: str, created: int, c: Completion,
                 text_of: Callable[[list[int]], str]):
        self.req, self.id, self.created, self.c, self.text_of = req, id_, created, c, text_of
        self.item_id = uuid.uuid4().hex[:24]

    def body(self, choice: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
        req = self.req
        out = []
        if choice is not None:
            logprobs = content_logprobs(self.text_of, choice) if req.text_logprobs else None
            out = translate.response_output(choice, self.item_id, logprobs)
        if status is None:
            status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": out, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "top_p": req.top_p,
            "truncation": "disabled", "metadata": (req.model_extra or {}).get("metadata") or {},
            "usage": None, "prompt_token_ids": self.c.prompt_ids,
        }
        if choice is not None:
            prompt_tokens, completion_tokens = completions.usage(self.c)
            # every field the `openai` SDK's ResponseUsage requires: ART 0.5.23 validates it strictly
            body["usage"] = {"input_tokens": prompt_tokens,
                             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt_tokens + completion_tokens}
            body.update(token_ids=choice["token_ids"], logprobs=choice["logprobs"], sampling=choice["sampling"])
            if choice.get("malformed_tool_call"):
                body["malformed_tool_call"] = True
        return body


class _EventWriter:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _events(state: ServerState, r: _Response, request: Request,
                  keep: Callable[[dict[str, Any], dict[str, Any]], Awaitable[None]]) -> AsyncIterator[str]:
    """Responses' stream: reasoning and text as they decode, each item opened when its first
    text arrives and closed in order; function calls whole at the end (a call is only known once
    it parses); `response.completed` last, with the body a request that does not stream gets."""
    ev = _EventWriter()
    yield ev("response.created", response=r.body(None, "in_progress"))
    yield ev("response.in_progress", response=r.body(None, "in_progress"))
    opened: list[str] = []  # item kinds in output order
    texts = {"reasoning": "", "message": ""}
    ids = {"reasoning": "rs_" + r.item_id, "message": "msg_" + r.item_id}

    def open_item(kind: str) -> list[str]:
        out = []
        if "reasoning" in opened and kind == "message" and "message" not in opened:
            out += close_item("reasoning")
        opened.append(kind)
        index = len(opened) - 1
        if kind == "reasoning":
            item = {"type": "reasoning", "id": ids[kind], "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": ids[kind], "role": "assistant", "content": [], "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": []}
        out.append(ev("response.output_item.added", output_index=index, item=item))
        out.append(ev("response.content_part.added", item_id=ids[kind], output_index=index, content_index=0, part=part))
        return out

    closed: set[str] = set()

    def close_item(kind: str, final: dict[str, Any] | None = None) -> list[str]:
        if kind in closed or kind not in opened:
            return []
        closed.add(kind)
        index, text = opened.index(kind), texts[kind]
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item = final or {"type": "reasoning", "id": ids[kind], "summary": [], "content": [part], "status": "completed"}
            done = ev("response.reasoning_text.done", item_id=ids[kind], output_index=index, content_index=0, text=text)
        else:
            logprobs = final["content"][0].get("logprobs") if final else None
            part = {"type": "output_text", "text": text, "annotations": [],
                    **({"logprobs": logprobs} if logprobs is not None else {})}
            item = final or {"type": "message", "id": ids[kind], "role": "assistant", "content": [part],
                             "status": "completed"}
            done = ev("response.output_text.done", item_id=ids[kind], output_index=index, content_index=0, text=text,
                      logprobs=logprobs or [])
        return [done, ev("response.content_part.done", item_id=ids[kind], output_index=index, content_index=0, part=part),
                ev("response.output_item.done", output_index=index, item=item)]

    async for chunk in completions.stream(state, r.c, request.is_disconnected):
        if "error" in chunk:
            yield ev("error", code=chunk["error"]["code"], message=chunk["error"]["message"], param=None)
            return
        delta = chunk["choices"][0]["delta"]
        chunk_logprobs = chunk["choices"][0].get("logprobs") if r.req.text_logprobs else None
        logprobs = (chunk_logprobs or {}).get("content") or []  # the tokens this chunk decoded, with its text
        for kind, key, event in (("reasoning", "reasoning_content", "response.reasoning_text.delta"),
                                 ("message", "content", "response.output_text.delta")):
            text = delta.get(key)
            if not text or kind in closed:
                continue
            if kind not in opened:
                for e in open_item(kind):
                    yield e
            texts[kind] += text
            extra = {"logprobs": logprobs} if kind == "message" else {}
            yield ev(event, item_id=ids[kind], output_index=opened.index(kind), content_index=0, delta=text, **extra)
    choice = r.c.choices.get(0)
    if choice is None:  # the client went away
        return
    body = r.body(choice)
    await keep(choice, body)
    finals = {item["type"]: item for item in body["output"] if item["type"] in ("reasoning", "message")}
    if "message" in finals and "message" not in opened:  # an empty answer: its item still exists
        for e in open_item("message"):
            yield e
    for kind in ("reasoning", "message"):
        for e in close_item(kind, finals.get(kind)):
            yield e
    for item in body["output"]:
        if item["type"] != "function_call":
            continue
        index = len(opened)
        opened.append(item["id"])
        yield ev("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                 delta=item["arguments"])
        yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                 arguments=item["arguments"], name=item["name"])
        yield ev("response.output_item.done", output_index=index, item=item)
    yield ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
