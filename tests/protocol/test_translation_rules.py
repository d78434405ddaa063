"""protocol/translation.py on plain dicts: the chat messages a harness's echoed items and blocks
become (one assistant turn from its split pieces, tool results as tool messages), the field each
message came from, and the field a request that makes no conversation is refused by."""

from __future__ import annotations

import pytest

from protocol import translation
from protocol.translation import TranslationError

pytestmark = pytest.mark.unit

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_responses_items_become_one_assistant_turn_and_its_tool_results():
    previous = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}]
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather in "},
                                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}],
         "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21C"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "only a summary"}]},
        {"role": "assistant", "content": "Sunny."},
    ]
    history = translation.responses_history(items, previous)
    assert history.messages == [
        *previous, {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "look it up",
         "tool_calls": [call("c1", "weather", '{"city":"Paris"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "only a summary"}]
    assert history.origins == ["previous_response_id"] * 3 + ["input[0]", "input[1]", "input[4]", "input[5]"]
    assert previous[2] == {"role": "assistant", "content": "hello"}  # the stored conversation is left as it was

    conversation = translation.responses_conversation("Answer in French.", history)
    assert conversation.messages[0] == {"role": "system", "content": "Answer in French.\n\nBe brief."}
    assert conversation.messages[1:] == history.messages[1:] and conversation.origins == history.origins
    alone = translation.responses_conversation("Answer in French.", translation.responses_history("hi"))
    assert alone.messages == [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    assert alone.origins == ["instructions", "input"]


def test_responses_tools_and_tool_choice_are_chats():
    tools = [{"type": "function", "name": "weather", "strict": True, "x-extra": 1, "parameters": CITY,
              "description": None}]
    assert translation.responses_tools(tools) == [
        {"type": "function", "function": {"name": "weather", "parameters": CITY, "x-extra": 1}}]
    assert list(translation.responses_tools(tools)[0]["function"]) == ["name", "parameters", "x-extra"]
    assert translation.responses_tools([]) is None
    assert translation.responses_tool_choice({"type": "function", "name": "weather"}) == {
        "type": "function", "function": {"name": "weather"}}
    assert translation.responses_tool_choice("required") == "required"


def test_anthropic_blocks_become_chat_messages():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Zürich"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18C"}]},
            {"type": "text", "text": "and "}, {"type": "text", "text": "now?"}]},
        {"role": "assistant", "content": "Sunny."},
        {"role": "assistant", "content": [{"type": "text", "text": " Warm."}]},
    ]
    out = translation.anthropic_conversation([{"type": "text", "text": "Use tools."}], messages)
    assert out.messages == [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "hm",
         "tool_calls": [call("t1", "weather", '{"city": "Zürich"}')]},
        {"role": "tool", "tool_call_id": "t1", "content": "18C"}, {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "Sunny. Warm."}]
    assert out.origins == ["system", "messages[0]", "messages[1]", "messages[2].content[0]", "messages[2]",
                           "messages[3]"]
    tool = {"name": "weather", "description": "", "input_schema": CITY}
    assert translation.anthropic_tools([tool]) == [{"type": "function", "function": {"name": "weather",
                                                                                     "parameters": CITY}}]
    assert translation.anthropic_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert translation.anthropic_tool_choice({"type": "tool", "name": "weather"}) == (
        {"type": "function", "function": {"name": "weather"}}, True)
    assert translation.anthropic_tool_choice(None) == (None, True)


@pytest.mark.parametrize("messages,param,says", [
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}],
     "messages[1].content[0]", "belongs in a user message"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "thinking", "thinking": "x"}]}],
     "messages[0].content[1]", "a thinking block belongs in an assistant message"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                   {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}],
     "messages[0].content[1]", "must come before the text"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0]", "'image'"),
])
def test_a_block_out_of_place_is_refused_by_its_field(messages, param, says):
    with pytest.raises(TranslationError) as e:
        translation.anthropic_conversation(None, messages)
    assert e.value.param == param and says in e.value.message
    assert str(e.value).startswith(param + ": ")


def test_an_item_no_template_renders_is_refused_by_its_field():
    with pytest.raises(TranslationError) as e:
        translation.responses_history([{"role": "user", "content": "hi"}, {"type": "web_search_call", "id": "w"}])
    assert e.value.param == "input[1]" and "'web_search_call'" in str(e.value)
