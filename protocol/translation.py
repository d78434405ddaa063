"""The one set of rules that turns a Responses or Anthropic Messages request into chat terms.

art-server renders every API through the chat template, so a Responses request's input items
(messages, `function_call`, `function_call_output`, `reasoning`) and a Messages request's content
blocks (`text`, `tool_use`, `tool_result`, `thinking`) become the chat messages, tools and
`tool_choice` it renders. Two places need those messages: the server, to sample
(server/api/translate.py), and the client, to rebuild the prompts of exchanges openpipe-art
captured (client/adapters/art_exchanges.py). Training is token-exact only if both get the very
messages the server rendered, so both call these functions.

Plain dicts in, plain dicts out: the server passes its validated requests dumped, the client the
JSON it captured. A request the rules cannot make a conversation of raises `TranslationError`
naming the request's field; a missing required field is the caller's validation to catch (the
server's schemas, server/api/responses_schemas.py and messages_schemas.py). Whether the result
obeys chat's order rules (a tool result after its call, ...) is the renderer's to say; each
message's `origins` entry lets that verdict name the request's item rather than the chat message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from protocol.choices import Message


class TranslationError(ValueError):
    """A request whose items or blocks make no conversation; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass
class Translated:
    """Chat messages, each with the request field it came from."""

    messages: list[Message] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)


def text_of(parts: Any) -> str:
    """A string, or text parts or blocks read as the one string a template sees."""
    if isinstance(parts, str):
        return parts
    return "".join(p.get("text", "") for p in parts or [])


def _call(call_id: str, name: str, arguments: str) -> Message:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def responses_call(item: dict[str, Any]) -> Message:
    """A `function_call` item as chat's tool call."""
    return _call(item["call_id"], item["name"], item["arguments"])


def reasoning_text(item: dict[str, Any]) -> str:
    """A `reasoning` item's text: its full content where it kept it, else its summary."""
    return text_of(item.get("content") or item.get("summary"))


def anthropic_call(block: dict[str, Any]) -> Message:
    """A `tool_use` block as chat's tool call. Its input becomes the arguments string the template
    writes into the prompt, so every reader must serialise it alike (non-ASCII kept as is)."""
    return _call(block["id"], block["name"], json.dumps(block["input"], ensure_ascii=False))


class _Builder:
    """Chat messages in order; the consecutive pieces of one assistant turn (reasoning, text,
    calls) make one message, as a harness splits one sampled turn into several items or blocks."""

    def __init__(self, previous: Sequence[Message] = (), previous_origin: str = ""):
        self.out = Translated([dict(m) for m in previous], [previous_origin] * len(previous))
        self.turn: Message | None = None

    def add(self, message: Message, origin: str) -> None:
        self.turn = None
        self.out.messages.append(message)
        self.out.origins.append(origin)

    def assistant(self, origin: str) -> Message:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": None}
            self.out.messages.append(self.turn)
            self.out.origins.append(origin)
        return self.turn

    def append(self, origin: str, key: str, text: str) -> None:
        turn = self.assistant(origin)
        turn[key] = (turn.get(key) or "") + text

    def call(self, origin: str, call: Message) -> None:
        self.assistant(origin).setdefault("tool_calls", []).append(call)


# ---- Responses ----------------------------------------------------------------------------------

def responses_history(input_: str | Sequence[dict[str, Any]], previous: Sequence[Message] = ()) -> Translated:
    """The conversation a response continues: `previous` (the conversation of the response named by
    `previous_response_id`), then this request's `input`. Without the instructions, which a later
    `previous_response_id` does not carry on."""
    b = _Builder(previous, "previous_response_id")
    items = [{"role": "user", "content": input_}] if isinstance(input_, str) else input_
    for i, item in enumerate(items):
        where = "input" if isinstance(input_, str) else f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            b.append(where, "reasoning_content", reasoning_text(item))
        elif kind == "function_call":
            b.call(where, responses_call(item))
        elif kind == "function_call_output":
            b.add({"role": "tool", "tool_call_id": item["call_id"], "content": text_of(item["output"])}, where)
        elif kind != "message":
            raise TranslationError(where, f"item type {kind!r} is not one a chat template renders")
        elif item["role"] == "assistant":
            b.append(where, "content", text_of(item["content"]))
        else:
            role = "system" if item["role"] in ("system", "developer") else "user"
            b.add({"role": role, "content": text_of(item["content"])}, where)
    return b.out


def responses_conversation(instructions: str | None, history: Translated) -> Translated:
    """The history with the instructions in front: one system message, since a template renders
    only the first; the input's own system message follows them in it."""
    messages, origins = list(history.messages), list(history.origins)
    if instructions:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": instructions + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
            origins.insert(0, "instructions")
    return Translated(messages, origins)


def responses_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's nested ones. The key order is the one the server's
    FunctionSpec dumps (its fields, then any extra), since a template that writes tools with
    `tojson` puts it in the prompt."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn = {"name": t["name"], "description": t.get("description"), "parameters": t.get("parameters"),
              **{k: v for k, v in t.items() if k not in ("type", "strict", "name", "description", "parameters")}}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def responses_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


# ---- Anthropic Messages -------------------------------------------------------------------------

def anthropic_conversation(system: str | Sequence[dict[str, Any]] | None,
                           messages: Sequence[dict[str, Any]]) -> Translated:
    b = _Builder()
    if system:
        b.add({"role": "system", "content": text_of(system)}, "system")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(m["content"], str):
            if m["role"] == "assistant":
                b.append(where, "content", m["content"])
            else:
                b.add({"role": "user", "content": m["content"]}, where)
        elif m["role"] == "assistant":
            _assistant_blocks(b, m["content"], where)
        else:
            _user_blocks(b, m["content"], where)
    return b.out


def _assistant_blocks(b: _Builder, blocks: Sequence[dict[str, Any]], where: str) -> None:
    b.assistant(where)  # an assistant message of no blocks is still a turn
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            b.append(where, "content", block["text"])
        elif kind == "thinking":
            b.append(where, "reasoning_content", block["thinking"])
        elif kind == "tool_use":
            b.call(where, anthropic_call(block))
        elif kind == "tool_result":
            raise TranslationError(f"{where}.content[{j}]", "a tool_result block belongs in a user message")
        else:
            raise TranslationError(f"{where}.content[{j}]", f"block type {kind!r} is not one a chat template renders")


def _user_blocks(b: _Builder, blocks: Sequence[dict[str, Any]], where: str) -> None:
    """Tool results first, each a tool message, then the text as one user message: chat has no
    message that holds both, and a template renders a turn's results before what the user adds."""
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_result":
            if texts:
                raise TranslationError(f"{where}.content[{j}]", "tool_result blocks must come before the text")
            b.add({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text_of(block.get("content", ""))},
                  f"{where}.content[{j}]")
        elif kind == "text":
            texts.append(block["text"])
        elif kind in ("tool_use", "thinking"):
            raise TranslationError(f"{where}.content[{j}]", f"a {kind} block belongs in an assistant message")
        else:
            raise TranslationError(f"{where}.content[{j}]", f"block type {kind!r} is not one a chat template renders")
    if texts or not blocks:
        b.add({"role": "user", "content": "".join(texts)}, where)


def anthropic_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t["name"],
                                              **({"description": t["description"]} if t.get("description") else {}),
                                              "parameters": t["input_schema"]}} for t in tools]


def anthropic_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, True
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(choice["type"]) or \
        {"type": "function", "function": {"name": choice["name"]}}
    return chat, not choice.get("disable_parallel_tool_use", False)
