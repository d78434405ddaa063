"""How deep a JSON value may nest: tool-call arguments, and any body a server parses.

Python's JSON parser, json.dumps and the chat templates all recurse, so a value a few thousand
levels deep (a few KB of brackets) raises RecursionError wherever it is next read: a 500 on a
chat request, a training job that fails long after it was accepted. Client and server check the
same bounds, measured without recursion, so such a value is refused where it arrives, by name.
"""

from __future__ import annotations

import json
from typing import Any

# Tool arguments real tools take are a few levels deep (OpenAI's structured outputs allow 10 levels
# of schema nesting); 64 leaves room for any of them.
MAX_ARGUMENT_DEPTH = 64
# A whole request body: a training job's own structure is about a dozen levels above a tool call's
# arguments, and a tool's parameters schema nests twice per level of object it describes.
MAX_BODY_DEPTH = 128


class TooDeep(ValueError):
    """A JSON value nests past its bound; the message names where."""


def nesting_depth(value: Any, limit: int) -> tuple[int, str]:
    """(depth, where): how deep `value` nests, measured up to the first point past `limit`, and
    the path to that point ("" within the limit). A scalar is 0 deep, `[]` and `{}` are 1.
    Iterative, so no value is too deep to measure."""
    if not isinstance(value, (dict, list)):
        return 0, ""
    deepest = 0
    # (container, its depth, its parent's entry, its key there): the path is only spelled out when needed
    stack: list[tuple[Any, int, Any, Any]] = [(value, 1, None, None)]
    while stack:
        entry = stack.pop()
        node, depth = entry[0], entry[1]
        if depth > limit:
            return depth, _path(entry)
        deepest = max(deepest, depth)
        children = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((v, depth + 1, entry, k) for k, v in children if isinstance(v, (dict, list)))
    return deepest, ""


def _path(entry: Any) -> str:
    keys = []
    while entry is not None and entry[2] is not None:
        keys.append(entry[3])
        entry = entry[2]
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys)).lstrip(".")


def check_depth(value: Any, limit: int, field: str) -> None:
    """Raise TooDeep naming `field` (and the point inside it) when `value` nests past `limit`."""
    depth, where = nesting_depth(value, limit)
    if depth > limit:
        inside = f" (at {_short(where)})" if where else ""
        raise TooDeep(f"{field} nests deeper than {limit} levels{inside}")


def parse_arguments(text: str, field: str, limit: int = MAX_ARGUMENT_DEPTH) -> Any:
    """Tool-call arguments as sent (JSON text, usually of an object): the parsed value, or the
    text itself when it is not JSON (templates then print it as written). Too deep is TooDeep,
    also where the parser itself gives up."""
    try:
        parsed = json.loads(text)
    except RecursionError:
        raise TooDeep(f"{field} nests deeper than {limit} levels") from None
    except ValueError:  # not JSON: the call is kept as text
        return text
    check_depth(parsed, limit, field)
    return parsed


def check_arguments(arguments: Any, field: str, limit: int = MAX_ARGUMENT_DEPTH) -> None:
    """Tool-call arguments, as text or as the mapping some clients send, within `limit`."""
    if isinstance(arguments, str):
        parse_arguments(arguments, field, limit)
    else:
        check_depth(arguments, limit, field)


def check_message_calls(message: Any, field: str) -> None:
    """Each tool call of an OpenAI message dict within the bounds on arguments."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and "arguments" in fn:
            check_arguments(fn["arguments"], f"{field}.tool_calls[{j}].function.arguments")


def _short(path: str, keep: int = 80) -> str:
    """A path through thousands of levels, cut to its start: enough to find it."""
    return path if len(path) <= keep else path[:keep] + "..."
