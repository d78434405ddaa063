"""client/adapters/art_exchanges.py turns captured Responses and Messages requests into chat messages on
the client; training is token-exact only if those are the messages art-server rendered. Both apply
protocol/translation.py's rules, the client to the JSON ART captured, the server
(server/api/translate.py) to its validated request dumped; held here is that the two readings
agree, on requests with every kind of item and block the server takes."""

from __future__ import annotations

import json

import pytest

from client.adapters import art_exchanges
from server.api import translate
from server.api.messages_schemas import MessagesRequest
from server.api.responses_schemas import ResponsesRequest

pytestmark = pytest.mark.unit

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city":"Paris"}', "status": "completed"}
RESPONSES = [
    {"model": "m", "input": "hi"},
    {"model": "m", "input": "hi", "instructions": "Be brief."},
    {"model": "m", "input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
     "instructions": "Answer in French."},
    {"model": "m", "instructions": "Use tools.", "input": [
        {"role": "system", "content": "You are a bot."},
        {"role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        CALL, {**CALL, "id": "fc_2", "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "18C"}]},
        {"role": "user", "content": "thanks"}],
     "tools": [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": CITY,
                "strict": True},
               {"type": "function", "name": "get_time", "parameters": CITY, "x-extra": 1}]},
]
MESSAGES = [
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Use "}, {"type": "text", "text": "tools."}],
     "messages": [
         {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                           {"type": "text", "text": "Looking."},
                                           {"type": "tool_use", "id": "t1", "name": "get_weather",
                                            "input": {"city": "Paris"}},
                                           {"type": "tool_use", "id": "t2", "name": "get_weather",
                                            "input": {"city": "Zürich"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21C"},
                                      {"type": "tool_result", "tool_use_id": "t2",
                                       "content": [{"type": "text", "text": "18C"}]},
                                      {"type": "text", "text": "and now?"}]},
         {"role": "assistant", "content": "Sunny."},
         {"role": "assistant", "content": []},
         {"role": "user", "content": "ok"}],
     "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": CITY, "cache_control": {}},
               {"name": "get_time", "input_schema": CITY}]},
]


def same(ours, theirs) -> bool:
    """Equal down to the order of keys: a template that writes tools with `tojson` keeps it."""
    return json.dumps(ours) == json.dumps(theirs)


@pytest.mark.parametrize("request_", RESPONSES)
def test_responses_requests_become_the_servers_messages(request_):
    previous = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "earlier answer"}]
    system = any(i.get("role") in ("system", "developer") for i in request_["input"] if isinstance(i, dict))
    for prior in ([], *([] if system else [previous])):
        body = ResponsesRequest.model_validate(request_)
        history, chat = translate.responses_chat(body, prior)
        ours, conversation, tools = art_exchanges.responses_prompt(request_, prior)
        assert same(ours, history)
        assert same(conversation, chat.messages)
    assert same(tools, chat.tool_dicts())


@pytest.mark.parametrize("request_", MESSAGES)
def test_messages_requests_become_the_servers_messages(request_):
    body = MessagesRequest.model_validate(request_)
    chat = translate.messages_chat(body)
    conversation, tools = art_exchanges.messages_prompt(request_)
    assert same(conversation, chat.messages)
    assert same(tools, chat.tool_dicts())


def test_answers_become_the_choice_they_were_sampled_as():
    choice = {"finish_reason": "tool_calls", "token_ids": [1, 2], "sampling": {"step": 0},
              "logprobs": {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []},
                                       {"token": "b", "logprob": -0.25, "top_logprobs": []}]},
              "message": {"role": "assistant", "content": "Looking.", "reasoning_content": "hm",
                          "tool_calls": [{"id": "t1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}
    response = {"status": "completed", "output": translate.response_output(choice, "x"), "token_ids": [1, 2],
                "logprobs": choice["logprobs"], "sampling": {"step": 0}}
    ours = art_exchanges.responses_choice(response)
    assert ours["message"] == choice["message"] and ours["finish_reason"] == "tool_calls"
    assert (ours["token_ids"], ours["logprobs"], ours["sampling"]) == ([1, 2], choice["logprobs"], {"step": 0})
    message = {"content": translate.anthropic_content(choice), "stop_reason": "max_tokens", "token_ids": [1, 2],
               "logprobs": [-0.5, -0.25]}
    ours = art_exchanges.anthropic_choice(message)
    assert ours["message"] == choice["message"] and ours["finish_reason"] == "length"
    assert [t["logprob"] for t in ours["logprobs"]["content"]] == [-0.5, -0.25] and "sampling" not in ours


def test_a_continued_conversation_is_one_history_and_another_is_its_own():
    def exchange(t, messages, answer, tools=None):
        return {"start_time": t, "request": {"messages": messages, **({"tools": tools} if tools else {})},
                "response": {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": answer},
                                          "token_ids": [int(t)]}]}}
    ask = [{"role": "user", "content": "hi"}]
    later = [*ask, {"role": "assistant", "content": "hello", "refusal": None}, {"role": "user", "content": "bye"}]
    found = art_exchanges.histories({"chat_completions": [
        exchange("1", ask, "hello"), exchange("2", later, "ciao"), exchange("3", ask, "x", tools=[{"t": 1}])]})
    # The conversation the trajectory ended in first (protocol/histories.py).
    assert [[m.get("token_ids", m.get("content")) for m in h["messages_and_choices"]] for h in found] == [
        ["hi", [3]], ["hi", [1], "bye", [2]]]
