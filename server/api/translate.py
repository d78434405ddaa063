"""The Responses and Messages faces' requests as chat requests, a sampled chat choice back as
output items and content blocks, and a Responses request's input as the items kept with it.

The rules that turn items and blocks into chat messages, tools and `tool_choice` are
protocol/translation.py's, shared with the client that rebuilds captured exchanges; what is the
server's own is here: the order check by the renderer's rules, the ChatCompletionRequest the one
path samples, and a request that fails either as a 400 naming the request's own field.

The way back and the way in are inverses as far as a turn's identity goes (its text, reasoning,
and each call's id, name and arguments: server/chat/sampled_turns.py's turn key): a harness that
echoes an output item or block back unchanged gets the turn it was sampled as, so the next
prompt splices the exact sampled ids, whichever API the conversation goes through.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Sequence

from pydantic import ValidationError

from protocol import translation
from protocol.translation import Translated, TranslationError
from protocol.validation import first_problem
from server.api.messages_schemas import MessagesRequest
from server.api.responses_schemas import ResponsesRequest
from server.chat.validate import RenderError, validate_messages
from server.request_errors import APIError
from server.sampling.chat_request import ChatCompletionRequest

Messages = list[dict[str, Any]]


def responses_chat(body: ResponsesRequest,
                   previous: Sequence[dict[str, Any]]) -> tuple[Messages, ChatCompletionRequest]:
    """The chat request a Responses request amounts to, and its conversation without the
    instructions (what a later `previous_response_id` continues). `previous` is the conversation
    of the response that `previous_response_id` named."""
    raw = body.model_dump(include={"input", "tools", "tool_choice"}, exclude_none=True)
    try:
        history = translation.responses_history(raw["input"], previous)
        conversation = translation.responses_conversation(body.instructions, history)
        _check_order(conversation)
        chat = _chat_request(
            model=body.model, messages=conversation.messages, tools=translation.responses_tools(raw.get("tools")),
            tool_choice=translation.responses_tool_choice(raw.get("tool_choice")),
            parallel_tool_calls=body.parallel_tool_calls, max_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, seed=body.seed, logprobs=bool(body.top_logprobs) or None,
            top_logprobs=body.top_logprobs, response_format=body.text.response_format(), stream=body.stream,
            chat_template_kwargs=body.chat_template_kwargs)
    except TranslationError as e:
        raise _bad_request(e)
    return history.messages, chat


def messages_chat(body: MessagesRequest, answered: bool = True) -> ChatCompletionRequest:
    """The chat request a Messages request amounts to; one only counted (`answered` false) may end
    on the assistant's turn, which Anthropic counts as it stands."""
    raw = body.model_dump(include={"system", "messages", "tools", "tool_choice"}, exclude_none=True)
    tool_choice, parallel = translation.anthropic_tool_choice(raw.get("tool_choice"))
    try:
        _check_thinking_budget(body)
        conversation = translation.anthropic_conversation(raw.get("system"), raw["messages"])
        _check_order(conversation)
        if answered:
            _check_no_prefill(body)  # after the blocks' own checks, which name the block
        return _chat_request(
            model=body.model, messages=conversation.messages, tools=translation.anthropic_tools(raw.get("tools")),
            tool_choice=tool_choice, parallel_tool_calls=parallel, max_tokens=body.max_tokens,
            stop=body.stop_sequences, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            stream=body.stream, chat_template_kwargs=body.chat_template_kwargs,
            response_format=body.response_format(), reasoning_effort=body.reasoning_effort())
    except TranslationError as e:
        raise _bad_request(e)


def _check_thinking_budget(body: MessagesRequest) -> None:
    # Anthropic's rule: the budget is part of max_tokens, so one at or past it cannot be what was meant.
    budget = body.thinking.budget_tokens if body.thinking is not None else None
    if budget is not None and budget >= body.max_tokens:
        raise TranslationError("thinking.budget_tokens",
                               f"must be less than max_tokens ({budget} >= {body.max_tokens})")


def _check_no_prefill(body: MessagesRequest) -> None:
    # To Anthropic a last assistant message is the start of the answer, to be continued; a chat
    # template would close it and answer anew, which the client would read as its continuation.
    # Anthropic's current models refuse a prefill too.
    last = len(body.messages) - 1
    if body.messages[last].role == "assistant":
        raise TranslationError(f"messages[{last}]", "prefilling the assistant's answer is not supported: art-server "
                                                    "answers with a new turn, so end with a user message")


def _bad_request(e: TranslationError) -> APIError:
    return APIError(400, str(e), param=e.param, code="invalid_value")


def _check_order(conversation: Translated) -> None:
    """The chat order rules (server/chat/validate.py), with a broken rule named by the request's
    own item or message rather than by the chat message it became."""
    try:
        validate_messages(conversation.messages)
    except RenderError as e:
        origins = conversation.origins
        found = re.match(r"messages\[(\d+)\]", str(e))
        if found is None:
            raise TranslationError(origins[-1] if origins else "input", str(e))
        raise TranslationError(origins[int(found.group(1))], str(e)[found.end():].lstrip(":. "))


def _chat_request(**fields: Any) -> ChatCompletionRequest:
    """The face's fields were checked where they arrived, so a failure here is the translation's own."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        field, why = first_problem(e)
        raise TranslationError(field or "body", why)


# ---- the way back -------------------------------------------------------------------------------

def response_output(choice: dict[str, Any], item_id: str,
                    text_logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Output items of a chat choice: reasoning, the message (unless the turn is only calls), and
    one function_call per call; ids derive from `item_id` so a stream can name them up front. The
    message's text carries `text_logprobs` when the request included them."""
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = message.get("tool_calls") or []
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append({"type": "reasoning", "id": "rs_" + item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content") or not calls:
        text = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        if text_logprobs is not None:
            text["logprobs"] = text_logprobs
        out.append({"type": "message", "id": "msg_" + item_id, "role": "assistant", "status": status,
                    "content": [text]})
    for k, call in enumerate(calls):
        out.append({"type": "function_call", "id": f"fc_{item_id}_{k}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                    "status": "completed"})
    return out


ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as the Responses items `GET /v1/responses/{id}/input_items` lists:
    a string is one user message, a message's text is in parts, and an item keeps the id it was
    echoed with (an earlier response's output) or gets one."""
    items = ([{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str)
             else [item.model_dump(exclude_none=True) for item in body.input])
    out = []
    for item in items:
        if item["type"] == "message":
            kind = "output_text" if item["role"] == "assistant" else "input_text"
            extra = {"annotations": []} if kind == "output_text" else {}
            parts = [{"text": item["content"]}] if isinstance(item["content"], str) else item["content"]
            item["content"] = [{**part, "type": kind, **extra} for part in parts]
        own_id = item.pop("id", None) or f"{ITEM_ID_PREFIX[item['type']]}_{uuid.uuid4().hex[:24]}"
        out.append({"id": own_id, **item, "status": "completed"})
    return out


def anthropic_content(choice: dict[str, Any]) -> list[dict[str, Any]]:
    message = choice["message"]
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"] or "{}")
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": arguments if isinstance(arguments, dict) else {}})
    if not any(b["type"] != "thinking" for b in blocks):
        blocks.append({"type": "text", "text": ""})
    return blocks


def stop_reason(finish: str, stop_sequence: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"
