"""A sampled sequence as an OpenAI choice, with what training needs beside OpenAI's shape:
`token_ids` (vLLM's `return_token_ids` convention), per-token logprobs at the sampling
temperature in `logprobs.content` (always, not only when asked), `sampling` (how it was
sampled), and `malformed_tool_call` when the model wrote a call that could not be parsed.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable

from server.chat.format import ChatFormat, assistant_message
from server.chat.sampled_turns import SampledTurn, fingerprint
from server.chat.tool_calls import ToolSchemas
from server.engine.base import DecodeSequence
from server.engine.sampling import SamplingParams
from server.model.host import ModelHost
from server.sampling.served_names import Policy


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (one printable character per byte), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _token_bytes(host: ModelHost, token_id: int, text: str) -> list[int]:
    """A token's own bytes. A byte-level token may hold part of a UTF-8 character, which its text
    shows as U+FFFD; OpenAI's `bytes` exist so a client can join such tokens back into one."""
    tok = host.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if (backend is not None and type(backend.decoder).__name__ == "ByteLevel"
            and token_id not in tok.added_tokens_decoder):
        piece = tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
    return list(text.encode("utf-8", errors="replace"))


def token_name(token_id: int, text: str, as_id: bool) -> str:
    """A token as logprobs name it: its text, or vLLM's "token_id:<id>" (`return_tokens_as_token_ids`),
    which a client maps back to the exact id where several tokens share one text."""
    return f"token_id:{token_id}" if as_id else text


def _logprob(host: ModelHost, token_id: int, logprob: float, as_id: bool) -> dict[str, Any]:
    text = host.tokenizer.decode([token_id])
    return {"token": token_name(token_id, text, as_id), "logprob": logprob, "bytes": _token_bytes(host, token_id, text)}


def logprob_entries(host: ModelHost, ids: list[int], logprobs: list[float],
                    tops: list[list[tuple[int, float]]] | None, as_ids: bool = False) -> list[dict[str, Any]]:
    return [{**_logprob(host, t, lp, as_ids), "top_logprobs": [_logprob(host, i, v, as_ids) for i, v in top or []]}
            for t, lp, top in zip(ids, logprobs, tops or [None] * len(ids))]


def sampling_info(host: ModelHost, policy: Policy, params: SamplingParams, prompt_ids: list[int],
                  chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    info = {"temperature": params.temperature, "top_p": params.top_p,
            "logprob_temperature": params.logprob_temperature, "policy": policy.name, "step": policy.step,
            "prompt_fingerprint": fingerprint(prompt_ids), "prompt_len": len(prompt_ids),
            "model_fingerprint": host.fingerprint}
    if chat_template_kwargs:
        info["chat_template_kwargs"] = chat_template_kwargs
    return info


def output_text(chat: ChatFormat, seq: DecodeSequence) -> str:
    text = chat.text(seq.token_ids)
    return text[: seq.stop_text_end] if seq.stop_text_end is not None else text


def message_and_finish(chat: ChatFormat, seq: DecodeSequence, tools: ToolSchemas | None
                       ) -> tuple[dict[str, Any], str, bool]:
    parsed = chat.parse(output_text(chat, seq), tools)
    finish = seq.finish_reason or "stop"
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    return assistant_message(parsed), finish, parsed.malformed


def remember(chat: ChatFormat, message: dict[str, Any], seq: DecodeSequence, sampling: dict[str, Any]) -> None:
    """The turn as sampled, so the next prompt can splice its exact ids and a training job can
    recover them from a choice that lost them."""
    record = {"logprobs": list(seq.logprobs), "sampling": sampling}
    chat.turns.remember(message, SampledTurn(tuple(seq.token_ids), record))


def build_choice(host: ModelHost, seq: DecodeSequence, sampling: dict[str, Any], tools: ToolSchemas | None,
                 tokens_as_ids: bool = False) -> dict[str, Any]:
    message, finish, malformed = message_and_finish(host.chat, seq, tools)
    remember(host.chat, message, seq, sampling)
    logprobs = logprob_entries(host, seq.token_ids, seq.logprobs, seq.top_logprobs, tokens_as_ids)
    choice = {"index": seq.index, "message": message, "finish_reason": finish, "logprobs": {"content": logprobs},
              "token_ids": list(seq.token_ids), "sampling": sampling}
    if malformed:
        choice["malformed_tool_call"] = True
    return choice


def content_logprobs(text_of: Callable[[list[int]], str], choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The logprob entries of the tokens that wrote the message's text (OpenAI Responses'
    `output_text.logprobs`), where the sample also holds reasoning, tool calls and markup: the
    tokens from the first whose prefix, as `text_of` writes it, reaches into the text, to the first
    whose prefix covers it. Where the parser rewrote the text so that it is not found, every token's."""
    ids, entries, message = choice["token_ids"], choice["logprobs"]["content"], choice["message"]
    content, reasoning = message.get("content") or "", message.get("reasoning_content") or ""
    if not content:
        return []
    full = text_of(ids)
    thought = full.find(reasoning) + len(reasoning) if reasoning and reasoning in full else 0
    start = full.find(content, thought)  # the text comes after the reasoning, which may quote it
    if start < 0:
        return list(entries)

    def written(k: int) -> int:  # characters tokens 0..k write; a prefix's text only grows, so both ends bisect
        return len(text_of(ids[: k + 1]))

    first = bisect.bisect_right(range(len(ids)), start, key=written)
    last = bisect.bisect_left(range(len(ids)), start + len(content), key=written)
    return list(entries[first: last + 1])
