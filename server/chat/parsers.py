"""Sampled text -> OpenAI `content`, `reasoning_content` and `tool_calls`, per model family.

Parsers are named as vLLM names them (`--tool-call-parser hermes|llama3_json|mistral|pythonic|
openai`, `--reasoning-parser qwen3|deepseek_r1|openai`) and accept the formats those families
write. A call that cannot be parsed is not an error: the whole text stays in `content` and the
output says `malformed`, so the agent loop sees what the model wrote and can stop with a reason.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol.nesting import MAX_ARGUMENT_DEPTH, nesting_depth


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


def _call(name: Any, arguments: Any, new_id=openai_call_id) -> ParsedCall | None:
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

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text)

    def starts_call(self, text: str) -> int | None:
        """Where in `text` a tool call begins, or None."""
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None


class HermesParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

    name = "hermes"
    markers = ("<tool_call>",)
    tags = ("<tool_call>", "</tool_call>")
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        if "<tool_call>" not in text:
            return ParsedOutput(content=text)
        blocks = list(self._block.finditer(text))
        calls = [self._one(b.group(1)) for b in blocks]
        if not blocks or text.count("<tool_call>") != len(blocks) or any(c is None for c in calls):
            return ParsedOutput(content=text, malformed=True)
        # Only trailing whitespace goes: a stream has already sent any leading whitespace as content.
        rest = self._block.sub("", text).rstrip()
        return ParsedOutput(content=rest or None, tool_calls=calls)

    @staticmethod
    def _one(body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        return _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None


def _json_objects(text: str, separator: str) -> list[Any] | None:
    """Consecutive JSON values separated by `separator` (and whitespace); None if anything else."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        out.append(value)
        rest = text[pos:].lstrip()
        if not rest:
            return out
        if not rest.startswith(separator):
            return None
        pos = len(text) - len(rest) + len(separator)


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2: the turn is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several separated by `;`."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    tags = ("<|python_tag|>",)

    def starts_call(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(self.markers) else None

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if not body.startswith(self.markers):
            return ParsedOutput(content=text)
        values = _json_objects(body.removeprefix("<|python_tag|>"), ";")
        calls = [_call(v.get("name"), v.get("parameters", v.get("arguments", {}))) if isinstance(v, dict) else None
                 for v in values or []]
        if not calls or any(c is None for c in calls):
            # A JSON answer that is not a call is content, as vLLM reads it; a tagged one is a broken call.
            return ParsedOutput(content=text, malformed=body.startswith("<|python_tag|>") or values is None)
        return ParsedOutput(content=None, tool_calls=calls)


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v0.3), or
    `[TOOL_CALLS]name[ARGS]{...}` (v11 tokenizers)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    tags = ("[TOOL_CALLS]", "[ARGS]")

    def parse(self, text: str) -> ParsedOutput:
        before, found, after = text.partition("[TOOL_CALLS]")
        if not found:
            return ParsedOutput(content=text)
        calls = self._json_list(after) if after.lstrip().startswith("[") else self._args_form(after)
        if not calls or any(c is None for c in calls):
            return ParsedOutput(content=text, malformed=True)
        return ParsedOutput(content=before.rstrip() or None, tool_calls=calls)

    @staticmethod
    def _json_list(text: str) -> list[ParsedCall | None] | None:
        values = _json_objects(text.strip(), ",")
        if not values or not isinstance(values[0], list):
            return None
        return [_call(v.get("name"), v.get("arguments", {}), mistral_call_id) if isinstance(v, dict) else None
                for v in values[0]]

    @staticmethod
    def _args_form(text: str) -> list[ParsedCall | None]:
        calls = []
        for part in text.split("[TOOL_CALLS]"):
            name, found, args = part.partition("[ARGS]")
            calls.append(_call(name.strip(), args.strip(), mistral_call_id) if found else None)
        return calls


class PythonicParser(ToolParser):
    """Llama 3.2 / 4 and Gemma 3 with vLLM's pythonic templates: `[f(a=1, b="x"), g()]`."""

    name = "pythonic"
    markers = ("[",)

    def starts_call(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else None

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ParsedOutput(content=text)
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # a NUL byte, or nesting past the parser
            return ParsedOutput(content=text, malformed=True)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ParsedOutput(content=text)
        calls = [self._one(e) for e in tree.elts]
        if any(c is None for c in calls):
            return ParsedOutput(content=text, malformed=True)
        return ParsedOutput(content=None, tool_calls=calls)

    @staticmethod
    def _one(node: ast.expr) -> ParsedCall | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal, {[1]: 2}, ...
            return None
        return _call(node.func.id, args)


class ReasoningParser:
    """`<think>...</think>` before the answer (Qwen3, DeepSeek-R1). `opened`: the generation
    prompt already holds the start tag, so the output begins inside the reasoning."""

    def __init__(self, name: str, start: str = "<think>", end: str = "</think>"):
        self.name, self.start, self.end = name, start, end
        self.markers = (start, end)

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        """(reasoning, the rest)."""
        if self.end not in text:
            if opened or (self.name == "deepseek_r1" and self.start in text):
                return text.replace(self.start, "", 1).strip() or None, ""  # still thinking when cut off
            return None, text
        reasoning, _, rest = text.partition(self.end)
        reasoning = reasoning.split(self.start, 1)[-1]
        return reasoning.strip("\n") or None, rest.lstrip("\n")


class HarmonyParser(ToolParser):
    """gpt-oss's harmony format: messages on channels. `analysis` is reasoning, `final` the answer,
    and `commentary to=functions.NAME` a tool call with JSON arguments."""

    name = "openai"
    markers = ("<|channel|>",)
    tags = ("<|channel|>", "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>")
    # The recipient (`to=functions.NAME`) may stand in the role header, before the channel, as well
    # as after it; the role header's `<|start|>assistant` is in the prompt for the first message.
    _message = re.compile(r"(?:<\|start\|>assistant)?([^<]*)<\|channel\|>(\w+)([^<]*?)(?:<\|constrain\|>\w+)?"
                          r"<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)", re.DOTALL)

    def starts_call(self, text: str) -> int | None:
        m = re.search(r"to=functions\.", text)
        return m.start() if m else None

    def parse(self, text: str) -> ParsedOutput:
        messages = list(self._message.finditer(text))
        if not messages:
            return ParsedOutput(content=text)
        reasoning, final, calls, malformed = [], [], [], False
        for m in messages:
            channel, header, body = m.group(2), m.group(1) + m.group(3), m.group(4)
            target = re.search(r"to=functions\.([\w.-]+)", header)
            if target:
                call = _call(target.group(1), body.strip())
                malformed |= call is None
                calls.append(call)
            elif channel == "analysis":
                reasoning.append(body)
            else:
                final.append(body)
        if malformed:
            return ParsedOutput(content=text, reasoning="".join(reasoning) or None, malformed=True)
        return ParsedOutput(content="".join(final) or None, tool_calls=calls, reasoning="".join(reasoning) or None)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    ToolParser, HermesParser, Llama3JsonParser, MistralParser, PythonicParser, HarmonyParser)}
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai", "none")


def detect_tool_parser(template: str) -> str:
    """The tool-call format a chat template teaches, as vLLM names it."""
    if "<|channel|>" in template:
        return "openai"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "none"


def detect_reasoning_parser(template: str) -> str:
    if "<|channel|>" in template:
        return "openai"
    return "qwen3" if "<think>" in template else "none"


def make_reasoning_parser(name: str) -> ReasoningParser | None:
    if name in ("none", "openai"):  # harmony carries its reasoning on a channel: the tool parser splits it
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    return ReasoningParser(name)


def make_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
