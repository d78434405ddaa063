"""Fields the Chat, Responses and Messages APIs accept are honoured or refused, never silently ignored:
on the embedded model, through the real `openai` and `anthropic` SDKs, a field the server cannot
honour (`top_k`) or a value Anthropic does not define (`thinking.type`, `thinking.budget_tokens`)
is a 400 naming the field, and `text.format` constrains the answer as chat's `response_format` does.
A schema's objects admit only the properties they list, unless they say otherwise, as in vLLM.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

MODEL = "artisan-tiny"
SCHEMA = {"type": "object", "properties": {"score": {"type": "integer", "maximum": 9}}, "required": ["score"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120) as client:
        yield client


@pytest.mark.parametrize("extra,field", [
    ({"extra_body": {"top_k": 5}}, "top_k"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object", "properties": 7}}}},
     "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
])
def test_responses_refuses_what_it_cannot_honour_naming_the_field(oai, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, **extra)
    assert e.value.status_code == 400
    assert e.value.body["param"].startswith(field), e.value.body
    assert field in e.value.body["message"]


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("frequency_penalty", -1.0),
                                         ("logit_bias", {"50": 100}), ("top_k", 5), ("min_p", 0.1),
                                         ("repetition_penalty", 1.1)])
def test_chat_refuses_a_knob_that_would_change_the_distribution_naming_it(oai, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"], e.value.body


def test_a_message_without_content_is_named_not_left_to_the_template(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "s"}, {"role": "user"}],
                                    max_tokens=2)
    assert e.value.body["message"] == "messages[1].content is required in a user message", e.value.body
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2  # and the server serves on


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "lookup", "parameters": {"type": "object"}}]), ("function_call", "auto"),
    ("web_search_options", {}), ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"])])
def test_chat_refuses_what_no_model_here_could_honour_naming_it(oai, field, value):
    """Ignored, the model would never see the functions (nor search, nor speak): a silent no-op to train on."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={field: value})
    assert e.value.body["param"].startswith(field) and e.value.body["message"].startswith(field), e.value.body
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    modalities=["text"])
    assert r.usage.completion_tokens == 2


def test_chat_takes_the_neutral_values_clients_send_by_default(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="u",
                                    extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert r.usage.completion_tokens == 2


def test_a_model_is_retrieved_by_any_name_chat_samples_from(oai):
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-run@3")
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


def test_responses_text_format_json_schema_constrains_the_answer(oai):
    r = oai.responses.create(model=MODEL, input="Score it.", max_output_tokens=40, store=False, extra_body={"seed": 2},
                             text={"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}})
    assert set(json.loads(r.output_text)) == {"score"}
    assert r.text.format.type == "json_schema"


def test_a_schema_that_lists_properties_gets_those_keys_only_as_in_vllm(oai):
    # No "additionalProperties": JSON Schema would admit any other key, and the embedded model
    # under it wrote keys of its own until max_tokens; xgrammar, outlines and so vLLM admit none.
    schema = {"type": "object", "properties": {"price": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["price"]}
    tool = {"type": "function", "function": {"name": "answer", "parameters": schema}}
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Apple price is 7."}],
                                        max_tokens=48, seed=seed, response_format={
                                            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        assert set(json.loads(r.choices[0].message.content)) == {"price"}, r.choices[0].message.content
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Apple price is 7."}],
                                        max_tokens=48, seed=seed, tools=[tool],
                                        tool_choice={"type": "function", "function": {"name": "answer"}})
        (call,) = r.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"price"}, call.function.arguments


def test_responses_plain_text_format_still_samples(oai):
    r = oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False,
                             text={"format": {"type": "text"}})
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1


@pytest.mark.parametrize("thinking,max_tokens,field", [
    ({"type": "sometimes"}, 2048, "thinking.type"),
    ({"type": "enabled", "budget_tokens": 10**9}, 2048, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 100}, 2048, "thinking.budget_tokens"),
    ({"type": "enabled"}, 2048, "thinking.budget_tokens"),
])
def test_messages_refuses_thinking_anthropic_does_not_define(claude, thinking, max_tokens, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=max_tokens, thinking=thinking,
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400
    assert field in e.value.body["error"]["message"], e.value.body


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                      {"type": "adaptive"}])
def test_messages_with_thinking_anthropic_defines_still_samples(claude, thinking):
    m = claude.messages.create(model=MODEL, max_tokens=1025, thinking=thinking, stop_sequences=[" ", "a", "e", "o"],
                               messages=[{"role": "user", "content": "hi"}])
    assert m.usage.output_tokens >= 1


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_messages_structured_outputs_constrain_the_answer(claude, field):
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = {"output_config": {"format": fmt, "effort": "low"}} if field == "output_config" else {"output_format": fmt}
    for seed in range(2):
        m = claude.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Score it."}],
                                   extra_body={**body, "seed": seed})
        assert m.stop_reason == "end_turn" and set(json.loads(m.content[0].text)) == {"score"}, m.content
        # the effort reaches the template as chat's reasoning_effort does
        assert m.model_extra["sampling"].get("chat_template_kwargs") == (
            {"reasoning_effort": "low"} if field == "output_config" else None), m.model_extra["sampling"]
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Score it."}],
                                extra_body=body) as stream:
        assert set(json.loads(stream.get_final_message().content[0].text)) == {"score"}


@pytest.mark.parametrize("body,field", [
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
      "output_format": {"type": "json_schema", "schema": SCHEMA}}, "output_format")])
def test_messages_refuses_a_format_it_cannot_honour(claude, body, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], extra_body=body)
    assert field in e.value.body["error"]["message"] or field == e.value.body["error"]["param"], e.value.body


def test_messages_refuses_a_prefill_it_would_answer_as_a_new_turn(claude):
    # To Anthropic the last assistant message is the answer's start; a template would close it and
    # answer anew, and the client would join the two.
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "The price"}])
    assert e.value.body["error"]["param"] == "messages[1]" and "prefill" in e.value.body["error"]["message"]
    m = claude.messages.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "The price"},
        {"role": "user", "content": "and?"}])
    assert m.usage.output_tokens >= 1


def test_messages_count_tokens_counts_what_the_same_request_would_render(server, claude):
    # Claude Code asks before each turn, to know when to compact its context.
    tools = [{"name": "get_price", "description": "Price of an item", "input_schema": {
        "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}]
    history = [{"role": "user", "content": "What does a lamp cost?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_price",
                                                  "input": {"item": "lamp"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}]
    kw = dict(model=MODEL, messages=history, system="Be brief.", tools=tools)
    sampled = claude.messages.create(max_tokens=2, **kw).usage.input_tokens
    assert claude.messages.count_tokens(**kw).input_tokens == sampled
    assert claude.beta.messages.count_tokens(**kw).input_tokens == sampled  # Claude Code's: ?beta=true
    # A conversation that ends on the assistant's turn is counted as it stands, not refused as a prefill.
    longer = claude.messages.count_tokens(model=MODEL, messages=[*history, {"role": "assistant", "content": "It is"}])
    assert longer.input_tokens > claude.messages.count_tokens(model=MODEL, messages=history).input_tokens

    in_session = anthropic.Anthropic(base_url=server.url + "/v1/sessions/counted", api_key="x", max_retries=0)
    assert in_session.messages.count_tokens(**kw).input_tokens == sampled
    in_session.messages.create(max_tokens=2, **kw)
    # the exchange sampled is the session's one: counting recorded none
    assert httpx.get(server.url + "/v1/sessions/counted").json()["exchanges"] == 1

    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.count_tokens(model="no-such-run", messages=history)
    assert e.value.body["type"] == "error" and e.value.body["error"]["param"] == "model", e.value.body
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "tool_use"}]}])
    assert e.value.body["error"]["message"].startswith("messages[0].content[0]"), e.value.body


def test_the_models_route_answers_anthropic_s_client_too(claude, oai):
    """Claude Code lists the models and sizes its context by them: one route, both SDKs' fields."""
    (listed,) = [m for m in claude.models.list() if m.id == MODEL]
    got = claude.models.retrieve(MODEL)
    window = oai.models.retrieve(MODEL).model_extra["max_model_len"]
    for m in (listed, got):
        assert m.type == "model" and m.display_name == MODEL and m.created_at.year >= 2024
        assert m.max_input_tokens == window
    assert [m.id for m in oai.models.list()] == [m.id for m in claude.models.list()]
