"""Conversations no chat model was trained on are refused, with a message that says where.

The shape of each message (roles, content parts, tool calls) is checked where a request arrives
(server/sampling/chat_request.py); what is checked here is the order: tool results follow the call they
answer, a system message comes first, a conversation does not end on an unanswered call.
"""

from __future__ import annotations

from typing import Any, Sequence


class RenderError(ValueError):
    """The messages cannot form a prompt (bad order, missing fields). Maps to a 400."""


def _check_content(m: dict[str, Any], i: int) -> None:
    content = m.get("content")
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RenderError(f"messages[{i}].content: only text content parts are supported")
        return
    raise RenderError(f"messages[{i}].content must be a string or a list of text parts")


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise RenderError("messages must not be empty")
    pending_tool_ids: set[str] = set()
    awaiting_results = False  # the previous turn was an assistant tool call or one of its results
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RenderError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RenderError(f"messages[{i}].role must be one of system, user, assistant, tool (got {role!r})")
        _check_content(m, i)
        if role in ("system", "developer", "user") and m.get("content") is None:
            raise RenderError(f"messages[{i}].content is required in a {role} message")
        if role in ("system", "developer") and i != 0:
            raise RenderError(f"messages[{i}]: a system message may only come first")
        if role == "tool":
            if not awaiting_results:
                raise RenderError(f"messages[{i}]: a tool message must follow an assistant message with tool_calls")
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, (str, type(None))):
                raise RenderError(f"messages[{i}].tool_call_id must be a string")
            if pending_tool_ids and call_id not in pending_tool_ids:
                raise RenderError(f"messages[{i}].tool_call_id {call_id!r} does not match a preceding tool call")
            if not isinstance(m.get("content"), (str, list)):
                raise RenderError(f"messages[{i}]: a tool message needs string content")
        elif role == "assistant":
            pending_tool_ids, awaiting_results = _check_calls(m, i)
        else:
            pending_tool_ids, awaiting_results = set(), False
    if messages[-1].get("role") == "assistant" and messages[-1].get("tool_calls"):
        raise RenderError("the last message is an assistant tool call: its tool results must follow")


def _check_calls(m: dict[str, Any], i: int) -> tuple[set[str], bool]:
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RenderError(f"messages[{i}].tool_calls must be a list")
    ids = set()
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RenderError(f"messages[{i}].tool_calls[{j}] needs function.name")
        if not isinstance(call.get("id", ""), (str, type(None))):
            raise RenderError(f"messages[{i}].tool_calls[{j}].id must be a string")
        if call.get("id"):
            ids.add(call["id"])
    return ids, bool(calls)
