"""The one history rule (protocol/histories.py): which recorded exchange continues which, what
makes two turns the same, and that the server's sessions, ART's capture and the verifiers relay
build the same histories from the same exchanges through it. The verifiers relay needs `verifiers`:
tests/verifiers_env/test_histories.py feeds it the exchanges this module records."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

from client.adapters import art_exchanges
from protocol.histories import RecordedExchange, histories, spliced, turn_identity
from protocol.trajectory import History
from server.chat.sampled_turns import turn_key
from server.harness.sessions import Sessions
from server.settings import Settings

pytestmark = pytest.mark.unit

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": CITY}}]
SYSTEM = {"role": "system", "content": "Answer with the tools."}
USER = {"role": "user", "content": "Weather in Paris and Rome?"}


def call(call_id: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def choice(ids: list[int], content: str | None = None, *calls: dict[str, Any]) -> dict[str, Any]:
    """A chat choice as art-server returns it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return {"index": 0, "finish_reason": "tool_calls" if calls else "stop", "message": message, "token_ids": ids,
            "logprobs": {"content": [{"token": "t", "logprob": -0.5, "top_logprobs": []} for _ in ids]},
            "sampling": {"prompt_len": 3}}


def echo(c: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """The turn as a client sends it back: what the rule ignores changed (a refusal field, the text
    as parts, the arguments re-serialised)."""
    m = c["message"]
    out: dict[str, Any] = {"role": "assistant", "content": [{"type": "text", "text": m["content"] or ""}],
                           "refusal": None}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**tc, "function": {**tc["function"],
                                                 "arguments": arguments or tc["function"]["arguments"]}}
                             for tc in m["tool_calls"]]
    return out


def tool(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


# A two-call tool loop and its answer, recorded with a retried tool step (a branch), a turn asked
# under other tools, and a compacted restart; the loop's answer is the last exchange.
PARIS, ROME = call("call_1", '{"city":"Paris"}'), call("call_2", '{"city":"Rome"}')
C0, C1, C2 = choice([10], None, PARIS), choice([11], "Now Rome.", ROME), choice([12], "Sunny in both.")
C3, C4, C5 = choice([13], "Paris timed out."), choice([14], "Berlin too?"), choice([15], "Sunny.")
LOOP_1 = [SYSTEM, USER, echo(C0, '{"city": "Paris"}'), tool("call_1", "21C")]
LOOP_2 = [*LOOP_1, echo(C1), tool("call_2", "18C")]
RECORDED: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
    ([SYSTEM, USER], TOOLS, C0),
    (LOOP_1, TOOLS, C1),
    ([SYSTEM, USER, echo(C0), tool("call_1", "timeout")], TOOLS, C3),  # continues C0, which C1 continued
    ([*LOOP_2, echo(C2), {"role": "user", "content": "and Berlin?"}], None, C4),  # C2 not asked yet: own start
    ([SYSTEM, {"role": "user", "content": "Summary: it is sunny."}], TOOLS, C5),
    (LOOP_2, TOOLS, C2),
]
# The histories those make, by their sampled ids: the loop (which the rollout ended in) first.
EXPECTED_IDS = [[10, 11, 12], [13], [14], [15]]


def dumped(history: History | dict[str, Any]) -> dict[str, Any]:
    """A history as plain JSON, its Choices dumped, whichever caller built it."""
    h = History.model_validate(history) if isinstance(history, dict) else history
    return {"items": [i.model_dump(mode="json") if isinstance(i, Choice) else i for i in h.messages_and_choices],
            "tools": h.tools}


def session_histories() -> list[dict[str, Any]]:
    """RECORDED through the server's real session recorder and scoring."""
    settings = Settings()
    sessions = Sessions.from_settings(settings)
    for messages, tools, c in RECORDED:
        recording = sessions.recording("s", "key")
        recording.begin(messages, tools)
        recording(c)
        recording.end()
    return [dumped(h) for h in sessions.trajectory("s", "key", reward=1.0).histories()]


def art_histories() -> list[dict[str, Any]]:
    """RECORDED as ART 0.5.23 captures Chat Completions exchanges."""
    captured = {"chat_completions": [
        {"start_time": float(t), "request": {"model": "m", "messages": messages, **({"tools": tools} if tools else {})},
         "response": {"choices": [c]}} for t, (messages, tools, c) in enumerate(RECORDED)]}
    return [dumped(h) for h in art_exchanges.histories(captured)]


def sampled_ids(histories_: list[dict[str, Any]]) -> list[list[int]]:
    return [[i["token_ids"][0] for i in h["items"] if "finish_reason" in i] for h in histories_]


def test_the_server_and_art_build_identical_histories_from_the_same_exchanges():
    server, art = session_histories(), art_histories()
    assert sampled_ids(server) == EXPECTED_IDS
    assert server == art
    loop = server[0]
    # the latest request's messages, each sampled turn in place of its echo
    assert [i.get("role", "choice") for i in loop["items"]] == [
        "system", "user", "choice", "tool", "choice", "tool", "choice"]
    assert loop["tools"] == TOOLS
    # a branch keeps the turn it continued as the echoed message: that turn trains in the loop, once
    assert server[1]["items"][2] == echo(C0)


# ---- the rule ---------------------------------------------------------------------------------------

def ex(messages: list[dict[str, Any]], c: dict[str, Any], tools: list[dict[str, Any]] | None = None
       ) -> RecordedExchange:
    return RecordedExchange(messages=messages, tools=tools, choice=c)


def test_a_tool_loop_is_one_history_with_every_turn_a_choice_in_place():
    recorded = [ex([SYSTEM, USER], C0, TOOLS), ex(LOOP_1, C1, TOOLS), ex(LOOP_2, C2, TOOLS)]
    assert histories(recorded) == [[0, 1, 2]]
    items = spliced(recorded, [0, 1, 2], ["c0", "c1", "c2"])
    assert items == [SYSTEM, USER, "c0", LOOP_1[3], "c1", LOOP_2[5], "c2"]


def test_a_later_request_that_does_not_carry_the_sampled_turn_does_not_continue():
    other = {"role": "assistant", "content": "something the model did not say"}
    recorded = [ex([SYSTEM, USER], C2), ex([SYSTEM, USER, other, {"role": "user", "content": "ok"}], C3)]
    assert histories(recorded) == [[1], [0]]


def test_a_branch_starts_its_own_history_and_the_last_exchange_comes_first():
    retry = [SYSTEM, USER, echo(C0), tool("call_1", "timeout")]
    recorded = [ex([SYSTEM, USER], C0), ex(LOOP_1, C1), ex(retry, C3), ex([SYSTEM, USER], C5)]
    assert histories(recorded) == [[3], [0, 1], [2]]
    # n > 1 alike: the later of two identical exchanges is the one carried on
    twins = [ex([SYSTEM, USER], C0), ex([SYSTEM, USER], C0), ex(LOOP_1, C1)]
    assert histories(twins) == [[1, 2], [0]]


def test_other_tools_make_another_history():
    assert histories([ex([SYSTEM, USER], C0, TOOLS), ex(LOOP_1, C1, None)]) == [[1], [0]]
    assert histories([ex([SYSTEM, USER], C0, TOOLS), ex(LOOP_1, C1, [{**TOOLS[0], "x": 1}])]) == [[1], [0]]
    assert histories([ex([SYSTEM, USER], C0, []), ex(LOOP_1, C1, None)]) == [[0, 1]]  # no tools either way


def test_a_turn_echoed_with_only_what_the_rule_ignores_changed_continues():
    user_as_parts = {"role": "user", "content": [{"type": "text", "text": USER["content"]}], "name": None}
    recorded = [ex([SYSTEM, USER], C0),
                ex([SYSTEM, user_as_parts, echo(C0, '{ "city" : "Paris" }'), tool("call_1", "21C")], C1)]
    assert histories(recorded) == [[0, 1]]
    # what it does not ignore: the call's id, its arguments' values, a user's name
    for changed in (echo(choice([10], None, call("call_9", '{"city":"Paris"}'))),
                    echo(C0, '{"city": "Lyon"}')):
        assert histories([recorded[0], ex([SYSTEM, USER, changed, tool("call_1", "21C")], C1)]) == [[1], [0]]
    named = {**USER, "name": "bob"}
    assert histories([recorded[0], ex([SYSTEM, named, echo(C0), tool("call_1", "21C")], C1)]) == [[1], [0]]


A_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}
ASSISTANT = {"role": "assistant", "content": "Looking.", "reasoning_content": "hm", "tool_calls": [A_CALL]}
SAME_TURN = [
    {**ASSISTANT, "refusal": None, "annotations": None, "token_ids": [1, 2]},
    {**ASSISTANT, "content": [{"type": "text", "text": "Look"}, {"type": "text", "text": "ing."}]},
    {**ASSISTANT, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"b":[2],"a":1}'}}]},
    {**{k: v for k, v in ASSISTANT.items() if k != "reasoning_content"}, "reasoning": "hm"},
]
OTHER_TURN = [
    {**ASSISTANT, "content": "Looking!"},
    {k: v for k, v in ASSISTANT.items() if k != "reasoning_content"},
    {**ASSISTANT, "tool_calls": [{**A_CALL, "id": "c2"}]},
    {**ASSISTANT, "tool_calls": [{**A_CALL, "function": {**A_CALL["function"], "name": "g"}}]},
    {**ASSISTANT, "tool_calls": [{**A_CALL, "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    {**ASSISTANT, "tool_calls": [A_CALL, A_CALL]},
]


@pytest.mark.parametrize("message,same", [(m, True) for m in SAME_TURN] + [(m, False) for m in OTHER_TURN])
def test_an_assistant_turn_is_the_same_exactly_when_the_server_splices_it_as_the_same(message, same):
    assert (turn_identity(message) == turn_identity(ASSISTANT)) is same
    assert (turn_key(message) == turn_key(ASSISTANT)) is same  # server/chat/sampled_turns.py agrees


def test_no_exchanges_make_no_histories():
    assert histories([]) == []
