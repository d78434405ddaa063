"""The judge's reply: the JSON shape asked for, and its validation into scores per trajectory id."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import BaseModel, StrictFloat, ValidationError


class JudgeScore(BaseModel):
    trajectory_id: str
    explanation: str | None = ""
    # Strict: a bool or a string like "high" is a malformed reply, not a number to coerce.
    score: StrictFloat


class JudgeReply(BaseModel):
    scores: list[JudgeScore]


class InvalidReply(Exception):
    """A reply we can't use; the message is shown to the judge on the retry."""


_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def _loads_tolerant(text: str) -> Any:
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    # Some models wrap the object in prose; take the outermost braces.
    start, end = text.find("{"), text.rfind("}")
    if start != -1 and end > start:
        try:
            return json.loads(text[start : end + 1])
        except json.JSONDecodeError:
            pass
    raise InvalidReply("the reply is not valid JSON")


def parse_reply(text: str | None, ids: list[str]) -> dict[str, JudgeScore]:
    """Scores keyed by trajectory id; raises InvalidReply on anything we should not train on."""
    if not text or not text.strip():
        raise InvalidReply("the reply was empty")
    try:
        reply = JudgeReply.model_validate(_loads_tolerant(text))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise InvalidReply(f"the JSON does not match the required shape ({problems})") from None
    got = [s.trajectory_id for s in reply.scores]
    problems = []
    duplicates = sorted({i for i in got if got.count(i) > 1})
    missing = [i for i in ids if i not in got]
    extra = sorted(set(got) - set(ids))
    if duplicates:
        problems.append(f"duplicate ids {', '.join(duplicates)}")
    if missing:
        problems.append(f"missing ids {', '.join(missing)}")
    if extra:
        problems.append(f"unknown ids {', '.join(extra)}")
    bad = [f"{s.trajectory_id}={s.score}" for s in reply.scores if not (math.isfinite(s.score) and 0.0 <= s.score <= 1.0)]
    if bad:
        problems.append(f"scores outside [0, 1]: {', '.join(bad)}")
    if problems:
        raise InvalidReply("; ".join(problems))
    return {s.trajectory_id: s for s in reply.scores}

def reply_format(ids: list[str]) -> dict[str, Any]:
    """The judge's reply as an OpenAI `json_schema` response_format."""
    entry = {"type": "object", "additionalProperties": False, "required": ["trajectory_id", "explanation", "score"],
             "properties": {"trajectory_id": {"type": "string", "enum": ids},
                            "explanation": {"type": "string", "maxLength": 240},
                            "score": {"type": "number", "minimum": 0, "maximum": 1}}}
    schema = {"type": "object", "additionalProperties": False, "required": ["scores"],
              "properties": {"scores": {"type": "array", "items": entry, "minItems": len(ids), "maxItems": len(ids)}}}
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema}}
