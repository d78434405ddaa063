"""The final answer of an `openai` or `anthropic` SDK stream, with the fields training needs.

art-server streams each sampled turn's `token_ids`, `logprobs` and `sampling` record beside its
text, but the SDKs' stream helpers keep only the fields they know:

- `openai`'s `chat.completions.stream(...)`: `get_final_completion()` keeps `prompt_token_ids` (on
  the first chunk) and the logprobs, drops every chunk's `token_ids` and the last one's `sampling`,
  and raises LengthFinishReasonError for a completion cut by `max_tokens`;
- `anthropic`'s `messages.stream(...)`: `get_final_message()` keeps `message_start`'s message
  (`prompt_token_ids`) and, of `message_delta`, only the stop reason and usage, so `token_ids`,
  `logprobs` and `sampling` are lost;
- `openai`'s `responses.stream(...)`: `get_final_response()` is `response.completed`'s body, all
  fields kept, but raises for a response cut by `max_output_tokens` (its stream ends with
  `response.incomplete`, as OpenAI's does).

Neither accumulator keeps anything an event could add at the end of the message or choice (their
code: openai/lib/streaming/chat/_completions.py `_accumulate_chunk`, anthropic/lib/streaming/
_messages.py `accumulate_event`), so the fields are collected here from the events as they pass.
`final_answer(stream)` (`final_answer_sync` for the SDKs' sync clients) reads a stream opened with
one of those three helpers to its end and returns what the same request without `stream` gets: a
ChatCompletion whose choices carry `token_ids`, `logprobs` and `sampling` (a choice to append to
`messages_and_choices`), a Message, or a Response, with `prompt_token_ids`, `token_ids`, `logprobs`
and `sampling`. Give it the stream before reading any of it; `on_event` sees every event on the way.
"""

from __future__ import annotations

from typing import Any, Callable

from openai.types.chat import ChatCompletion

_CHOICE_FIELDS = ("sampling", "malformed_tool_call")


class _Fields:
    """What the accumulators drop, gathered from the events as they pass."""

    def __init__(self) -> None:
        self.top: dict[str, Any] = {}  # the completion's or the message's own
        self.choices: dict[int, dict[str, Any]] = {}  # a chat completion's, per choice index
        self.response: Any = None  # Responses' final body, completed or incomplete

    def see(self, event: Any) -> None:
        kind = getattr(event, "type", None)
        if kind == "chunk":  # openai chat: the raw chunk is kept on the event
            chunk = event.chunk
            if "prompt_token_ids" in (chunk.model_extra or {}):
                self.top["prompt_token_ids"] = chunk.model_extra["prompt_token_ids"]
            for choice in chunk.choices:
                extra, mine = choice.model_extra or {}, self.choices.setdefault(choice.index, {})
                if extra.get("token_ids") is not None:
                    mine.setdefault("token_ids", []).extend(extra["token_ids"])
                mine.update({k: extra[k] for k in _CHOICE_FIELDS if k in extra})
        elif kind == "message_delta":  # anthropic: the event itself is passed through, extras and all
            self.top.update(event.model_extra or {})
        elif kind in ("response.completed", "response.incomplete"):
            self.response = event.response


def _completion(snapshot: Any, fields: _Fields) -> ChatCompletion:
    data = snapshot.to_dict()
    for choice in data["choices"]:
        if choice.get("finish_reason") is None:
            raise RuntimeError(f"the stream ended before choice {choice['index']} finished")
        # The SDK's parsing aids and a delta's list index are not part of the answer; nor is the
        # empty content the first chunk opens a message with, in a turn of calls only.
        message = choice["message"]
        message.pop("parsed", None)
        for call in message.get("tool_calls") or []:
            call.pop("index", None)
            call.get("function", {}).pop("parsed_arguments", None)
        if message.get("tool_calls") and message.get("content") == "":
            message["content"] = None
        choice.update(fields.choices.get(choice["index"], {}))
    return ChatCompletion.model_validate({**data, **fields.top})


# Told apart by their methods: their snapshot properties fail before the first event.
def _final(stream: Any, fields: _Fields) -> Any:
    if hasattr(stream, "get_final_completion"):
        return _completion(stream.current_completion_snapshot, fields)
    if hasattr(stream, "get_final_message"):
        message = stream.current_message_snapshot
        for key, value in fields.top.items():
            setattr(message, key, value)  # an extra field, as on an answer that did not stream
        return message
    if fields.response is None:
        raise RuntimeError("the stream ended without response.completed or response.incomplete")
    return fields.response


def _check(stream: Any) -> None:
    if not any(hasattr(stream, a) for a in ("get_final_completion", "get_final_message", "get_final_response")):
        raise TypeError(f"final_answer takes the stream that openai's chat.completions.stream(...) or "
                        f"responses.stream(...), or anthropic's messages.stream(...), opens; "
                        f"got {type(stream).__name__}")
    if hasattr(stream, "get_final_response"):
        return  # Responses' last event holds every field: what was read before it took none away
    # A chat or Messages stream read in part has given away ids that no snapshot keeps; their
    # snapshot properties assert that an event has been read.
    try:
        started = (stream.current_completion_snapshot if hasattr(stream, "get_final_completion")
                   else stream.current_message_snapshot) is not None
    except AssertionError:
        started = False
    if started:
        raise RuntimeError("final_answer needs the stream unread: events already read took their token ids "
                           "with them (pass on_event to see every event on the way)")


async def final_answer(stream: Any, on_event: Callable[[Any], Any] | None = None) -> Any:
    """The answer of an async SDK stream (`async with client.chat.completions.stream(...) as s:
    completion = await final_answer(s)`), with the training fields its accumulator drops."""
    _check(stream)
    fields = _Fields()
    async for event in stream:
        fields.see(event)
        if on_event is not None:
            on_event(event)
    return _final(stream, fields)


def final_answer_sync(stream: Any, on_event: Callable[[Any], Any] | None = None) -> Any:
    """`final_answer` for a sync SDK client's stream."""
    _check(stream)
    fields = _Fields()
    for event in stream:
        fields.see(event)
        if on_event is not None:
            on_event(event)
    return _final(stream, fields)
