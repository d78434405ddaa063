"""One canonical JSON form for values compared by the reward helpers.

Two values that mean the same thing must serialise to the same string, whatever the dict key
order or int-vs-float spelling of a number (a tool computing 10 + 0.0 should not lose credit).
"""

from __future__ import annotations

import json
from typing import Any


_encode = json.JSONEncoder(ensure_ascii=False).encode


def canonical_json(value: Any, *, sort_lists: bool) -> str:
    """Compact JSON with sorted keys and integral floats written as ints.

    `sort_lists=True` makes lists order-insensitive (items sorted by their canonical JSON): right
    for database tables, wrong for tool arguments whose lists pair up by position.
    """
    # Built bottom-up as strings so each node is encoded once, sorting lists included.
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return _encode(value)
    if isinstance(value, float):
        return _encode(int(value) if value.is_integer() else value)
    if isinstance(value, dict):
        fields = sorted((str(k), canonical_json(v, sort_lists=sort_lists)) for k, v in value.items())
        return "{" + ",".join(f"{_encode(k)}:{v}" for k, v in fields) + "}"
    if isinstance(value, (list, tuple)):
        items = [canonical_json(v, sort_lists=sort_lists) for v in value]
        return "[" + ",".join(sorted(items) if sort_lists else items) + "]"
    raise TypeError(f"not a JSON-like value: {type(value).__name__}")
