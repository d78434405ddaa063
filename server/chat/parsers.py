"""Sampled text -> OpenAI `content`, `reasoning_content` and `tool_calls`, per model family.

Parsers are named as vLLM names them (`--tool-call-parser hermes|qwen3_coder|glm45|gemma4|
llama3_json|mistral|pythonic|openai`, `--reasoning-parser qwen3|deepseek_r1|gemma4|openai`) and
accept the formats those families write; `detect_*` reads which from the chat template itself.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from server.chat.tool_calls import (BlockParser, ParsedCall, ParsedOutput, ToolParser, ToolSchemas, make_call,
                                   mistral_call_id)


class HermesParser(BlockParser):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

    name = "hermes"
    markers = ("<tool_call>",)
    tags = ("<tool_call>", "</tool_call>")
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, block: re.Match[str], schemas: ToolSchemas) -> list[ParsedCall] | None:
        call = self._one(block.group(1), schemas)
        return [call] if call is not None else None

    @staticmethod
    def _one(body: str, schemas: ToolSchemas) -> ParsedCall | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        return make_call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema admits (`type`, a list of types, or the branches of anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) \
        else set()
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            types |= schema_types(branch)
    if not types and isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        types.add("string")
    return types


def typed(text: str, schema: Any) -> Any:
    """An argument its format wrote as bare text, read as the tool's schema types it: a string stays
    text (a zip code "02134" is not a number), anything else is read as JSON. Qwen's template writes
    booleans and None with Python's `string` filter, so those spellings are read too."""
    types = schema_types(schema)
    if "null" in types and text in ("null", "None"):
        return None
    if "string" in types:
        return text
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def _parameters(schemas: ToolSchemas, name: str) -> dict[str, Any]:
    properties = (schemas.get(name) or {}).get("properties")
    return properties if isinstance(properties, dict) else {}


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder, Qwen3.5 and later, Nemotron 3: `<tool_call>`, then `<function=NAME>` holding one
    `<parameter=KEY>` block of bare text per argument."""

    name = "qwen3_coder"
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    @classmethod
    def _one(cls, body: str, schemas: ToolSchemas) -> ParsedCall | None:
        function = cls._function.fullmatch(body)
        if function is None:
            return None
        name, properties = function.group(1).strip(), _parameters(schemas, function.group(1).strip())
        # The template puts the value on lines of its own: one newline each side is the format's.
        return make_call(name, {key.strip(): typed(value.removeprefix("\n").removesuffix("\n"),
                                                    properties.get(key.strip()))
                                for key, value in cls._parameter.findall(function.group(2))})


class Glm45Parser(HermesParser):
    """GLM-4.5 and later: `<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`
    pairs; a string value is bare text, any other its JSON."""

    name = "glm45"
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    @classmethod
    def _one(cls, body: str, schemas: ToolSchemas) -> ParsedCall | None:
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or cls._pair.sub("", body[body.find(name) + len(name):]).strip():
            return None  # text between the pairs is not this format
        properties = _parameters(schemas, name)
        return make_call(name, {key.strip(): typed(value, properties.get(key.strip()))
                                for key, value in cls._pair.findall(body)})


class Gemma4Parser(BlockParser):
    """Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, the arguments in the
    template's own literal syntax: keys bare, strings between `<|"|>` quote tokens. The
    `<|tool_response>` it stops on after a call goes with the call."""

    name = "gemma4"
    markers = ("<|tool_call>",)
    tags = ("<|tool_call>", "<tool_call|>", '<|"|>')
    _block = re.compile(r"<\|tool_call>call:([^{<]+)(\{.*?\})<tool_call\|>(?:<\|tool_response>)?", re.DOTALL)
    _bare_key = re.compile(r'([{,]\s*)([^\s{}\[\],:"]+)\s*:')

    def calls(self, block: re.Match[str], schemas: ToolSchemas) -> list[ParsedCall] | None:
        call = make_call(block.group(1).strip(), self.literal(block.group(2)))
        return [call] if call is not None else None

    @classmethod
    def literal(cls, text: str) -> Any:
        """Gemma 4's argument literal as the value it writes; None if it is not one."""
        pieces = text.split('<|"|>')
        if len(pieces) % 2 == 0:
            return None  # a string left open
        as_json = "".join(json.dumps(piece) if i % 2 else cls._bare_key.sub(r'\1"\2":', piece)
                          for i, piece in enumerate(pieces))
        try:
            return json.loads(as_json)
        except (json.JSONDecodeError, RecursionError):
            return None


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

    def parse(self, text: str, schemas: ToolSchemas | None = None) -> ParsedOutput:
        body = text.strip()
        if not body.startswith(self.markers):
            return ParsedOutput(content=text)
        values = _json_objects(body.removeprefix("<|python_tag|>"), ";")
        calls = [make_call(v.get("name"), v.get("parameters", v.get("arguments", {}))) if isinstance(v, dict) else None
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

    def parse(self, text: str, schemas: ToolSchemas | None = None) -> ParsedOutput:
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
        return [make_call(v.get("name"), v.get("arguments", {}), mistral_call_id) if isinstance(v, dict) else None
                for v in values[0]]

    @staticmethod
    def _args_form(text: str) -> list[ParsedCall | None]:
        calls = []
        for part in text.split("[TOOL_CALLS]"):
            name, found, args = part.partition("[ARGS]")
            calls.append(make_call(name.strip(), args.strip(), mistral_call_id) if found else None)
        return calls


class PythonicParser(ToolParser):
    """Llama 3.2 / 4 and Gemma 3 with vLLM's pythonic templates: `[f(a=1, b="x"), g()]`."""

    name = "pythonic"
    markers = ("[",)

    def starts_call(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else None

    def parse(self, text: str, schemas: ToolSchemas | None = None) -> ParsedOutput:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ParsedOutput(content=text)
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # a NUL byte, or nesting past the parser
            return ParsedOutput(content=text, malformed=True)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ParsedOutput(content=text)
        calls = [self._one(e, body) for e in tree.elts]
        if any(c is None for c in calls):
            return ParsedOutput(content=text, malformed=True)
        return ParsedOutput(content=None, tool_calls=calls)

    @staticmethod
    def _one(node: ast.expr, source: str) -> ParsedCall | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: _literal(kw.value, source) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal, {[1]: 2}, ...
            return None
        return make_call(node.func.id, args)


def _literal(node: ast.expr, source: str) -> Any:
    """A call argument's value: a Python literal, or JSON where a template writes a mapping with
    `tojson` (LFM2.5's: `{"a": true}` is no Python literal)."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        try:
            return json.loads(ast.get_source_segment(source, node) or "")
        except (json.JSONDecodeError, RecursionError):
            raise ValueError("neither a Python literal nor JSON") from None


class Lfm2Parser(BlockParser):
    """LFM2: the pythonic list `[f(a=1)]` between `<|tool_call_start|>` and `<|tool_call_end|>`."""

    name = "lfm2"
    markers = ("<|tool_call_start|>",)
    tags = ("<|tool_call_start|>", "<|tool_call_end|>")
    _block = re.compile(r"<\|tool_call_start\|>(.*?)<\|tool_call_end\|>", re.DOTALL)

    def calls(self, block: re.Match[str], schemas: ToolSchemas) -> list[ParsedCall] | None:
        return PythonicParser().parse(block.group(1)).tool_calls or None


class ReasoningParser:
    """`<think>...</think>` before the answer (Qwen3, DeepSeek-R1), or Gemma 4's
    `<|channel>thought\n...<channel|>`. `opened`: the generation prompt already holds the start
    tag, so the output begins inside the reasoning. `label`: what the format writes after the start
    tag to name the block, not part of the reasoning."""

    def __init__(self, name: str, start: str = "<think>", end: str = "</think>", label: str = ""):
        self.name, self.start, self.end, self.label = name, start, end, label
        self.markers = (start, end)

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str]:
        """(reasoning, the rest)."""
        if self.end not in text:
            if opened or (self.name == "deepseek_r1" and self.start in text):
                return text.replace(self.start, "", 1).strip() or None, ""  # still thinking when cut off
            return None, text
        reasoning, _, rest = text.partition(self.end)
        reasoning = reasoning.split(self.start, 1)[-1].removeprefix(self.label)
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

    def parse(self, text: str, schemas: ToolSchemas | None = None) -> ParsedOutput:
        messages = list(self._message.finditer(text))
        if not messages:
            return ParsedOutput(content=text)
        reasoning, final, calls, malformed = [], [], [], False
        for m in messages:
            channel, header, body = m.group(2), m.group(1) + m.group(3), m.group(4)
            target = re.search(r"to=functions\.([\w.-]+)", header)
            if target:
                call = make_call(target.group(1), body.strip())
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
    ToolParser, HermesParser, Qwen3CoderParser, Glm45Parser, Gemma4Parser, Llama3JsonParser, MistralParser,
    PythonicParser, Lfm2Parser, HarmonyParser)}
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gemma4", "openai", "none")


def detect_tool_parser(template: str) -> str:
    """The tool-call format a chat template teaches, as vLLM names it."""
    if "<|channel|>" in template:
        return "openai"
    if "<|tool_call>" in template:
        return "gemma4"
    if "<tool_call>" in template:
        # Qwen3.5's and GLM's templates keep Hermes' tag around arguments of their own.
        return "qwen3_coder" if "<function=" in template else "glm45" if "<arg_key>" in template else "hermes"
    if "<|tool_call_start|>" in template or "<|tool_list_start|>" in template:  # LFM2's first names no call tag
        return "lfm2"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "none"


def detect_reasoning_parser(template: str) -> str:
    if "<|channel|>" in template:
        return "openai"
    if "<|channel>" in template:
        return "gemma4"
    return "qwen3" if "<think>" in template else "none"


def make_reasoning_parser(name: str) -> ReasoningParser | None:
    if name in ("none", "openai"):  # harmony carries its reasoning on a channel: the tool parser splits it
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    if name == "gemma4":
        return ReasoningParser(name, "<|channel>", "<channel|>", label="thought")
    return ReasoningParser(name)


def make_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
