"""Tool-call and reasoning parsers per family, as vLLM names them: well-formed, parallel,
nested-JSON arguments, and malformed output (which stays in content, flagged)."""

from __future__ import annotations

import json

import pytest

from server.chat.parsers import (Gemma4Parser, Glm45Parser, HarmonyParser, HermesParser, Lfm2Parser, Llama3JsonParser,
                                 MistralParser, PythonicParser, Qwen3CoderParser, ReasoningParser,
                                 detect_reasoning_parser, detect_tool_parser, make_reasoning_parser, typed)
from server.chat.tool_calls import tool_schemas
from tests.families import FAMILIES, family_format, written_turn
from tests.real_models import TEMPLATES

pytestmark = pytest.mark.unit

NESTED = {"query": {"city": "Paris", "days": [1, 2], "opts": {"units": "°C", "deep": {"x": None}}}}


def calls(out) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


# ---- hermes (Qwen2.5, Qwen3) ------------------------------------------------------------------

def test_hermes_single_parallel_and_nested():
    one = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert calls(one) == [("f", {"a": 1})] and one.content is None and not one.malformed
    two = HermesParser().parse('Checking.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
                               f'<tool_call>\n{json.dumps({"name": "g", "arguments": NESTED})}\n</tool_call>')
    assert calls(two) == [("f", {}), ("g", NESTED)] and two.content == "Checking."


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "arguments": {"a": }</tool_call>',
                                  '<tool_call>{"name": "f"', '<tool_call>[1, 2]</tool_call>'])
def test_hermes_malformed_stays_in_content(text):
    out = HermesParser().parse(text)
    assert out.malformed and out.content == text and out.tool_calls == []


# ---- llama3_json (Llama 3.1 / 3.2) --------------------------------------------------------------

def test_llama3_json_calls_with_parameters_or_arguments_and_the_python_tag():
    out = Llama3JsonParser().parse('{"name": "f", "parameters": {"a": 1}}')
    assert calls(out) == [("f", {"a": 1})] and out.content is None
    out = Llama3JsonParser().parse(f'<|python_tag|>{json.dumps({"name": "g", "arguments": NESTED})}; '
                                   '{"name": "f", "parameters": {}}')
    assert calls(out) == [("g", NESTED), ("f", {})]


def test_llama3_json_text_and_broken_calls():
    plain = Llama3JsonParser().parse("The weather is fine.")
    assert plain.content == "The weather is fine." and not plain.malformed and not plain.tool_calls
    broken = Llama3JsonParser().parse('{"name": "f", "parameters": {"a": ')
    assert broken.malformed and broken.content == '{"name": "f", "parameters": {"a": '
    tagged = Llama3JsonParser().parse('<|python_tag|>{"nom": "f"}')
    assert tagged.malformed and not tagged.tool_calls


# ---- mistral ---------------------------------------------------------------------------------------

def test_mistral_v03_list_and_v11_args_forms():
    out = MistralParser().parse(f'Sure. [TOOL_CALLS] [{{"name": "f", "arguments": {{}}}}, '
                                f'{json.dumps({"name": "g", "arguments": NESTED})}]')
    assert calls(out) == [("f", {}), ("g", NESTED)] and out.content == "Sure."
    assert all(len(c.id) == 9 and c.id.isalnum() for c in out.tool_calls)  # what Mistral's template demands
    v11 = MistralParser().parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}')
    assert calls(v11) == [("f", {"a": 1}), ("g", {})]


@pytest.mark.parametrize("text", ['[TOOL_CALLS] [{"name": "f", "arguments": ', '[TOOL_CALLS] {"name": "f"}',
                                  "[TOOL_CALLS]f{}"])
def test_mistral_malformed(text):
    out = MistralParser().parse(text)
    assert out.malformed and out.content == text


# ---- pythonic (Llama 3.2 / 4, Gemma 3 with vLLM's templates) -------------------------------------------

def test_pythonic_calls():
    out = PythonicParser().parse('[get_weather(city="Paris", days=[1, 2]), now()]')
    assert calls(out) == [("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})]
    assert PythonicParser().parse("[1, 2, 3] are numbers").tool_calls == []
    bad = PythonicParser().parse('[get_weather(city="Paris"]')
    assert bad.malformed and bad.content == '[get_weather(city="Paris"]'
    positional = PythonicParser().parse('[f("x")]')
    assert positional.malformed


@pytest.mark.parametrize("text", ['[f(tags={"a", "b"})]', '[f(x={[1]: 2})]', '[f(x={(1, 2): 3})]', "[f(x=1)\x00]",
                                  "[f(x=" + "[" * 5000 + "]" * 5000 + ")]"])
def test_pythonic_arguments_that_are_not_json_are_malformed_not_errors(text):
    out = PythonicParser().parse(text)
    assert out.malformed and out.content == text and out.tool_calls == []


# ---- harmony (gpt-oss) --------------------------------------------------------------------------

def test_harmony_channels_reasoning_answer_and_calls():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    out = HarmonyParser().parse(text)
    assert out.reasoning == "Need the weather." and calls(out) == [("get_weather", {"city": "Paris"})]
    final = HarmonyParser().parse("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant"
                                  "<|channel|>final<|message|>It is 21C.")
    assert final.content == "It is 21C." and final.reasoning == "Easy." and not final.tool_calls
    bad = HarmonyParser().parse("<|channel|>commentary to=functions.f<|message|>{oops<|call|>")
    assert bad.malformed


@pytest.mark.parametrize("text", [
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
    '<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather'
    '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'])
def test_harmony_recipient_in_the_role_header(text):
    out = HarmonyParser().parse(text)
    assert calls(out) == [("get_weather", {"city": "Paris"})] and not out.malformed and out.content is None


# ---- formats that write each argument apart (Qwen3.5, GLM-4.5, Gemma 4, LFM2) ---------------------

FIND = {"type": "object", "properties": {
    "zip": {"type": "string"}, "days": {"type": "integer"}, "exact": {"type": "boolean"}, "where": {"type": "object"},
    "tags": {"type": ["array", "null"]}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
SCHEMAS = tool_schemas([{"type": "function", "function": {"name": "find", "parameters": FIND}}])


def test_an_argument_written_as_text_is_read_as_its_schema_types_it():
    assert typed("02134", {"type": "string"}) == "02134"  # a string that looks like a number stays one
    assert typed("true", {"type": "string"}) == "true"
    assert typed("3", {"type": "integer"}) == 3 and typed("2.5", {"type": "number"}) == 2.5
    assert typed("True", {"type": "boolean"}) is True and typed("false", {"type": "boolean"}) is False
    assert typed('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert typed("None", {"type": ["array", "null"]}) is None and typed("null", {"anyOf": [{"type": "null"}]}) is None
    assert typed("not a number", {"type": "integer"}) == "not a number"  # the tool sees what was written
    assert typed("3", None) == 3 and typed("Paris", None) == "Paris"  # no schema: JSON where it reads as JSON


def test_qwen3_coder_calls_are_typed_by_the_tools_schema():
    text = ("Looking.\n<tool_call>\n<function=find>\n<parameter=zip>\n02134\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=where>\n{\"city\": \"Paris\"}\n"
            "</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=find>\n</function>\n</tool_call>")
    out = Qwen3CoderParser().parse(text, SCHEMAS)
    assert out.content == "Looking." and not out.malformed
    assert calls(out) == [("find", {"zip": "02134", "days": 3, "exact": True, "where": {"city": "Paris"},
                                    "note": "line one\nline two"}), ("find", {})]


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=find>\n<parameter=zip>\n1\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n{\"name\": \"find\", \"arguments\": {}}\n</tool_call>",  # Hermes' JSON is not this format
    "<tool_call>\n<function=find>\n</function>\n",  # cut off
])
def test_qwen3_coder_malformed_stays_in_content(text):
    out = Qwen3CoderParser().parse(text, SCHEMAS)
    assert out.malformed and out.content == text and out.tool_calls == []


def test_glm45_calls_are_typed_by_the_tools_schema():
    text = ("<tool_call>find\n<arg_key>zip</arg_key>\n<arg_value>02134</arg_value>\n<arg_key>tags</arg_key>\n"
            "<arg_value>[\"a\", \"b\"]</arg_value>\n</tool_call><tool_call>find\n</tool_call>")
    out = Glm45Parser().parse(text, SCHEMAS)
    assert calls(out) == [("find", {"zip": "02134", "tags": ["a", "b"]}), ("find", {})] and out.content is None
    broken = "<tool_call>find\n<arg_key>zip</arg_key>\nstray text<arg_value>1</arg_value>\n</tool_call>"
    assert Glm45Parser().parse(broken, SCHEMAS).malformed


def test_gemma4_calls_in_its_own_literal_syntax():
    text = ('Sure.<|tool_call>call:find{days:3,exact:true,note:<|"|>say "hi", then: {go}<|"|>,'
            'where:{city:<|"|>Paris<|"|>,rooms:[1,2]}}<tool_call|><|tool_call>call:find{}<tool_call|><|tool_response>')
    out = Gemma4Parser().parse(text, SCHEMAS)
    assert out.content == "Sure." and not out.malformed
    assert calls(out) == [("find", {"days": 3, "exact": True, "note": 'say "hi", then: {go}',
                                    "where": {"city": "Paris", "rooms": [1, 2]}}), ("find", {})]
    for broken in ('<|tool_call>call:find{zip:<|"|>02134}<tool_call|>', "<|tool_call>call:find{days:3"):
        assert Gemma4Parser().parse(broken).malformed


def test_lfm2_pythonic_calls_between_markers():
    out = Lfm2Parser().parse("Checking.<|tool_call_start|>[find(zip='02134', days=3), find()]<|tool_call_end|>")
    assert calls(out) == [("find", {"zip": "02134", "days": 3}), ("find", {})] and out.content == "Checking."
    assert Lfm2Parser().parse("[find(days=3)] is how I would call it").tool_calls == []  # no markers: text
    assert Lfm2Parser().parse("<|tool_call_start|>[find(days=]<|tool_call_end|>").malformed
    # LFM2.5's template writes a mapping argument with tojson: JSON, not a Python literal
    written = Lfm2Parser().parse('<|tool_call_start|>[find(where={"open": true, "near": null})]<|tool_call_end|>')
    assert calls(written) == [("find", {"where": {"open": True, "near": None}})]


TOOL_FAMILIES = [f for f in FAMILIES if f not in ("smollm2", "gemma3")]  # those two templates show no tools


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_each_family_parses_a_call_as_its_own_template_writes_it(family, tmp_path_factory):
    """The template renders an assistant turn that calls a tool; the parser chosen from that
    template reads the same call back out of the turn's text, arguments typed as they were."""
    chat = family_format(family, tmp_path_factory.mktemp(family))
    args = {"zip": "02134", "days": 3, "where": {"city": "Paris"}}
    call = {"id": "abcdefgh1", "type": "function", "function": {"name": "find", "arguments": json.dumps(args)}}
    tools = [{"type": "function", "function": {"name": "find", "description": "Find a place.",
                                               "parameters": SCHEMAS["find"]}}]
    user = [{"role": "user", "content": "Find it."}]
    loop = user + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "abcdefgh1", "content": "found"}]
    assert chat.template.render(loop, tools, True).startswith(chat.template.render(user, tools, True))
    written = chat.text(written_turn(chat, user, loop, tools))  # as the server decodes it, tags kept
    out = chat.parse(written, tool_schemas(tools))
    assert calls(out) == [("find", args)], written


# ---- reasoning ------------------------------------------------------------------------------------

def test_qwen3_reasoning_split():
    p = ReasoningParser("qwen3")
    assert p.split("<think>\nweigh it\n</think>\n\nYes.") == ("weigh it", "Yes.")
    assert p.split("No thinking here.") == (None, "No thinking here.")
    assert p.split("still thinking", opened=True) == ("still thinking", "")  # cut off mid-thought
    assert p.split("done</think>\n\nAnswer", opened=True) == ("done", "Answer")


def test_deepseek_r1_reasoning_without_the_start_tag():
    p = ReasoningParser("deepseek_r1")
    assert p.split("reasons</think>answer") == ("reasons", "answer")
    assert p.split("<think>unfinished") == ("unfinished", "")


def test_gemma4_reasoning_is_its_thought_channel():
    p = make_reasoning_parser("gemma4")
    assert p.split("<|channel>thought\nweigh it<channel|>Yes.") == ("weigh it", "Yes.")
    assert p.split("Yes.") == (None, "Yes.")


@pytest.mark.parametrize("template,tools,reasoning", [("qwen3_5.jinja", "qwen3_coder", "qwen3"),
                                                      ("glm4_5.jinja", "glm45", "qwen3"),
                                                      ("gemma4.jinja", "gemma4", "gemma4"),
                                                      ("lfm2_5.jinja", "lfm2", "qwen3"),
                                                      ("qwen3.jinja", "hermes", "qwen3")])
def test_the_models_own_templates_choose_their_parsers(template, tools, reasoning):
    source = (TEMPLATES / template).read_text()
    assert (detect_tool_parser(source), detect_reasoning_parser(source)) == (tools, reasoning)


def test_parsers_are_chosen_from_the_template():
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("... [TOOL_CALLS] ...") == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython ... \"parameters\": ") == "llama3_json"
    assert detect_tool_parser("<|channel|>") == "openai" and detect_reasoning_parser("<|channel|>") == "openai"
    assert detect_tool_parser("<start_of_turn>") == "none"
    # LFM2's first template lists tools between its tags and leaves the model's call tags to the model
    assert detect_tool_parser("<|tool_list_start|>[...]<|tool_list_end|>") == "lfm2"
    assert detect_reasoning_parser("<think>") == "qwen3" and detect_reasoning_parser("plain") == "none"
