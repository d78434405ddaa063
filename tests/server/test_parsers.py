"""Tool-call and reasoning parsers per family, as vLLM names them: well-formed, parallel,
nested-JSON arguments, and malformed output (which stays in content, flagged)."""

from __future__ import annotations

import json

import pytest

from server.chat.parsers import (HarmonyParser, HermesParser, Llama3JsonParser, MistralParser, PythonicParser,
                                 ReasoningParser, detect_reasoning_parser, detect_tool_parser)

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


def test_parsers_are_chosen_from_the_template():
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("... [TOOL_CALLS] ...") == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython ... \"parameters\": ") == "llama3_json"
    assert detect_tool_parser("<|channel|>") == "openai" and detect_reasoning_parser("<|channel|>") == "openai"
    assert detect_tool_parser("<start_of_turn>") == "none"
    assert detect_reasoning_parser("<think>") == "qwen3" and detect_reasoning_parser("plain") == "none"
