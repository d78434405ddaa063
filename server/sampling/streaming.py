"""Server-sent events in OpenAI's chunk format.

Every chunk carries its new `token_ids` and logprobs (vLLM's `return_token_ids` convention); the
first carries `prompt_token_ids`, the last the `sampling` record. Reasoning streams as
`delta.reasoning_content`. Text that may be the start of a tool call (or of a stop string, or a
tag) is held back; a parsed tool call is sent whole as `delta.tool_calls` when the choice ends.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from server.chat.format import ChatFormat
from server.chat.tool_calls import ToolSchemas
from server.engine.base import DecodeSequence, GenRequest, ReplicaLost
from server.sampling.choices import build_choice, logprob_entries
from server.sampling.engine_requests import engine_events


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class Completion:
    """One chat completion in flight."""

    gen: GenRequest
    events: asyncio.Queue
    id: str
    created: int
    model: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    tools: ToolSchemas | None  # the tools the model may call, by name; None when it may call none
    stops: list[str]
    include_usage: bool = False
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    release: Callable[[], None] = lambda: None  # the lease on the policy, given back once
    on_choice: Callable[[dict[str, Any]], None] | None = None  # a session's recorder (blocking: run in a thread)
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)  # finished choices, whole

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, top: dict[str, Any] | None = None,
              **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish, **extra}], **(top or {})}


def _partial_suffix(text: str, needles: list[str]) -> int:
    """How many trailing characters of `text` might begin one of `needles`."""
    for k in range(min(max((len(n) for n in needles), default=1) - 1, len(text)), 0, -1):
        if any(n.startswith(text[-k:]) for n in needles):
            return k
    return 0


def sendable(text: str, stops: list[str], held: Sequence[str] = ()) -> str:
    """What of a row's text so far is safe to stream: no incomplete UTF-8 character, nothing from a
    stop string on (the engine may have sampled past one it has yet to end the row on), and no tail
    that may begin a stop string or one of `held` (the tags a parser reads)."""
    text = text.rstrip("\ufffd")
    for stop in stops:
        if stop in text:
            text = text[: text.find(stop)]
    return text[: len(text) - _partial_suffix(text, [*stops, *held])]


@dataclass
class ChoiceStream:
    """What one choice has sent so far."""

    sent_reasoning: str = ""
    sent_content: str = ""
    sent_tokens: int = 0
    in_tool_call: bool = False

    def visible(self, chat: ChatFormat, text: str, c: Completion) -> tuple[str, str]:
        """(reasoning, content) that are safe to send: no partial tag, stop string or character."""
        p = chat.reasoning_parser
        held = [*chat.kept_ids.values(), *(chat.tool_parser.markers if c.tools is not None else ()),
                *(p.markers if p is not None else ())]
        text = sendable(text, c.stops, held)
        reasoning, content = "", text
        if p is not None and (p.end in text or chat.reasoning_opened or text.lstrip().startswith(p.start)):
            if p.end in text:
                reasoning, content = text.split(p.end, 1)
                content = content.lstrip("\n")
            else:
                reasoning, content = text, ""
            reasoning = reasoning.split(p.start, 1)[-1].lstrip("\n")
        if c.tools is not None:
            start = chat.tool_parser.starts_call(content)
            if start is not None:
                self.in_tool_call = True
                content = content[:start]
            content = content.rstrip()  # parsed content drops trailing whitespace before a call
        if self.in_tool_call:
            content = content[: len(self.sent_content)] if content.startswith(self.sent_content) else self.sent_content
        return reasoning, content

    def delta(self, reasoning: str, content: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            out["reasoning_content"] = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            out["content"] = content[len(self.sent_content):]
            self.sent_content = content
        return out


def _new_tokens(host: Any, seq: DecodeSequence, st: ChoiceStream, top_logprobs: bool,
                as_ids: bool) -> tuple[int, dict[str, Any]]:
    # The engine thread may be appending to `seq` as we read it (token ids first, then logprobs,
    # then top logprobs): send only the tokens whose every list is complete.
    end = len(seq.top_logprobs) if top_logprobs else len(seq.logprobs)
    ids = seq.token_ids[st.sent_tokens:end]
    tops = seq.top_logprobs[st.sent_tokens:end] if top_logprobs else None
    logprobs = logprob_entries(host, ids, seq.logprobs[st.sent_tokens:end], tops, as_ids)
    extra = {"token_ids": ids, "logprobs": {"content": logprobs}}
    st.sent_tokens = end
    return end, extra


async def stream_chunks(host: Any, c: Completion, disconnected: Callable[[], Any]) -> AsyncIterator[str]:
    """Chat Completions' server-sent events."""
    async for chunk in chunk_stream(host, c, disconnected):
        yield sse(chunk)
        if "error" in chunk:
            return
    if c.include_usage:
        prompt_tokens = len(c.prompt_ids)
        completion_tokens = sum(len(s.token_ids) for s in c.gen.sequences)
        yield sse({"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
                   "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                            "total_tokens": prompt_tokens + completion_tokens}})
    yield "data: [DONE]\n\n"


def stream_failure(exc: Exception) -> dict[str, Any]:
    """A stream's last event when the engine failed: the headers are out, so it says what failed,
    and whether the same request may simply be sent again."""
    return {"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None,
                      "code": "replica_lost" if isinstance(exc, ReplicaLost) else "generation_failed"}}


async def chunk_stream(host: Any, c: Completion, disconnected: Callable[[], Any]) -> AsyncIterator[dict[str, Any]]:
    """Chunks as dicts, for every face to dress; an engine failure is one `{"error": ...}` last.
    The lease on the policy is given back when the stream ends, however it ends."""
    n = c.gen.n
    streams = [ChoiceStream() for _ in range(n)]
    finished = 0
    try:
        for i in range(n):
            yield c.chunk(i, {"role": "assistant", "content": ""}, top=None if i else {"prompt_token_ids": c.prompt_ids})
        async for kind, seq in engine_events(c.gen, c.events, disconnected):
            if kind == "error":
                yield stream_failure(seq)
                return
            st = streams[seq.index]
            if kind == "token":
                chunk = _token_chunk(host, c, seq, st) if seq.finish_reason is None else None
                if chunk:  # a finished row's tokens come with its "finished" event
                    yield chunk
                continue
            finished += 1
            chunk = _final_chunk(host, c, seq, st)
            if c.on_choice is not None:  # stored before the choice's last chunk goes out
                try:
                    await asyncio.to_thread(c.on_choice, c.choices[seq.index])
                except Exception as exc:
                    yield {"error": {"message": f"the exchange could not be recorded in its session: {exc}",
                                     "type": "server_error", "param": None, "code": "session_not_recorded"}}
                    return
            yield chunk
            if finished == n:
                return
    finally:
        if finished < n:
            c.gen.cancelled = True
        c.release()


def _token_chunk(host: Any, c: Completion, seq: DecodeSequence, st: ChoiceStream) -> dict[str, Any] | None:
    end, extra = _new_tokens(host, seq, st, bool(c.gen.params.top_logprobs), c.tokens_as_ids)
    reasoning, content = st.visible(host.chat, host.chat.text(seq.token_ids[:end]), c)
    delta = st.delta(reasoning, content)
    return c.chunk(seq.index, delta, **extra) if delta or extra["token_ids"] else None


def _final_chunk(host: Any, c: Completion, seq: DecodeSequence, st: ChoiceStream) -> dict[str, Any]:
    _, extra = _new_tokens(host, seq, st, bool(c.gen.params.top_logprobs), c.tokens_as_ids)
    choice = c.choices[seq.index] = build_choice(host, seq, c.sampling, c.tools, c.tokens_as_ids)
    message, finish, malformed = choice["message"], choice["finish_reason"], choice.get("malformed_tool_call", False)
    delta = st.delta(message.get("reasoning_content") or st.sent_reasoning, message.get("content") or "")
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    if malformed:
        extra["malformed_tool_call"] = True
    return c.chunk(seq.index, delta, finish, **extra, sampling=c.sampling)
