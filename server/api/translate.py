"""Responses items and Anthropic Messages blocks to the chat messages the renderer takes, and a
sampled chat choice back to output items and content blocks.

The way back and the way in are inverses as far as a turn's identity goes (its text, reasoning,
and each call's id, name and arguments: server/chat/sampled_turns.py's turn key): a harness that
echoes an output item or block back unchanged gets the turn it was sampled as, so the next
prompt splices the exact sampled ids, whichever API the conversation goes through.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from pydantic import ValidationError

from server.api.messages_schemas import MessagesRequest, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from server.api.responses_schemas import (FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem,
                                          ResponsesRequest, TextPart)
from server.api.schemas import ChatCompletionRequest
from server.chat.validate import RenderError, validate_messages

Messages = list[dict[str, Any]]


class TranslationError(ValueError):
    """A request whose items or blocks make no conversation; `param` names the place."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _text(parts: str | Sequence[TextPart | TextBlock]) -> str:
    return parts if isinstance(parts, str) else "".join(p.text for p in parts)


def _check_order(messages: Messages, origins: list[str]) -> None:
    """The chat order rules (server/chat/validate.py), with a broken rule named by the request's
    own item or message rather than by the chat message it became."""
    try:
        validate_messages(messages)
    except RenderError as e:
        found = re.match(r"messages\[(\d+)\]", str(e))
        if found is None:
            raise TranslationError(origins[-1] if origins else "input", str(e))
        where = origins[int(found.group(1))]
        raise TranslationError(where, str(e)[found.end():].lstrip(":. "))


class _Builder:
    """Chat messages in order, each remembering which part of the request it came from; the
    consecutive pieces of one assistant turn (reasoning, text, calls) become one message."""

    def __init__(self, previous: Sequence[dict[str, Any]] = (), previous_origin: str = ""):
        self.messages: Messages = [dict(m) for m in previous]
        self.origins = [previous_origin] * len(self.messages)
        self.turn: dict[str, Any] | None = None

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.close()
        self.messages.append(message)
        self.origins.append(origin)

    def assistant(self, origin: str) -> dict[str, Any]:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": None}
            self.messages.append(self.turn)
            self.origins.append(origin)
        return self.turn

    def close(self) -> None:
        self.turn = None


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _append(turn: dict[str, Any], key: str, text: str) -> None:
    turn[key] = (turn.get(key) or "") + text


# ---- Responses ----------------------------------------------------------------------------------

def responses_history(body: ResponsesRequest, previous: Sequence[dict[str, Any]]) -> tuple[Messages, list[str]]:
    """The conversation a response continues (the previous response's, then this input), without
    the instructions: what a later `previous_response_id` carries on."""
    b = _Builder(previous, "previous_response_id")
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        where = f"input[{i}]" if not isinstance(body.input, str) else "input"
        if isinstance(item, ReasoningItem):
            _append(b.assistant(where), "reasoning_content", _text(item.content or item.summary))
        elif isinstance(item, FunctionCallItem):
            b.assistant(where).setdefault("tool_calls", []).append(_call(item.call_id, item.name, item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            b.add({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}, where)
        elif item.role == "assistant":
            _append(b.assistant(where), "content", _text(item.content))
        else:
            role = "system" if item.role in ("system", "developer") else "user"
            b.add({"role": role, "content": _text(item.content)}, where)
    return b.messages, b.origins


def responses_conversation(body: ResponsesRequest, history: Messages, origins: list[str]) -> Messages:
    """The history with the instructions in front (as the system message, before any of the
    input's own), checked for order."""
    messages, origins = list(history), list(origins)
    if body.instructions:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": body.instructions + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": body.instructions})
            origins.insert(0, "instructions")
    _check_order(messages, origins)
    return messages


def responses_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
            for t in body.tools]


def responses_tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def response_output(choice: dict[str, Any], item_id: str) -> list[dict[str, Any]]:
    """Output items of a chat choice: reasoning, the message (unless the turn is only calls), and
    one function_call per call; ids derive from `item_id` so a stream can name them up front."""
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = message.get("tool_calls") or []
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append({"type": "reasoning", "id": "rs_" + item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content") or not calls:
        out.append({"type": "message", "id": "msg_" + item_id, "role": "assistant", "status": status,
                    "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for k, call in enumerate(calls):
        out.append({"type": "function_call", "id": f"fc_{item_id}_{k}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                    "status": "completed"})
    return out


# ---- Anthropic Messages -------------------------------------------------------------------------

def anthropic_conversation(body: MessagesRequest) -> Messages:
    b = _Builder()
    if body.system:
        b.add({"role": "system", "content": _text(body.system)}, "system")
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            if m.role == "assistant":
                _append(b.assistant(where), "content", m.content)
            else:
                b.add({"role": "user", "content": m.content}, where)
            continue
        if m.role == "assistant":
            _assistant_blocks(b, m.content, where)
        else:
            _user_blocks(b, m.content, where)
        if m.role == "user":
            b.close()
    _check_order(b.messages, b.origins)
    return b.messages


def _assistant_blocks(b: _Builder, blocks: list[Any], where: str) -> None:
    turn = b.assistant(where)
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            _append(turn, "content", block.text)
        elif isinstance(block, ThinkingBlock):
            _append(turn, "reasoning_content", block.thinking)
        elif isinstance(block, ToolUseBlock):
            turn.setdefault("tool_calls", []).append(
                _call(block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
        else:
            raise TranslationError(f"{where}.content[{j}]", "a tool_result block belongs in a user message")


def _user_blocks(b: _Builder, blocks: list[Any], where: str) -> None:
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            if texts:
                raise TranslationError(f"{where}.content[{j}]", "tool_result blocks must come before the text")
            b.add({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)},
                  f"{where}.content[{j}]")
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise TranslationError(f"{where}.content[{j}]", f"a {block.type} block belongs in an assistant message")
    if texts or not blocks:
        b.add({"role": "user", "content": "".join(texts)}, where)


def anthropic_tools(body: MessagesRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description else {}),
                                              "parameters": t.input_schema}} for t in body.tools]


def anthropic_tool_choice(body: MessagesRequest) -> tuple[Any, bool]:
    """(chat's tool_choice, parallel_tool_calls)."""
    choice = body.tool_choice
    if choice is None:
        return None, True
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
        {"type": "function", "function": {"name": choice.name}}
    return chat, not choice.disable_parallel_tool_use


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


# ---- both ---------------------------------------------------------------------------------------

def chat_request(**fields: Any) -> ChatCompletionRequest:
    """The chat request a face's request amounts to; its fields were checked where they arrived,
    so a failure here is the translation's own."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        raise TranslationError(".".join(str(p) for p in first["loc"]) or "body", first["msg"])
