"""Messages -> prompt token ids: the one place a conversation becomes tokens (invariant 1).

The model's own template renders the conversation; the tokenizer encodes it. An assistant turn
this server sampled is spliced in as its exact sampled ids instead of being re-tokenized from its
text, so the next prompt contains exactly what the model produced; which sampling a turn is, is
decided in server/chat/sampled_turns.py. The same function builds prompts for sampling and
rebuilds them for training, which is what makes training token-exact.

A template may rewrite history: Qwen3's drops the reasoning of turns before the latest user
message, gpt-oss's drops the analysis channel. When the template's rendering of a sampled turn
is a proper suffix of what was sampled (something visible was dropped), the prompt follows the
template and the turn is counted as rewritten; the next prompt then no longer extends the one the
turn was sampled from, and training gives each such turn a sequence of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from server.chat.template import SENTINEL, ChatTemplate, TemplateError


@dataclass
class RenderedPrompt:
    ids: list[int]
    spliced_turns: int = 0
    rewritten_turns: int = 0
    # Per assistant message index: whether its sampled ids went in verbatim.
    spliced: dict[int, bool] = field(default_factory=dict)
    # Per assistant message index spliced verbatim: where its sampled ids start in `ids`, which is
    # where the prompt it was sampled after ends when the template extends by appending.
    offsets: dict[int, int] = field(default_factory=dict)


@dataclass
class _Splice:
    index: int  # position of the assistant message in the conversation
    ids: Sequence[int]  # what was sampled
    body: str = ""  # the template's rendering of the turn's content


class Renderer:
    """Renders conversations to token ids for one tokenizer and template."""

    def __init__(self, template: ChatTemplate, stop_ids: set[int]):
        self.template = template
        self.tokenizer = template.tokenizer
        self.stop_ids = stop_ids
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        # The Rust tokenizer directly: thread-safe, and what apply_chat_template's encoding amounts to.
        self._encode = ((lambda text: backend.encode(text, add_special_tokens=False).ids) if backend is not None
                        else (lambda text: self.tokenizer.encode(text, add_special_tokens=False)))

    def encode(self, text: str) -> list[int]:
        return self._encode(text) if text else []

    def text(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, kwargs: dict[str, Any] | None = None) -> str:
        return self.template.render(messages, tools, add_generation_prompt, kwargs)

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, *, kwargs: dict[str, Any] | None = None,
               sampled_ids: Mapping[int, Sequence[int]] | None = None) -> RenderedPrompt:
        """The conversation as token ids; `sampled_ids` gives, by message index, the ids an
        assistant turn was sampled as (server/chat/sampled_turns.py decides which turn is which)."""
        text = self.text(messages, tools, add_generation_prompt, kwargs)
        splices = [_Splice(i, ids) for i, ids in sorted((sampled_ids or {}).items())
                   if messages[i].get("role") == "assistant"]
        if not splices:
            return RenderedPrompt(self.encode(text))
        pieces = (self._pieces(messages, tools, add_generation_prompt, kwargs, text, splices)
                  or self._pieces_by_prefix(messages, tools, kwargs, text, splices))
        if pieces is None:  # the template renders the probes unlike the turns: no splicing at all
            return RenderedPrompt(self.encode(text), rewritten_turns=len(splices),
                                  spliced={s.index: False for s in splices})
        return self._assemble(pieces, splices)

    def _pieces(self, messages, tools, add_generation_prompt, kwargs, text: str,
                splices: list[_Splice]) -> list[str] | None:
        """The rendered text around each sampled turn: len(splices) + 1 pieces, filling in each
        splice's `body` with the template's own rendering of that turn. None if the text cannot be
        cut that way (the probe changed more than the turn itself)."""
        probe = list(messages)
        for k, s in enumerate(splices):
            probe[s.index] = {"role": "assistant", "content": SENTINEL.format(k + 1)}
        try:
            marked = self.text(probe, tools, add_generation_prompt, kwargs)
        except TemplateError:  # the template refuses a turn without its tool calls (gpt-oss)
            return None
        pieces, rest, gap = [], marked, self.template.format.gap
        for k in range(len(splices)):
            before, found, rest = rest.partition(SENTINEL.format(k + 1))
            if not found:
                return None
            # The sampler's prompt ended at the generation prompt: the model wrote the gap itself.
            pieces.append(self._to_generation_prompt(before[: -len(gap)] if gap and before.endswith(gap) else before))
        pieces.append(rest)
        pos = 0
        for k, s in enumerate(splices):
            if not text.startswith(pieces[k], pos):
                return None
            pos += len(pieces[k])
            end = text.find(pieces[k + 1], pos) if k + 1 < len(splices) else len(text) - len(pieces[-1])
            if end < pos or (k + 1 == len(splices) and not text.endswith(pieces[-1])):
                return None
            s.body, pos = text[pos:end], end
        return pieces

    def _pieces_by_prefix(self, messages, tools, kwargs, text: str, splices: list[_Splice]) -> list[str] | None:
        """`_pieces` where the template renders a turn of text unlike a turn of calls (Gemma 4 writes
        a tool's result inside the calling turn): each turn begins where the prompt it was sampled
        after ends, and ends where the conversation through it, rendered alone, parts from `text`
        (less the template's end of turn, which the sampled stop token stands for). Two renders a
        turn, where `_pieces` takes one in all."""
        pieces, pos, end_of_turn = [], 0, self.template.format.turn_end
        for s in splices:
            try:
                before = self.text(messages[: s.index], tools, True, kwargs)
                through = self.text(messages[: s.index + 1], tools, False, kwargs)
            except TemplateError:
                return None
            if len(before) < pos or not (text.startswith(before) and through.startswith(before)):
                return None
            end = len(before)
            while end < min(len(text), len(through)) and text[end] == through[end]:
                end += 1
            # What ends the turn is the sampled stop token's: the template's end of turn, or the token
            # itself where the template writes it as it goes on (Gemma 4's <|tool_response>).
            stop = self.tokenizer.decode([s.ids[-1]]) if s.ids and s.ids[-1] in self.stop_ids else ""
            for closing in (end_of_turn, stop):
                if closing and end - len(closing) >= len(before) and text.startswith(closing, end - len(closing)):
                    end -= len(closing)
            pieces.append(text[pos:len(before)])
            s.body, pos = text[len(before):end], end
        return [*pieces, text[pos:]]

    def _to_generation_prompt(self, before: str) -> str:
        """The text before a turn, cut back to where its generation prompt ends, where the template
        writes more that the model samples itself: Qwen3.5 closes the think block its prompt opens,
        GLM writes an empty one, and a turn's own reasoning stands there. Not past a stop token or
        a turn's end: then the turn has no such header (Qwen3.5's answered turns leave it out)."""
        prompt, end = self.template.format.generation_prompt, self.template.format.turn_end.strip()
        at = before.rfind(prompt) if prompt else -1
        tail = before[at + len(prompt):] if at >= 0 else ""
        if not tail or (end and end in tail) or self.stop_ids & set(self.encode(tail)):
            return before
        return before[: at + len(prompt)]

    def _assemble(self, pieces: list[str], splices: list[_Splice]) -> RenderedPrompt:
        out = RenderedPrompt([])
        carry = ""  # a special token's text that precedes the next piece in the real text
        for k, s in enumerate(splices):
            out.ids += self._encode_after(carry, pieces[k])
            sampled = list(s.ids)
            ends = bool(sampled) and sampled[-1] in self.stop_ids
            end_text = self.tokenizer.decode([sampled[-1]]) if ends else ""
            said = self.tokenizer.decode(sampled[:-1] if ends else sampled)
            closes = not ends or pieces[k + 1].startswith(end_text)
            body = s.body.strip()
            dropped = len(body) < len(said) and said.endswith(body) and said[:len(said) - len(body)].strip()
            if closes and not dropped:
                out.offsets[s.index] = len(out.ids)
                out.ids += sampled
                carry = end_text
                pieces[k + 1] = pieces[k + 1][len(end_text):]
                out.spliced_turns += 1
                out.spliced[s.index] = True
            else:
                out.ids += self.encode(s.body)
                carry = ""
                out.rewritten_turns += 1
                out.spliced[s.index] = False
        out.ids += self._encode_after(carry, pieces[-1])
        return out

    def _encode_after(self, special: str, text: str) -> list[int]:
        """`text` encoded as it is when it follows the special token `special` in a prompt: a
        tokenizer that marks the start of its input (SentencePiece's leading space) must not."""
        if not special:
            return self.encode(text)
        ids = self.encode(special + text)
        lead = self.encode(special)
        return ids[len(lead):] if ids[:len(lead)] == lead else self.encode(text)
