"""Sampled text -> OpenAI `message.content` and `message.tool_calls` (Qwen2.5 convention).

A malformed call (invalid JSON, no name, unclosed tag) is not an error: the whole text stays
in `content`, so the agent loop can see what the model wrote and stop with a clear reason.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON object text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedCall]
    malformed: bool  # text looked like a tool call but could not be parsed


def _parse_block(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, tools_enabled: bool = True) -> ParsedOutput:
    if not tools_enabled or TOOL_CALL_OPEN not in text:
        return ParsedOutput(content=text, tool_calls=[], malformed=False)
    blocks = list(_BLOCK.finditer(text))
    calls = [_parse_block(b.group(1)) for b in blocks]
    unclosed = text.count(TOOL_CALL_OPEN) != len(blocks)
    if not blocks or unclosed or any(c is None for c in calls):
        return ParsedOutput(content=text, tool_calls=[], malformed=True)
    # Only trailing whitespace goes: a stream has already sent any leading whitespace as content.
    rest = _BLOCK.sub("", text).rstrip()
    return ParsedOutput(content=rest or None, tool_calls=[c for c in calls if c], malformed=False)


def held_back_suffix(text: str) -> int:
    """How many trailing characters of streamed text might start a `<tool_call>` tag and must
    wait before they are sent as content."""
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return k
    return 0
