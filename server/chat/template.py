"""A model's own chat template, rendered exactly as transformers renders it.

The template is the tokenizer's (or one given with `--chat-template`), so the model sees the
format it was trained on; rendering goes through the tokenizer's `apply_chat_template`, so a
conversation renders here exactly as it does in transformers and vLLM. What the rest of the
server needs to know about the format (how an assistant turn ends, what the generation prompt
is) is read off the template by rendering probes, not written down per model family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

SENTINEL = "ARTISANPROBE{}Q"
# A tool no template prints by accident: the probe that tells whether a template shows tools at all.
PROBE_TOOL = {"type": "function", "function": {
    "name": "artisan_probe_tool", "description": "ARTISANPROBETOOLQ",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


class TemplateError(ValueError):
    """The template refused the conversation (its own raise_exception) or failed to render it."""


def json_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a mapping. OpenAI clients send them as a JSON string; templates
    expect a mapping (Llama's and Mistral's apply `tojson` to it). A string that is not a JSON
    object stays a string, and so does one nested past what the parser takes (requests refuse
    those where they arrive, protocol/nesting.py: this only keeps a render from raising)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def content_text(content: Any) -> str | None:
    """OpenAI content (a string, or a list of text parts) as the string templates expect."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: text content, tool-call arguments as mappings,
    server-side fields (token ids) dropped."""
    out = {k: v for k, v in message.items() if k != "token_ids" and v is not None}
    if "content" in out:
        out["content"] = content_text(out["content"])
    elif out.get("role") == "assistant":
        # A tool-call turn without content: templates that read `message.content` unguarded (SmolLM2's,
        # Phi-3's, DeepSeek-R1's) fail on a missing key, and all others render "" as they render none.
        out["content"] = ""
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call["function"],
                                  "arguments": json_arguments(call["function"].get("arguments", {}))}}
            for call in message["tool_calls"]]
    return out


@dataclass(frozen=True)
class TurnFormat:
    """How the template frames an assistant turn, read off two probe renderings."""

    generation_prompt: str  # what add_generation_prompt appends
    turn_end: str  # the text right after an assistant turn's content (e.g. "<|im_end|>\n")
    # What the template puts between the generation prompt and a turn's content, that the model
    # itself writes when sampling (Mistral's space after [/INST]: its tokens begin with "▁").
    gap: str = ""


class ChatTemplate:
    def __init__(self, tokenizer: Any, source: str | None = None, kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.source = source or tokenizer.chat_template
        if not self.source:
            raise TemplateError("the tokenizer has no chat template: pass one with --chat-template FILE (a base "
                                "model: examples/reasoning_gym/base_model.jinja renders a conversation as text)")
        if isinstance(self.source, dict):
            self.source = self.source.get("default") or next(iter(self.source.values()))
        self.kwargs = dict(kwargs or {})
        self.format = self._probe()
        self.renders_tools = self._renders_tools()

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               add_generation_prompt: bool, kwargs: dict[str, Any] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages], tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=self.source,
                **{**self.kwargs, **(kwargs or {})})
        except Exception as e:  # jinja's TemplateError, or the template's own raise_exception
            raise TemplateError(f"the chat template could not render this conversation: {e}") from e

    def _renders_tools(self) -> bool:
        """Whether a request's `tools` reach the model: many templates (SmolLM2's, Gemma 3's) never
        read the variable, and the tools would be dropped without a word."""
        user = [{"role": "user", "content": "hi"}]
        try:
            without = self.render(user, None, True)
            shown = self.render(user, [PROBE_TOOL], True)
        except TemplateError:
            return False
        return shown != without and PROBE_TOOL["function"]["name"] in shown

    def _probe(self) -> TurnFormat:
        user = [{"role": "user", "content": "hi"}]
        with_prompt = self.render(user, None, True)
        without = self.render(user, None, False)
        convo = self.render(user + [{"role": "assistant", "content": SENTINEL.format(0)}], None, False)
        generation_prompt = with_prompt[len(without):] if with_prompt.startswith(without) else ""
        before, _, after = convo.partition(SENTINEL.format(0))
        header = before[len(without):] if before.startswith(without) else ""
        gap = header[len(generation_prompt):] if header.startswith(generation_prompt) else ""
        return TurnFormat(generation_prompt, after, gap if gap.isspace() else "")
