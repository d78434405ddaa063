"""Constrained decoding: `response_format` (json_object, json_schema) and `tool_choice` ("required"
or a named function), compiled to llguidance grammars over the model's own tokenizer. An object
that lists its properties admits no others unless it says so (`closed`), as in vLLM.

A constrained row samples from the allowed tokens only, but the logprob it reports is still the
sampled token's under softmax(logits / T) before the mask, the same distribution the trainer
recomputes (invariant 2): a mask is a truncation, like top-p.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

from server.chat.format import ChatFormat


class ConstraintError(ValueError):
    """The constraint cannot be honoured for this model (a 400 naming the parameter)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    grammar: str  # an llguidance grammar
    what: str  # for error messages: "response_format" or "tool_choice"


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


def _tool_grammar(chat: ChatFormat, tools: list[Any], parallel: bool) -> str:
    parser = chat.tool_parser.name
    if parser == "hermes":
        call = f'{_token(chat, "<tool_call>")} "\\n" %json {json.dumps(_call_schema(tools, "name", "arguments"))} ' \
               f'"\\n" {_token(chat, "</tool_call>")}'
        more = ' ("\\n" call)*' if parallel else ""
        return f"start: call{more}\ncall: {call}\n"
    if parser == "llama3_json":
        return f"start: %json {json.dumps(_call_schema(tools, 'name', 'parameters'))}\n"
    if parser == "mistral":
        schema = {"x-guidance": JSON_STYLE, "type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  "items": _call_schema(tools, "name", "arguments")}
        return f'start: {_token(chat, "[TOOL_CALLS]")} %json {json.dumps(schema)}\n'
    raise ConstraintError(f"tool_choice 'required' or a named function is not supported for the {parser!r} "
                          f"tool-call format", "tool_choice")


def constraint_for(chat: ChatFormat, response_format: Any, tool_choice: Any, tools: list[Any] | None,
                   parallel_tool_calls: bool = True) -> Constraint | None:
    import llguidance

    if tool_choice == "required" or (tool_choice is not None and not isinstance(tool_choice, str)):
        chosen = [t for t in tools or [] if isinstance(tool_choice, str)
                  or t.function.name == tool_choice.function.name]
        grammar = llguidance.LLMatcher.grammar_from_lark(_tool_grammar(chat, chosen, parallel_tool_calls))
        what = "tool_choice"
    elif response_format is not None and response_format.type != "text":
        json_schema = response_format.type == "json_schema"
        schema = closed(response_format.json_schema.schema_) if json_schema else {"type": "object"}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        except ValueError as e:
            raise ConstraintError(f"response_format: {e}", "response_format")
        what = "response_format"
    else:
        return None
    error = llguidance.LLMatcher.validate_grammar(grammar, _ll_tokenizer(chat))
    if error:
        raise ConstraintError(f"{what}: cannot be honoured: {error.splitlines()[0][:300]}", what)
    return Constraint(grammar, what)


class ConstraintState:
    """One sequence's progress through its grammar."""

    def __init__(self, chat: ChatFormat, constraint: Constraint):
        import llguidance

        self.tokenizer = _ll_tokenizer(chat)
        self.matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar)
        self.stop_ids = sorted(chat.stop_ids)

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
        if not mask.any():
            mask[self.stop_ids] = True
        return mask

    def advance(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
