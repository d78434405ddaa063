"""Constrained decoding: `response_format` (json_object, json_schema), `tool_choice` ("required"
or a named function) and vLLM's `structured_outputs` (a schema, a regex, choices or a lark grammar),
compiled to llguidance grammars over the model's own tokenizer. An object that lists its properties
admits no others unless it says so (`closed`), as in vLLM.

A constrained row samples from the allowed tokens only, but the logprob it reports is still the
sampled token's under softmax(logits / T) before the mask, the same distribution the trainer
recomputes (invariant 2): a mask is a truncation, like top-p.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from server.chat.format import ChatFormat
from server.chat.parsers import schema_types


class ConstraintError(ValueError):
    """The constraint cannot be honoured for this model (a 400 naming the parameter)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    grammar: str  # an llguidance grammar
    what: str  # for error messages: "response_format" or "tool_choice"
    stop: int | None = None  # the one stop token the turn may end on (a forced call's, as its template has it)


_TOKENIZERS: dict[int, Any] = {}
_LOCK = threading.Lock()


def _ll_tokenizer(chat: ChatFormat) -> Any:
    """llguidance's view of the tokenizer, built once (about a second for a 150k vocabulary)."""
    import llguidance.hf

    with _LOCK:
        key = id(chat)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = llguidance.hf.from_tokenizer(chat.template.tokenizer, eos_token=sorted(chat.stop_ids))
        return _TOKENIZERS[key]


def _token(chat: ChatFormat, text: str) -> str:
    """A marker in lark: the tokenizer's own token for it where it has one (an added token, as
    Qwen's `<tool_call>` is: llguidance never spells those out of bytes), else the text."""
    tok = chat.template.tokenizer
    i = tok.convert_tokens_to_ids(text)
    # An unknown token maps to the unknown id, an added token too in SmolLM2 (<|endoftext|>): the
    # id must spell the marker back, or the grammar writes a control token where the marker goes.
    if isinstance(i, int) and i in getattr(tok, "added_tokens_decoder", {}) and tok.convert_ids_to_tokens(i) == text:
        return f"<[{i}]>"
    return json.dumps(text)


def _literal(chat: ChatFormat, text: str) -> str:
    """`text` in lark, its added tokens (`</think>`) as tokens: llguidance spells none out of bytes."""
    added = sorted({t.content for t in getattr(chat.template.tokenizer, "added_tokens_decoder", {}).values()
                    if t.content and t.content in text}, key=len, reverse=True)
    if not added:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(map(re.escape, added)) + ")", text)
    return " ".join(_token(chat, p) for p in pieces if p)


# JSON as json.dumps writes it: no free whitespace to wander in, and the text a template's
# `tojson` renders a call back as, so the sampled turn is spliced into later prompts as it was.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# JSON Schema keywords whose values are schemas: one, a list, or a mapping of names to them.
_SUBSCHEMA = ("items", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
              "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object that lists its properties and
    says nothing of any others, as xgrammar and outlines read a schema (and so vLLM by default):
    the model is held to the keys it was given. Left open, a small model under a schema wanders into
    keys of its own until max_tokens (the embedded model's `{"price": 7304467, "...._grade has"`)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def _call_schema(tools: list[Any], name_key: str, args_key: str) -> dict[str, Any]:
    options = [{"type": "object", "additionalProperties": False, "required": [name_key, args_key],
                "properties": {name_key: {"const": t.function.name},
                               args_key: closed(t.function.parameters or {"type": "object"})}} for t in tools]
    return {"x-guidance": JSON_STYLE, **(options[0] if len(options) == 1 else {"anyOf": options})}


def _json_value(schema: Any) -> str:
    """A value as its JSON, held to its schema."""
    return f"%json {json.dumps({'x-guidance': JSON_STYLE, **closed(schema if isinstance(schema, dict) else {})})}"


def _text_value(schema: dict[str, Any], excluded: str = "<") -> str:
    """A string argument written as bare text: anything up to what closes it (`excluded`), as long
    as the schema lets it be."""
    longest = schema.get("maxLength")
    return f"/[^{excluded}]{{0,{int(longest)}}}/" if isinstance(longest, int) else f"/[^{excluded}]*/"


def _argument(schema: Any) -> str:
    """One argument's value where a format writes strings bare and anything else as its JSON."""
    schema = schema if isinstance(schema, dict) else {}
    if schema_types(schema) != {"string"}:
        return _json_value(schema)
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return f"({' | '.join(json.dumps(c) for c in choices)})"
    return _text_value(schema)


def _tagged_call(tool: Any, opening: str, argument: Callable[[str], str], closing: str) -> str:
    """A call written one argument at a time (Qwen3-Coder's XML, GLM's key/value tags), in lark:
    its required arguments, then whichever others, in the schema's order."""
    parameters = tool.function.parameters or {}
    required = set(parameters.get("required") or [])
    parts = [opening]
    for key, schema in (parameters.get("properties") or {}).items():
        one = f"{argument(key)} {_argument(schema)} {closing}"
        parts.append(one if key in required else f"({one})?")
    return " ".join(parts)


def _literal_call(tool: Any, opening: str, assign: str, comma: str, value: Callable[[str, dict[str, Any]], str],
                  closing: str, keys: Callable[[list[str]], list[str]] = list) -> str:
    """A call written as a literal of its required arguments, `key<assign>value` joined by `comma`
    (Gemma 4's `call:f{k:v,...}`, LFM2.5's `f(k=v, ...)`), in lark; `keys` orders them."""
    parameters = tool.function.parameters or {}
    properties, required = parameters.get("properties") or {}, set(parameters.get("required") or [])
    arguments = [f"{json.dumps(key + assign)} {value(key, properties[key])}"
                 for key in keys([k for k in properties if k in required])]
    return " ".join([json.dumps(opening), f" {json.dumps(comma)} ".join(arguments), json.dumps(closing)])


def _gemma4_value(quote: str, tool: Any) -> Callable[[str, dict[str, Any]], str]:
    """Gemma 4's argument values: a string between its quote tokens, a number or boolean bare."""
    def value(key: str, schema: dict[str, Any]) -> str:
        types = schema_types(schema)
        if types == {"string"}:
            return f"{quote} {_text_value(schema)} {quote}"
        if types == {"boolean"}:
            return '("true" | "false")'
        if types and types <= {"integer", "number"}:
            return _json_value(schema)
        raise ConstraintError(f"tool_choice: {tool.function.name}'s argument {key!r} cannot be forced in Gemma 4's "
                              f"format (strings, numbers and booleans can)", "tool_choice")
    return value


def _python_value(key: str, schema: dict[str, Any]) -> str:
    """LFM2.5's argument values: a string 'quoted' as its template quotes it (escaping nothing), a
    boolean as Python writes it, anything else as its JSON."""
    types = schema_types(schema)
    if types == {"string"}:
        return '"\'" ' + _text_value(schema, excluded="'\\n") + ' "\'"'
    return '("True" | "False")' if types == {"boolean"} else _json_value(schema)


def _tool_grammar(chat: ChatFormat, tools: list[Any], parallel: bool) -> str:
    """Lark for one or more calls to `tools`, written as the model's own template writes them."""
    parser, tag = chat.tool_parser.name, functools.partial(_token, chat)
    more = ' ("\\n" call)*' if parallel else ""
    if parser == "llama3_json":
        return f"start: %json {json.dumps(_call_schema(tools, 'name', 'parameters'))}\n"
    if parser == "mistral":
        schema = {"x-guidance": JSON_STYLE, "type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  "items": _call_schema(tools, "name", "arguments")}
        return f'start: {tag("[TOOL_CALLS]")} %json {json.dumps(schema)}\n'
    if parser == "hermes":
        body = f'"\\n" %json {json.dumps(_call_schema(tools, "name", "arguments"))} "\\n"'
    elif parser == "qwen3_coder":
        body = " | ".join(_tagged_call(t, json.dumps(f"\n<function={t.function.name}>\n"),
                                       lambda key: json.dumps(f"<parameter={key}>\n"), json.dumps("\n</parameter>\n"))
                          + ' "</function>\\n"' for t in tools)
    elif parser == "glm45":
        body = " | ".join(_tagged_call(t, json.dumps(f"{t.function.name}\n"),
                                       lambda key: f'{tag("<arg_key>")} {json.dumps(key)} {tag("</arg_key>")} "\\n" '
                                                   f'{tag("<arg_value>")}', f'{tag("</arg_value>")} "\\n"')
                          for t in tools)
    elif parser == "gemma4":  # keys sorted, as its template sorts them
        body = " | ".join(_literal_call(t, f"call:{t.function.name}{{", ":", ",", _gemma4_value(tag('<|"|>'), t),
                                        "}", sorted) for t in tools)
        call = f'{tag("<|tool_call>")} ({body}) {tag("<tool_call|>")}'
        return f"start: call{'+' if parallel else ''}\ncall: {call}\n"  # one call right after another
    elif parser == "lfm2":  # a pythonic list: [f(a='text', n=3), g()]
        more = ' (", " call)*' if parallel else ""
        call = " | ".join(_literal_call(t, f"{t.function.name}(", "=", ", ", _python_value, ")") for t in tools)
        return f'start: {tag("<|tool_call_start|>")} "[" call{more} "]" {tag("<|tool_call_end|>")}\ncall: {call}\n'
    else:
        raise ConstraintError(f"tool_choice 'required' or a named function is not supported for the {parser!r} "
                              f"tool-call format", "tool_choice")
    return f'start: call{more}\ncall: {tag("<tool_call>")} ({body}) {tag("</tool_call>")}\n'


def _json_grammar(schema: dict[str, Any] | None) -> str:
    """JSON that `schema` admits (its listed objects closed), or any object where there is none."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(closed(schema) if schema is not None else {"type": "object"},
                                                         defaults=JSON_STYLE)


def _structured_grammar(chat: ChatFormat, s: Any) -> str:
    """vLLM's structured outputs (server/sampling/chat_request.py's StructuredOutputs) as a grammar."""
    import llguidance

    if s.json_schema is not None or s.json_object:
        return _json_grammar(s.json_schema)
    if s.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(s.regex)
    if s.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_literal(chat, c) for c in s.choice))
    return llguidance.LLMatcher.grammar_from_lark(s.grammar)


def constraint_for(chat: ChatFormat, response_format: Any = None, tool_choice: Any = None,
                   tools: list[Any] | None = None, parallel_tool_calls: bool = True,
                   structured: Any = None) -> Constraint | None:
    """The grammar a request's output must follow, if any: a forced tool call, a response format,
    or vLLM's structured outputs (which a request gives alone)."""
    import llguidance

    if structured is not None:
        stop, what = None, "structured_outputs"
        try:
            grammar = _structured_grammar(chat, structured)
        except ValueError as e:
            raise ConstraintError(f"structured_outputs: {str(e).splitlines()[0][:300]}", what)
    elif tool_choice == "required" or (tool_choice is not None and not isinstance(tool_choice, str)):
        chosen = [t for t in tools or [] if isinstance(tool_choice, str)
                  or t.function.name == tool_choice.function.name]
        lark = _tool_grammar(chat, chosen, parallel_tool_calls)
        lead, stop = chat.call_frame  # GLM ends a call on <|observation|>, and an answer on <|user|>
        if lead:
            lark = lark.replace("start: ", f"start: {_literal(chat, lead)} ", 1)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        what = "tool_choice"
    elif response_format is not None and response_format.type != "text":
        stop = None
        try:
            grammar = _json_grammar(response_format.json_schema.schema_ if response_format.type == "json_schema"
                                    else None)
        except ValueError as e:
            raise ConstraintError(f"response_format: {e}", "response_format")
        what = "response_format"
    else:
        return None
    error = llguidance.LLMatcher.validate_grammar(grammar, _ll_tokenizer(chat))
    if error:
        raise ConstraintError(f"{what}: cannot be honoured: {error.splitlines()[0][:300]}", what)
    return Constraint(grammar, what, stop)


class ConstraintState:
    """One sequence's progress through its grammar."""

    def __init__(self, chat: ChatFormat, constraint: Constraint):
        import llguidance

        self.tokenizer = _ll_tokenizer(chat)
        self.matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar)
        self.stop_ids = sorted(chat.stop_ids) if constraint.stop is None else [constraint.stop]
        self.other_stops = sorted(chat.stop_ids - set(self.stop_ids))  # llguidance allows every EOS it was given

    def allowed(self, vocab: int) -> torch.Tensor:
        """A boolean mask over the model's vocabulary of the tokens the grammar allows next."""
        import llguidance.torch as lt

        mask = torch.zeros(vocab, dtype=torch.bool)
        if self.matcher.is_stopped() or self.matcher.is_error():
            mask[self.stop_ids] = True  # done (or lost): only the end of the turn is left
            return mask
        bits = lt.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        lt.fill_next_token_bitmask(self.matcher, bits)
        words = bits[0].to(torch.int64) & 0xFFFFFFFF
        flags = ((words[:, None] >> torch.arange(32)) & 1).bool().flatten()[: min(vocab, self.tokenizer.vocab_size)]
        mask[: flags.numel()] = flags
        mask[[i for i in self.other_stops if i < vocab]] = False
        if not mask.any():
            mask[self.stop_ids] = True
        return mask

    def advance(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
