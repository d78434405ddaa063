"""One canonical JSON form for values compared by the reward helpers.

Two values that mean the same thing must serialise to the same string, whatever the dict key
order or int-vs-float spelling of a number (a tool computing 10 + 0.0 should not lose credit).
"""

from __future__ import annotations

import json
from typing import Any


def canonical(value: Any, *, sort_lists: bool) -> Any:
    """A plain-JSON copy of `value` with sorted keys and integral floats as ints.

    `sort_lists=True` makes lists order-insensitive (sorted by their items' canonical JSON): right
    for database tables, wrong for tool arguments whose lists pair up by position.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return {str(k): canonical(v, sort_lists=sort_lists) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [canonical(v, sort_lists=sort_lists) for v in value]
        return sorted(items, key=_dumps) if sort_lists else items
    raise TypeError(f"not a JSON-like value: {type(value).__name__}")


def canonical_json(value: Any, *, sort_lists: bool) -> str:
    return _dumps(canonical(value, sort_lists=sort_lists))


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
