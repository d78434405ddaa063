"""Messages -> prompt token ids, the one place a conversation becomes tokens.

The format is ChatML with Qwen2.5's tool conventions (tools in the system turn, calls as
`<tool_call>{json}</tool_call>`, results as `<tool_response>` inside a user turn). The same
function renders prompts for sampling and rebuilds them for training, which is what makes
training token-exact (invariant 1): an assistant turn this server sampled is spliced in as its
exact sampled ids, never re-tokenized from its text.

`CHAT_TEMPLATE` is the Jinja equivalent, written into the tokenizer so other tools (transformers'
`apply_chat_template`, vLLM) render the same text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from server.chat.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)
GENERATION_PROMPT = "<|im_start|>assistant\n"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_POSTAMBLE + "<|im_end|>\n") + " }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class RenderError(ValueError):
    """The messages cannot form a prompt (bad order, missing fields). Maps to a 400."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class SampledTurn:
    """An assistant turn exactly as sampled: the ids after the generation prompt."""

    token_ids: tuple[int, ...]


# Finds the sampled ids of an assistant message this server generated, or None.
TurnLookup = Callable[[dict[str, Any]], "SampledTurn | None"]


def canonical_arguments(arguments: Any) -> str:
    """Arguments as rendered: a JSON object text. OpenAI clients send a JSON string."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # rendered verbatim; the model sees what the client sent
        return json.dumps(parsed, ensure_ascii=False)
    return json.dumps(arguments, ensure_ascii=False)


def _rendered_arguments(arguments: Any) -> str:
    """As CHAT_TEMPLATE (and Qwen2.5's) renders them: a string verbatim, anything else as JSON."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def assistant_turn_key(message: dict[str, Any]) -> str:
    """Identity of an assistant turn by what a client echoes back: its text and tool calls."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append([fn.get("name"), canonical_arguments(fn.get("arguments", {}))])
    payload = json.dumps([message.get("content") or "", calls], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def fingerprint(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:24]


def _content_text(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RenderError(f"messages[{index}].content: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RenderError(f"messages[{index}].content must be a string or a list of text parts")


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Reject conversations no chat model was trained on, with a message that says where."""
    if not messages:
        raise RenderError("messages must not be empty")
    pending_tool_ids: set[str] = set()
    awaiting_results = False  # the previous turn was an assistant tool call or one of its results
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RenderError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RenderError(f"messages[{i}].role must be one of system, user, assistant, tool (got {role!r})")
        _content_text(m, i)
        if role in ("system", "developer") and i != 0:
            raise RenderError(f"messages[{i}]: a system message may only come first")
        if role == "tool":
            if not awaiting_results:
                raise RenderError(f"messages[{i}]: a tool message must follow an assistant message with tool_calls")
            call_id = m.get("tool_call_id")
            if pending_tool_ids and call_id not in pending_tool_ids:
                raise RenderError(f"messages[{i}].tool_call_id {call_id!r} does not match a preceding tool call")
            if not isinstance(m.get("content"), (str, list)):
                raise RenderError(f"messages[{i}]: a tool message needs string content")
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise RenderError(f"messages[{i}].tool_calls must be a list")
            pending_tool_ids = set()
            awaiting_results = bool(calls)
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RenderError(f"messages[{i}].tool_calls[{j}] needs function.name")
                if call.get("id"):
                    pending_tool_ids.add(call["id"])
        else:
            pending_tool_ids = set()
            awaiting_results = False
    if messages[-1].get("role") == "assistant" and messages[-1].get("tool_calls"):
        raise RenderError("the last message is an assistant tool call: its tool results must follow")


def render_text(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, add_generation_prompt: bool) -> str:
    """The prompt as text (no splicing). Used for tokenizer training and template tests."""
    return "".join(p if isinstance(p, str) else "" for p in _pieces(messages, tools, add_generation_prompt, lambda m: None))


def _pieces(messages, tools, add_generation_prompt, lookup: TurnLookup, im_end_id: int | None = None) -> list[str | SampledTurn]:
    out: list[str | SampledTurn] = []
    first = messages[0] if messages else {}
    has_system = first.get("role") in ("system", "developer")
    if tools:
        system = _content_text(first, 0) if has_system else DEFAULT_SYSTEM
        tool_lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        out.append(f"<|im_start|>system\n{system}{TOOLS_PREAMBLE}{tool_lines}{TOOLS_POSTAMBLE}<|im_end|>\n")
    elif has_system:
        out.append(f"<|im_start|>system\n{_content_text(first, 0)}<|im_end|>\n")
    n = len(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        if i == 0 and has_system:
            continue
        if role == "user":
            out.append(f"<|im_start|>user\n{_content_text(m, i)}<|im_end|>\n")
        elif role == "assistant":
            sampled = lookup(m)
            if sampled is not None:
                out.append(GENERATION_PROMPT)
                out.append(sampled)
                if not sampled.token_ids or sampled.token_ids[-1] != im_end_id:
                    out.append(IM_END)  # a turn cut by max_tokens is closed the same way every time
                out.append("\n")
                continue
            calls = m.get("tool_calls") or []
            content = _content_text(m, i)
            if not calls:  # as CHAT_TEMPLATE: a plain turn keeps its newline even when empty
                out.append(f"<|im_start|>assistant\n{content}<|im_end|>\n")
                continue
            text = "<|im_start|>assistant"
            if content:
                text += "\n" + content
            for call in calls:
                fn = call["function"]
                text += f'\n<tool_call>\n{{"name": "{fn["name"]}", "arguments": {_rendered_arguments(fn.get("arguments", {}))}}}\n</tool_call>'
            out.append(text + "<|im_end|>\n")
        elif role == "tool":
            text = "<|im_start|>user" if i == 0 or messages[i - 1]["role"] != "tool" else ""
            text += f"\n<tool_response>\n{_content_text(m, i)}\n</tool_response>"
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                text += "<|im_end|>\n"
            out.append(text)
    if add_generation_prompt:
        out.append(GENERATION_PROMPT)
    return out


class Renderer:
    """Renders conversations to token ids for one tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        if self.im_end_id is None or self.im_end_id == tokenizer.unk_token_id:
            raise ValueError("the tokenizer has no <|im_end|> token: only ChatML models are supported")
        self.im_start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
        # Tool-call tags may be registered as special tokens (they are in the embedded tokenizer);
        # decoding with skip_special_tokens would then erase every tool call from the output.
        self.kept_tag_ids = {i: t for t in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
                             if isinstance(i := tokenizer.convert_tokens_to_ids(t), int)
                             and i != tokenizer.unk_token_id and tokenizer.convert_ids_to_tokens(i) == t}

    def output_text(self, ids: Sequence[int]) -> str:
        """Sampled ids as the text a client sees: control tokens dropped, tool-call tags kept."""
        if not self.kept_tag_ids.keys() & set(ids):
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
        text, run = "", []
        for i in ids:
            if i in self.kept_tag_ids:
                text += self.tokenizer.decode(run, skip_special_tokens=True) + self.kept_tag_ids[i]
                run = []
            else:
                run.append(i)
        return text + self.tokenizer.decode(run, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        lookup: TurnLookup = lambda m: None,
    ) -> list[int]:
        ids: list[int] = []
        text = ""
        for piece in _pieces(messages, tools, add_generation_prompt, lookup, self.im_end_id):
            if isinstance(piece, str):
                text += piece
                continue
            ids += self.encode(text)
            text = ""
            ids += list(piece.token_ids)
        ids += self.encode(text)
        return ids
