"""A model's chat format: its template, how its turns end, and how its output is parsed.

Built once per served model from the tokenizer (or `--chat-template`), with the tool-call and
reasoning parsers chosen from the template unless named (`--tool-call-parser`,
`--reasoning-parser`, vLLM's names).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from server.chat.parsers import (ReasoningParser, detect_reasoning_parser, detect_tool_parser, make_reasoning_parser,
                                 make_tool_parser)
from server.chat.render import Renderer
from server.chat.sampled_turns import SampledTurns
from server.chat.template import PROBE_TOOL, ChatTemplate, TemplateError
from server.chat.tool_calls import ParsedOutput, ToolParser, ToolSchemas

log = logging.getLogger("artisan.chat")


def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", []) or []) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}


class StopTokenError(SystemExit):
    """A `--stop-token` text that is not one token of the model's vocabulary: the engines stop on ids."""


def stop_token_id(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise StopTokenError(f"--stop-token {text!r} is {len(ids)} tokens of this model's vocabulary {pieces}, "
                             "not one: give the text of a single token")
    return ids[0]


@dataclass
class ChatFormat:
    template: ChatTemplate
    renderer: Renderer
    tool_parser: ToolParser
    reasoning_parser: ReasoningParser | None
    stop_ids: set[int]
    turns: SampledTurns  # what this server sampled, and which sampling a message is
    kept_ids: dict[int, str]  # control tokens the parsers read, kept when decoding

    @classmethod
    def build(cls, tokenizer: Any, template_source: str | None = None, tool_parser: str = "auto",
              reasoning_parser: str = "auto", eos_ids: Iterable[int] = (),
              template_kwargs: dict[str, Any] | None = None, stop_tokens: Iterable[str] = ()) -> "ChatFormat":
        template = ChatTemplate(tokenizer, template_source, template_kwargs)
        tool_name = detect_tool_parser(template.source) if tool_parser == "auto" else tool_parser
        reasoning_name = detect_reasoning_parser(template.source) if reasoning_parser == "auto" else reasoning_parser
        stop_ids = {i for i in [*eos_ids, *(stop_token_id(tokenizer, text) for text in stop_tokens),
                                tokenizer.eos_token_id, cls._turn_end_id(tokenizer, template)]
                    if isinstance(i, int) and i >= 0}
        tools, reasoning = make_tool_parser(tool_name), make_reasoning_parser(reasoning_name)
        markers = set(tools.tags) | set(reasoning.markers if reasoning else ())
        special = _special_ids(tokenizer)
        kept = {i: t for t in markers if isinstance(i := tokenizer.convert_tokens_to_ids(t), int) and i in special
                and tokenizer.convert_ids_to_tokens(i) == t}
        log.info("chat format: tool-call parser %s, reasoning parser %s, stop ids %s, tools rendered: %s", tool_name,
                 reasoning_name, sorted(stop_ids), template.renders_tools)
        renderer = Renderer(template, stop_ids)
        return cls(template, renderer, tools, reasoning, stop_ids, SampledTurns(renderer), kept)

    @staticmethod
    def _turn_end_id(tokenizer: Any, template: ChatTemplate) -> int | None:
        """The special token that closes an assistant turn in this template (`<|im_end|>`,
        `<|eot_id|>`, `<end_of_turn>`): the model must stop there even when its config's EOS differs."""
        ids = tokenizer.encode(template.format.turn_end, add_special_tokens=False) if template.format.turn_end else []
        return ids[0] if ids and ids[0] in _special_ids(tokenizer) else None

    # ---- output ----------------------------------------------------------------------------
    def text(self, ids: Sequence[int]) -> str:
        """Sampled ids as text: the closing stop token and other control tokens dropped, the
        markers the parsers read (tool-call tags, `[TOOL_CALLS]`, `<think>`) kept."""
        tok = self.template.tokenizer
        ids = list(ids[:-1] if ids and ids[-1] in self.stop_ids else ids)
        if not self.kept_ids.keys() & set(ids):
            return tok.decode(ids, skip_special_tokens=True)
        text, run = "", []
        for i in ids:
            if i in self.kept_ids:
                text += tok.decode(run, skip_special_tokens=True) + self.kept_ids[i]
                run = []
            else:
                run.append(i)
        return text + tok.decode(run, skip_special_tokens=True)

    @property
    def reasoning_opened(self) -> bool:
        """The generation prompt opens the reasoning block itself (the output starts inside it)."""
        p = self.reasoning_parser
        prompt = self.template.format.generation_prompt
        return p is not None and p.start in prompt and p.end not in prompt.split(p.start)[-1]

    @functools.cached_property
    def call_frame(self) -> tuple[str, int | None]:
        """How the template writes a tool call that has no content, as a forced call must be
        sampled for the next prompt to extend the one it was sampled after: the text between the
        generation prompt and the call (GLM's empty think block), and the stop token after it
        (GLM's `<|observation|>`, where its answers end on `<|user|>`)."""
        user = [{"role": "user", "content": "hi"}]
        call = {"id": "probe0001", "type": "function", "function": {"name": PROBE_TOOL["function"]["name"],
                                                                    "arguments": {"q": "x"}}}
        # With its result after it, as the next prompt has it (Qwen3's shows an empty think block
        # in a last turn only).
        loop = [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "probe0001",
                                                               "content": "ok"}]
        try:
            prompt = self.template.render(user, [PROBE_TOOL], True)
            turn = self.template.render(user + loop, [PROBE_TOOL], True)
        except TemplateError:
            return "", None
        after = turn[len(prompt):] if turn.startswith(prompt) else ""
        start = self.tool_parser.starts_call(after)
        if start is None:
            return "", None
        stop = next((i for i in self.renderer.encode(after[start:]) if i in self.stop_ids), None)
        return after[:start], stop

    def parse(self, text: str, tools: ToolSchemas | None) -> ParsedOutput:
        """`tools`: the request's tools when it lets the model call them, else None."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.split(text, self.reasoning_opened)
        parsed = self.tool_parser.parse(text, tools) if tools is not None else ParsedOutput(content=text)
        parsed.reasoning = parsed.reasoning or reasoning
        return parsed


def assistant_message(parsed: ParsedOutput) -> dict[str, Any]:
    """The OpenAI assistant message of a parsed output."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    return message
