"""How recorded calls become conversations: no server, no verifiers episode."""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers")

from openai.types.chat.chat_completion import Choice  # noqa: E402

import tests.protocol.test_histories as shared  # noqa: E402  (the exchanges the server and ART are fed)
from client.adapters.verifiers import RecordedCall, _as_sse, histories, recorded_exchange  # noqa: E402

SYSTEM = {"role": "system", "content": "s"}
USER = {"role": "user", "content": "u"}


def choice(text: str, tool: bool = False) -> Choice:
    message = {"role": "assistant", "content": text}
    if tool:
        message["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    return Choice.model_validate({"index": 0, "finish_reason": "tool_calls" if tool else "stop", "message": message,
                                  "token_ids": [1, 2], "sampling": {"policy": "p"}})


def echo(c: Choice) -> dict:
    return c.message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})


def test_a_tool_loop_is_one_conversation_with_every_choice_in_place():
    first, second = choice("", tool=True), choice("done")
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    calls = [RecordedCall([SYSTEM, USER], None, first), RecordedCall([SYSTEM, USER, echo(first), tool], None, second)]
    [main] = histories(calls)
    assert main.messages_and_choices == [SYSTEM, USER, first, tool, second]
    assert main.choices()[0] is first and main.choices()[1] is second


def test_a_rewritten_history_starts_another_conversation_and_the_last_call_comes_first():
    first, second = choice("long answer"), choice("after compaction")
    compacted = [SYSTEM, {"role": "user", "content": "summary of the above"}]
    calls = [RecordedCall([SYSTEM, USER], None, first), RecordedCall(compacted, None, second)]
    main, other = histories(calls)
    assert main.messages_and_choices == [*compacted, second]
    assert other.messages_and_choices == [SYSTEM, USER, first]


def test_a_changed_earlier_message_does_not_extend():
    first, second = choice("a"), choice("b")
    calls = [RecordedCall([SYSTEM, USER], None, first),
             RecordedCall([SYSTEM, {"role": "user", "content": "other"}, echo(first), USER], None, second)]
    assert len(histories(calls)) == 2


def test_a_completion_streams_back_as_one_chunk_with_its_tool_calls_indexed():
    completion = {"id": "x", "created": 1, "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                  "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [5],
                               "message": {"role": "assistant", "content": None,
                                           "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]}}]}
    events = _as_sse(completion, include_usage=True).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and '"usage"' in events[1]
    assert '"index": 0, "id": "c"' in events[0] and '"content"' not in events[0]


def test_the_relay_builds_the_histories_the_server_and_art_build_from_the_same_exchanges():
    """The same recorded exchanges tests/protocol/test_histories.py feeds the server's sessions and ART's
    capture, relayed: protocol/histories.py's rule gives all three the same histories."""
    calls = [RecordedCall(messages, tools, Choice.model_validate(c)) for messages, tools, c in shared.RECORDED]
    relayed = recorded_exchange(calls[1])
    assert (relayed.messages, relayed.tools, relayed.choice["token_ids"]) == (shared.LOOP_1, shared.TOOLS, [11])
    ours = [shared.dumped(h) for h in histories(calls)]
    assert shared.sampled_ids(ours) == shared.EXPECTED_IDS
    assert ours == shared.session_histories() == shared.art_histories()
