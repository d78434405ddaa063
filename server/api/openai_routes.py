"""`GET /v1/models` and `POST /v1/chat/completions`, OpenAI-compatible.

Beyond OpenAI's shape every choice carries what training needs (invariants 1-2): `token_ids`
(vLLM's `return_token_ids` convention), per-token logprobs at the sampling temperature in
`logprobs.content` (always, not only when asked), and `sampling` (temperature, top_p, policy
step, prompt fingerprint). The response carries `prompt_token_ids`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server.api.auth import require_api_key
from server.api.errors import APIError
from server.api.schemas import ChatCompletionRequest
from server.chat.render import RenderError, fingerprint, validate_messages
from server.chat.tool_calls import held_back_suffix, parse_tool_calls
from server.engine.sampling import SamplingParams
from server.engine.scheduler import EngineFull, GenRequest, Sequence
from server.model_host import ModelHost, Policy

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    host: ModelHost = request.app.state.artisan.host
    now = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": now, "owned_by": "artisan",
         "max_model_len": host.context_window} for name in host.served_names()]}


def _prompt(host: ModelHost, body: ChatCompletionRequest) -> list[int]:
    try:
        validate_messages(body.messages)
    except RenderError as e:
        raise APIError(400, str(e), param="messages", code="invalid_messages")
    vocab = len(host.tokenizer)
    for i, m in enumerate(body.messages):
        ids = m.get("token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids)):
            raise APIError(400, f"messages[{i}].token_ids must be token ids below {vocab}", param=f"messages[{i}].token_ids")
    try:
        return host.renderer.render(body.messages, body.tool_dicts(), True, lookup=host.turns.lookup)
    except RenderError as e:
        raise APIError(400, str(e), param="messages", code="invalid_messages")


def _sampling_params(host: ModelHost, body: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
    room = host.context_window - prompt_len
    if room <= 0:
        raise APIError(400, f"the prompt is {prompt_len} tokens, {prompt_len - host.context_window + 1} more than "
                            f"fit in this model's context window of {host.context_window} (with room for one "
                            f"generated token)", param="messages", code="context_length_exceeded")
    budget = body.token_budget()
    # A budget past the window is clamped, not refused: the choice then ends with "length".
    max_tokens = min(budget, room) if budget else room
    return SamplingParams(temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, stop=body.stop,
                          seed=body.seed, top_logprobs=body.top_logprobs or 0, ignore_eos=body.ignore_eos)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (one printable character per byte), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _token_bytes(host: ModelHost, token_id: int, text: str) -> list[int]:
    """A token's own bytes. A byte-level token may hold part of a UTF-8 character, which its text
    shows as U+FFFD; OpenAI's `bytes` exist so a client can join such tokens back into one."""
    tok = host.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if (backend is not None and type(backend.decoder).__name__ == "ByteLevel"
            and token_id not in tok.added_tokens_decoder):
        piece = tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
    return list(text.encode("utf-8"))


def _token_entry(host: ModelHost, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
    text = host.tokenizer.decode([token_id])
    entry = {"token": text, "logprob": logprob, "bytes": _token_bytes(host, token_id, text)}
    entry["top_logprobs"] = [
        {"token": (t := host.tokenizer.decode([i])), "logprob": lp, "bytes": _token_bytes(host, i, t)}
        for i, lp in (top or [])
    ]
    return entry


def _output_text(host: ModelHost, seq: Sequence) -> str:
    text = host.renderer.output_text(seq.token_ids)
    return text[: seq.stop_text_end] if seq.stop_text_end is not None else text


def _sampling_info(host: ModelHost, policy: Policy, params: SamplingParams, prompt_ids: list[int]) -> dict[str, Any]:
    return {"temperature": params.temperature, "top_p": params.top_p,
            "logprob_temperature": params.logprob_temperature, "policy": policy.name, "step": policy.step,
            "prompt_fingerprint": fingerprint(prompt_ids), "prompt_len": len(prompt_ids),
            "model_fingerprint": host.fingerprint}


def _message_and_finish(host: ModelHost, seq: Sequence, tools_enabled: bool) -> tuple[dict[str, Any], str]:
    parsed = parse_tool_calls(_output_text(host, seq), tools_enabled)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    finish = seq.finish_reason or "stop"
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        if finish == "stop":
            finish = "tool_calls"
    return message, finish


def build_choice(host: ModelHost, seq: Sequence, policy: Policy, params: SamplingParams,
                 prompt_ids: list[int], tools_enabled: bool) -> dict[str, Any]:
    message, finish = _message_and_finish(host, seq, tools_enabled)
    # Remember the exact ids, so the next turn's prompt contains them when the client echoes it back.
    host.turns.put(message, seq.token_ids)
    tops = seq.top_logprobs or [None] * len(seq.token_ids)
    return {
        "index": seq.index,
        "message": message,
        "finish_reason": finish,
        "logprobs": {"content": [_token_entry(host, t, lp, top) for t, lp, top in zip(seq.token_ids, seq.logprobs, tops)]},
        "token_ids": list(seq.token_ids),
        "sampling": _sampling_info(host, policy, params, prompt_ids),
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = request.app.state.artisan
    host: ModelHost = state.host
    policy = state.resolve(body.model)
    if policy is None:
        raise APIError(404, f"model {body.model!r} does not exist; served: {', '.join(host.served_names())}",
                       param="model", code="model_not_found")
    prompt_ids = _prompt(host, body)
    params = _sampling_params(host, body, len(prompt_ids))
    tools_enabled = bool(body.tools) and body.tool_choice != "none"

    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    gen = GenRequest(prompt_ids=prompt_ids, params=params, policy=policy, n=body.n, stream=body.stream,
                     emit=lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload)))
    try:
        state.engine.submit(gen)
    except EngineFull as e:
        raise APIError(503, f"server is at capacity ({e}); retry shortly", code="overloaded",
                       headers={"Retry-After": "1"})

    completion_id = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            _stream(host, gen, events, request, body, policy, params, prompt_ids, completion_id, created, tools_enabled),
            media_type="text/event-stream")

    finished = 0
    while finished < body.n:
        try:
            kind, payload = await asyncio.wait_for(events.get(), timeout=1.0)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                gen.cancelled = True
                raise APIError(499, "client disconnected")
            continue
        if kind == "error":
            raise APIError(500, f"generation failed: {payload}")
        if kind == "finished":
            finished += 1
    choices = [build_choice(host, s, policy, params, prompt_ids, tools_enabled) for s in gen.sequences]
    completion_tokens = sum(len(s.token_ids) for s in gen.sequences)
    return {
        "id": completion_id, "object": "chat.completion", "created": created, "model": body.model,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt_ids) + completion_tokens},
        "prompt_token_ids": prompt_ids,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(host: ModelHost, gen: GenRequest, events: asyncio.Queue, request: Request,
                  body: ChatCompletionRequest, policy: Policy, params: SamplingParams, prompt_ids: list[int],
                  completion_id: str, created: int, tools_enabled: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format. Text that may be the start of a tool call is
    held back; a parsed tool call is sent whole as `delta.tool_calls` when the choice finishes."""

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, top: dict | None = None, **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, **extra}
        return _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                     "model": body.model, "choices": [choice], **(top or {})})

    sent_text = ["" for _ in range(body.n)]  # content already sent per choice
    sent_tokens = [0 for _ in range(body.n)]
    in_tool_call = [False for _ in range(body.n)]
    hold = max([len(s) for s in body.stop] + [0])
    finished = 0
    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""}, top={"prompt_token_ids": prompt_ids} if i == 0 else None)
        while finished < body.n:
            try:
                kind, seq = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    gen.cancelled = True
                    return
                continue
            if kind == "error":
                yield _sse({"error": {"message": f"generation failed: {seq}", "type": "server_error",
                                      "param": None, "code": None}})
                return
            i = seq.index
            if kind == "token" and seq.finish_reason is not None:
                continue  # its "finished" event follows and carries these tokens
            # The engine thread may be appending to `seq` as we read it (token ids first, then
            # logprobs, then top logprobs): send only the tokens whose every list is complete.
            end = len(seq.top_logprobs) if params.top_logprobs else len(seq.logprobs)
            new_ids = seq.token_ids[sent_tokens[i]:end]
            new_lps = seq.logprobs[sent_tokens[i]:end]
            tops = seq.top_logprobs[sent_tokens[i]:end] if params.top_logprobs else [None] * len(new_ids)
            extra = {"token_ids": new_ids,
                     "logprobs": {"content": [_token_entry(host, t, lp, tp) for t, lp, tp in zip(new_ids, new_lps, tops)]}}
            sent_tokens[i] = end
            if kind == "token":
                text = host.renderer.output_text(seq.token_ids[:end])
                if tools_enabled and "<tool_call>" in text:
                    in_tool_call[i] = True
                safe = len(text) if in_tool_call[i] else len(text) - max(held_back_suffix(text) if tools_enabled else 0, hold)
                if tools_enabled:  # parsed content drops trailing whitespace before a tool call
                    safe = min(safe, len(text.rstrip()))
                if body.stop:  # the stop may be in `text` before the engine marked the row finished
                    safe = min([safe] + [text.find(s) for s in body.stop if s in text])
                if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
                    safe = min(safe, len(text) - 1)
                if not in_tool_call[i] and safe > len(sent_text[i]):
                    delta = text[len(sent_text[i]):safe]
                    sent_text[i] = text[:safe]
                    yield chunk(i, {"content": delta}, **extra)
                elif new_ids:
                    yield chunk(i, {}, **extra)
                continue
            if kind != "finished":
                continue
            finished += 1
            message, finish = _message_and_finish(host, seq, tools_enabled)
            host.turns.put(message, seq.token_ids)
            final_delta: dict[str, Any] = {}
            if message.get("tool_calls"):
                final_delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
                rest = (message["content"] or "")[len(sent_text[i]):] if (message["content"] or "").startswith(sent_text[i]) else ""
                if rest:
                    final_delta["content"] = rest
            else:
                full = message["content"] or ""
                if full.startswith(sent_text[i]) and len(full) > len(sent_text[i]):
                    final_delta["content"] = full[len(sent_text[i]):]
            yield chunk(i, final_delta, finish, **extra,
                        sampling=_sampling_info(host, policy, params, prompt_ids))
        if (body.stream_options or {}).get("include_usage"):
            completion_tokens = sum(len(s.token_ids) for s in gen.sequences)
            yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                        "model": body.model, "choices": [],
                        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                                  "total_tokens": len(prompt_ids) + completion_tokens}})
        yield "data: [DONE]\n\n"
    finally:
        if finished < body.n:
            gen.cancelled = True
