"""What a tool-call parser returns, and the base every model family's parser builds on.

A call that cannot be parsed is not an error: the whole text stays in `content` and the output
says `malformed`, so the agent loop sees what the model wrote and can stop with a reason.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol.nesting import MAX_ARGUMENT_DEPTH, nesting_depth

# The request's tools, as the parsers need them: each function's name and its JSON-schema
# `parameters`. Formats that write each argument as text (Qwen3-Coder's XML) are typed by them.
ToolSchemas = dict[str, dict[str, Any]]


def tool_schemas(tools: list[dict[str, Any]]) -> ToolSchemas:
    """OpenAI `tools` (function tools) as the parsers read them."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


def openai_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def mistral_call_id() -> str:
    # Mistral's template refuses any other id: nine letters and digits.
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON object text, as OpenAI sends it
    id: str = field(default_factory=openai_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedCall] = field(default_factory=list)
    reasoning: str | None = None
    malformed: bool = False  # text looked like a tool call but could not be parsed


def make_call(name: Any, arguments: Any, new_id=openai_call_id) -> ParsedCall | None:
    """A call from a parsed name and arguments (an object, or JSON text of one); None if invalid."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    if nesting_depth(arguments, MAX_ARGUMENT_DEPTH)[0] > MAX_ARGUMENT_DEPTH:
        return None  # a request echoing this call back would be refused: it is malformed here too
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # not JSON (a Python set, a tuple key, NaN): the call is malformed
        return None
    return ParsedCall(name=name, arguments=text, id=new_id())


class ToolParser:
    """Base: `markers` are the texts that open a tool call (held back while streaming); `tags`
    every control text the parser reads (kept when the output is decoded)."""

    name = "none"
    markers: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()

    def parse(self, text: str, schemas: ToolSchemas | None = None) -> ParsedOutput:
        return ParsedOutput(content=text)

    def starts_call(self, text: str) -> int | None:
        """Where in `text` a tool call begins, or None."""
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None


class BlockParser(ToolParser):
    """Calls in tagged blocks among the model's text (Hermes' `<tool_call>`, Gemma 4's `<|tool_call>`,
    LFM2's `<|tool_call_start|>`): every block opened must hold calls, and the rest is the content.
    `markers[0]` opens a block; `_block` matches a whole one."""

    _block: re.Pattern[str]

    def calls(self, block: re.Match[str], schemas: ToolSchemas) -> list[ParsedCall] | None:
        """The calls one block holds; None if it is not this format."""
        raise NotImplementedError

    def parse(self, text: str, schemas: ToolSchemas | None = None) -> ParsedOutput:
        opening = self.markers[0]
        if opening not in text:
            return ParsedOutput(content=text)
        found = [self.calls(block, schemas or {}) for block in self._block.finditer(text)]
        if not found or text.count(opening) != len(found) or not all(found):
            return ParsedOutput(content=text, malformed=True)
        # Only trailing whitespace goes: a stream has already sent any leading whitespace as content.
        rest = self._block.sub("", text).rstrip()
        return ParsedOutput(content=rest or None, tool_calls=[call for calls in found for call in calls])
