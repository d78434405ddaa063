"""A pydantic ValidationError as the one line a client is told: the field that failed first, and why."""

from __future__ import annotations

from pydantic import ValidationError


def first_problem(e: ValidationError) -> tuple[str, str]:
    """(the dotted path of the first field that failed, "" for the whole object; pydantic's message for it)."""
    first = e.errors()[0]
    return ".".join(str(p) for p in first.get("loc", ())), first["msg"]
