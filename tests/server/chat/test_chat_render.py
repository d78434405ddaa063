"""The prompt renderer and the tool-call parser on the embedded model, in-process (no server).

The renderer must produce exactly what the tokenizer's own chat template produces (other tools,
vLLM included, render with the template), and it must refuse conversations no chat model was
trained on. The parser turns sampled text into OpenAI `content` + `tool_calls`. Other models'
templates and formats are tried in test_chat_formats.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from conftest import ROOT
from server.sampling.streaming import _partial_suffix
from server.chat.format import ChatFormat
from server.chat.parsers import HermesParser
from server.chat.sampled_turns import SampledTurn, SampledTurns, fingerprint
from server.chat.template import template_message
from server.chat.validate import RenderError, validate_messages
from server.embedded.template import render_text

pytestmark = pytest.mark.unit

GENERATION_PROMPT = "<|im_start|>assistant\n"


def parse_tool_calls(text: str, tools_enabled: bool = True):
    return HermesParser().parse(text) if tools_enabled else FORMAT.parse(text, None)


def held_back_suffix(text: str) -> int:
    return _partial_suffix(text, ["<tool_call>"])

MODEL_DIR = ROOT / "server" / "embedded" / "model"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Réserver une table (non-ASCII on purpose).",
    "parameters": {"type": "object", "properties": {"people": {"type": "integer"}, "when": {"type": "string"}}}}}


def call(id_: str, name: str, arguments) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "user_only": ([{"role": "user", "content": "Hello!"}], None),
    "system_user": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], None),
    "multi_turn_text": ([
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "How are you?\nReally?"},
    ], None),
    "tools_no_system": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
    "tools_with_system": ([{"role": "system", "content": "You book tables."},
                           {"role": "user", "content": "Deux personnes, ce soir ?"}], [WEATHER, BOOK]),
    "tool_call_string_arguments": ([
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        # Not in json.dumps' spacing: the template renders a string verbatim.
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", '{"city":"Paris"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "Paris is 21C.", "tool_calls": [call("c2", "get_weather", '{ "city": "Oslo" }')]},
        {"role": "tool", "tool_call_id": "c2", "content": "4C"},
        {"role": "assistant", "content": "Oslo is 4C."},
        {"role": "user", "content": "Thanks"},
    ], [WEATHER]),
    "consecutive_tool_messages": ([
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Paris, Oslo and a table for 2?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            call("a", "get_weather", '{"city": "Paris"}'),
            call("b", "get_weather", {"city": "Oslo"}),  # arguments as an object
            call("c", "book_table", {"people": 2, "when": "ce soir à 20h"}),
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "21C"},
        {"role": "tool", "tool_call_id": "b", "content": "4C"},
        {"role": "tool", "tool_call_id": "c", "content": "booked"},
    ], [WEATHER, BOOK]),
    "empty_assistant_turns": ([
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Ok."},
    ], None),
}


FORMAT = ChatFormat.build(AutoTokenizer.from_pretrained(MODEL_DIR))


@pytest.fixture(scope="module")
def tok():
    return FORMAT.template.tokenizer


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renderer_equals_the_tokenizers_chat_template(tok, name, add_generation_prompt):
    messages, tools = CONVERSATIONS[name]
    pristine = copy.deepcopy(messages)
    want = tok.apply_chat_template(copy.deepcopy(messages), tools=tools, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
    assert render_text(messages, tools, add_generation_prompt) == want
    # The server parses OpenAI's JSON-string tool arguments into objects, as vLLM does, before the
    # template sees them (Llama's and Mistral's templates would quote a string a second time).
    served = tok.apply_chat_template([template_message(m) for m in messages], tools=tools, tokenize=False,
                                     add_generation_prompt=add_generation_prompt)
    ids = FORMAT.renderer.render(messages, tools, add_generation_prompt).ids
    assert ids == tok.encode(served, add_special_tokens=False)
    assert messages == pristine  # rendering must not mutate the caller's messages
    validate_messages(messages)  # every conversation here is a valid one


def test_renderer_splices_sampled_turns_instead_of_retokenizing(tok):
    r = FORMAT.renderer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = tok.encode(GENERATION_PROMPT, add_special_tokens=False)
    # Ids that do not round-trip through text: the splice must keep them as they are.
    finished = (40, 41, 42, im_end)
    cut = (43, 44)  # cut by max_tokens: no <|im_end|> sampled, one is appended
    turns = {"first": finished, "second": cut}
    messages = [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "u3"},
    ]
    rendered = r.render(messages, sampled_ids={i: turns[m["content"]] for i, m in enumerate(messages)
                                               if m["content"] in turns})
    ids = rendered.ids
    assert rendered.spliced_turns == 2 and rendered.rewritten_turns == 0
    nl = tok.encode("\n", add_special_tokens=False)
    assert _find(ids, gen + list(finished) + nl) >= 0
    assert _find(ids, gen + list(cut) + [im_end] + nl) >= 0
    # Everything outside the spliced turns is the template's tokenization.
    text_only = tok.encode(render_text(messages[:1], None, False), add_special_tokens=False)
    assert ids[: len(text_only)] == text_only
    assert ids[-len(gen):] == gen


def test_the_same_text_sampled_after_two_prompts_is_told_apart(tok):
    """Two rollouts of a group both wrote "The price is 12." with different ids: each later prompt,
    and a training job recovering a choice that lost its ids, gets the sampling made after its
    own prompt, whichever is newer."""
    turns = SampledTurns(FORMAT.renderer)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    text = "The price is 12."
    as_text = tuple(tok.encode(text, add_special_tokens=False) + [im_end])
    by_char = tuple([i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [im_end])
    assert as_text != by_char
    asked = {"apples": [{"role": "user", "content": "Price of apples?"}],
             "pears": [{"role": "user", "content": "Price of pears?"}]}
    sampled = {"apples": by_char, "pears": as_text}  # pears is the newer sampling
    for fruit in ("apples", "pears"):
        prompt = turns.prompt(asked[fruit], None).ids
        turns.remember({"role": "assistant", "content": text}, SampledTurn(sampled[fruit], {
            "logprobs": [0.0] * len(sampled[fruit]), "sampling": {"prompt_fingerprint": fingerprint(prompt)}}))
    for fruit in ("apples", "pears"):
        first = turns.prompt(asked[fruit], None).ids
        conversation = asked[fruit] + [{"role": "assistant", "content": text}]
        later = turns.prompt(conversation + [{"role": "user", "content": "Thanks"}], None)
        assert later.spliced_turns == 1 and later.ids[: len(first) + len(sampled[fruit])] == first + list(sampled[fruit])
        turn, prompt = turns.recover(conversation, 1, None)
        assert turn.token_ids == sampled[fruit] and prompt.ids == first
    carried = asked["apples"] + [{"role": "assistant", "content": text, "token_ids": list(as_text)}]
    assert turns.recover(carried, 1, None)[0].token_ids == sampled["apples"]  # a lost choice: its own ids are gone
    first = turns.prompt(asked["apples"], None).ids
    assert turns.prompt(carried, None).ids[: len(first) + len(as_text)] == first + list(as_text)  # carried ids win
    assert turns.recover(asked["apples"] + [{"role": "assistant", "content": "Never said."}], 1, None) is None


def test_the_embedded_template_renders_tools():
    """The demo's agent calls a tool: its model must see the tools it is offered."""
    assert FORMAT.template.renders_tools


def test_output_text_keeps_tool_call_tags_and_drops_control_tokens(tok):
    text = 'Hi<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert FORMAT.text(ids) == text
    assert parse_tool_calls(FORMAT.text(ids)).tool_calls[0].name == "f"
    plain = tok.encode("just text", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|endoftext|>")]
    assert FORMAT.text(plain) == "just text"


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    return -1


# ---- validate_messages -------------------------------------------------------------------------

BAD_ORDERS = {
    "empty": ([], "must not be empty"),
    "system_in_the_middle": ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system"),
    "tool_first": ([{"role": "tool", "tool_call_id": "x", "content": "r"}], "tool message"),
    "tool_after_user": ([{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "x", "content": "r"}],
                        "tool message"),
    "tool_after_assistant_without_calls": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "no calls here"},
        {"role": "tool", "tool_call_id": "x", "content": "r"}], "tool message"),
    "tool_after_user_after_tool_results": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call("x", "f", "{}")]},
        {"role": "tool", "tool_call_id": "x", "content": "r"}, {"role": "user", "content": "b"},
        {"role": "tool", "tool_call_id": "x", "content": "r"}], "tool message"),
    "tool_call_id_mismatch": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call("x", "f", "{}")]},
        {"role": "tool", "tool_call_id": "y", "content": "r"}], "tool_call_id"),
    "ends_with_unanswered_tool_call": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call("x", "f", "{}")]}],
        "tool results"),
    "unknown_role": ([{"role": "robot", "content": "a"}], "role"),
    "image_content_part": ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
    "content_not_text": ([{"role": "user", "content": 42}], "content"),
    "user_without_content": ([{"role": "user"}], r"messages\[0\]\.content is required in a user message"),
    "system_with_null_content": ([{"role": "system", "content": None}, {"role": "user", "content": "a"}],
                                 r"messages\[0\]\.content is required"),
    "tool_call_without_name": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
        {"role": "tool", "tool_call_id": "x", "content": "r"}], "function.name"),
    "tool_call_s_id_not_a_string": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": [None], "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "x", "content": "r"}], r"tool_calls\[0\]\.id must be a string"),
    "tool_call_id_not_a_string": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call("x", "f", "{}")]},
        {"role": "tool", "tool_call_id": ["x"], "content": "r"}], r"messages\[2\]\.tool_call_id must be a string"),
    "tool_without_content": ([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call("x", "f", "{}")]},
        {"role": "tool", "tool_call_id": "x"}], "content"),
}


@pytest.mark.parametrize("name", list(BAD_ORDERS))
def test_validate_messages_rejects_bad_conversations(name):
    messages, words = BAD_ORDERS[name]
    with pytest.raises(RenderError, match=words):
        validate_messages(messages)


def test_validate_messages_accepts_text_parts_and_developer_first():
    validate_messages([{"role": "developer", "content": "rules"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])


# ---- parse_tool_calls ---------------------------------------------------------------------------

def test_parse_single_call_with_object_arguments():
    out = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not out.malformed and out.content is None
    [c] = out.tool_calls
    assert c.name == "get_weather" and json.loads(c.arguments) == {"city": "Paris"}
    oa = c.to_openai()
    assert oa["type"] == "function" and oa["id"].startswith("call_") and oa["function"]["name"] == "get_weather"
    assert isinstance(oa["function"]["arguments"], str)


def test_parse_arguments_given_as_a_json_string():
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert [json.loads(c.arguments) for c in out.tool_calls] == [{"x": 1}]


def test_parse_missing_arguments_means_empty_object():
    out = parse_tool_calls('<tool_call>{"name": "ping"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("ping", {})]


def test_parse_multiple_calls_with_surrounding_text():
    text = ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"k": "é"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n')
    out = parse_tool_calls(text)
    assert [c.name for c in out.tool_calls] == ["a", "b"]
    assert json.loads(out.tool_calls[0].arguments) == {"k": "é"}
    assert out.content == "Let me look." and not out.malformed
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # invalid JSON
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>',
    'ok <tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{"name": "g"',  # one unclosed
    '<tool_call>\n{"name": "f", "arguments": {}}',  # unclosed tag (cut by max_tokens)
])
def test_malformed_calls_stay_in_content(text):
    out = parse_tool_calls(text)
    assert out.malformed and out.tool_calls == [] and out.content == text


def test_content_keeps_leading_whitespace_a_stream_already_sent():
    out = parse_tool_calls('\n Hi\n<tool_call>{"name": "f"}</tool_call>\n')
    assert out.content == "\n Hi" and [c.name for c in out.tool_calls] == ["f"]
    assert parse_tool_calls(' \n<tool_call>{"name": "f"}</tool_call>').content is None


def test_tools_disabled_or_no_tag_is_plain_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, tools_enabled=False).tool_calls == []
    assert parse_tool_calls(text, tools_enabled=False).content == text
    plain = parse_tool_calls("  just words  ")
    assert plain.content == "  just words  " and not plain.malformed


def test_held_back_suffix_covers_partial_tags_only():
    assert held_back_suffix("hello <tool") == len("<tool")
    assert held_back_suffix("hello <") == 1
    assert held_back_suffix("hello") == 0
    assert held_back_suffix("a <b") == 0
