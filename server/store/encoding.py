"""How the run store writes JSON: every NaN or infinity as null, so every reader (SQLite's JSON too) can parse it."""

from __future__ import annotations

import json
import math
from typing import Any


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN or infinity replaced by None, the convention of every stored figure."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """JSON that every reader can parse: a NaN metric is stored as null (strict JSON has no NaN)."""
    return json.dumps(json_safe(obj))


def strict_json(text: str) -> str:
    return json.dumps(json.loads(text, parse_constant=lambda _: None))
