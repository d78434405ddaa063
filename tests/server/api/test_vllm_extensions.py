"""vLLM's own request keys and routes, as RL clients written against vLLM send them, on the embedded
model: structured outputs (`structured_outputs`, or the older `guided_*` keys) constrain the answer
on the chat, text and token-in routes; `return_tokens_as_token_ids` names each logprob's token by
its id; a key that would change what is sampled or returned (`min_tokens`,
`continue_final_message`, ...) is a 400 naming it, not silently dropped, while its default value is
taken; and `/tokenize` gives the ids a chat completion of the same messages is prompted with.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

MODEL = "artisan-tiny"
ASK = [{"role": "user", "content": "Pick one."}]


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client


def _chat(oai, n: int = 1, **extra_body):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, n=n, seed=1, extra_body=extra_body)
    assert all(c.finish_reason == "stop" for c in r.choices), r.choices  # the grammar ended the answer
    return [c.message.content for c in r.choices]


def _matches(schema):
    def check(text):
        value = json.loads(text)
        return set(value) == set(schema["properties"]) and all(isinstance(v, int) for v in value.values())
    return check


SCORE = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["score"]}
CONSTRAINED = [
    ({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}}, lambda t: t in ("yes", "no", "maybe so")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"guided_regex": "(red|blue) [0-9]"}, lambda t: re.fullmatch("(red|blue) [0-9]", t)),
    ({"structured_outputs": {"json": SCORE}}, _matches(SCORE)),
    ({"structured_outputs": {"json": json.dumps(SCORE)}}, _matches(SCORE)),  # the schema as its JSON text
    ({"guided_json": SCORE}, _matches(SCORE)),
    ({"structured_outputs": {"grammar": 'start: "A" | "B" "C"'}}, lambda t: t in ("A", "BC")),
]


@pytest.mark.parametrize("extra,ok", CONSTRAINED, ids=lambda x: json.dumps(x)[:40] if isinstance(x, dict) else "")
def test_structured_outputs_constrain_every_chat_choice(oai, extra, ok):
    for text in _chat(oai, n=3, **extra):
        assert ok(text), (extra, text)


def test_a_json_object_is_begun_whatever_the_model_would_write(oai):
    # Any object: the embedded model writes keys until max_tokens, so only its start is certain.
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, n=3, extra_body={
        "structured_outputs": {"json_object": True, "disable_fallback": True}})  # a backend hint, taken
    assert all(c.message.content.startswith('{"') for c in r.choices), r.choices


def test_structured_outputs_constrain_the_text_and_token_in_routes(server, oai):
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The colour is", "max_tokens": 10, "n": 3, "guided_regex": " (red|blue)\\."})
    assert r.status_code == 200, r.text
    assert all(c["text"] in (" red.", " blue.") for c in r.json()["choices"]), r.json()["choices"]
    ids = oai.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices[0].model_extra["prompt_token_ids"]
    r = httpx.post(server.url + "/inference/v1/generate", timeout=120, json={
        "model": MODEL, "token_ids": ids,
        "sampling_params": {"max_tokens": 10, "structured_outputs": {"choice": ["up", "down"]}}})
    assert r.status_code == 200, r.text
    text = oai.completions.create(model=MODEL, prompt=r.json()["choices"][0]["token_ids"], max_tokens=1, echo=True,
                                  temperature=0).choices[0].text
    assert text.startswith(("up", "down")), text  # the sampled ids spell a choice


@pytest.mark.parametrize("field,value", [
    ("min_tokens", 3), ("use_beam_search", True), ("include_stop_str_in_output", True), ("truncate_prompt_tokens", 8),
    ("allowed_token_ids", [1, 2]), ("bad_words", ["the"]), ("logits_processors", ["mine"]), ("prompt_logprobs", 1),
    ("continue_final_message", True), ("add_generation_prompt", False), ("echo", True),
    ("structured_outputs", {"choice": ["a"], "regex": "b"}), ("structured_outputs", {}),
    ("structured_outputs", {"structural_tag": "{}"}), ("structured_outputs", {"grammar": 'root ::= "a"'}),
    ("structured_outputs", {"regex": "("}), ("structured_outputs", {"json": "{not json"})])
def test_chat_refuses_a_vllm_key_it_would_not_honour_naming_it(oai, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={field: value})
    assert e.value.body["param"].startswith(field) and field in e.value.body["message"], e.value.body
    assert "\n" not in e.value.body["message"]
    assert oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("extra", [
    {"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}},
    {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}])
def test_two_constraints_in_one_request_are_refused(oai, extra):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=extra)
    assert "structured_outputs" in e.value.body["message"], e.value.body


def test_the_text_and_token_in_routes_refuse_them_too(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    for sampling, field in (({"bad_words": ["x"]}, "bad_words"), ({"guided_regex": "("}, "structured_outputs")):
        r = httpx.post(server.url + "/inference/v1/generate", timeout=60,
                       json={"model": MODEL, "token_ids": [1, 2], "sampling_params": {"max_tokens": 2, **sampling}})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == f"sampling_params.{field}", r.text
        assert error["message"].startswith(f"sampling_params.{field}: "), r.text


def test_the_defaults_vllm_clients_send_are_taken(server, oai):
    neutral = {"min_tokens": 0, "use_beam_search": False, "include_stop_str_in_output": False, "bad_words": [],
               "logits_processors": [], "skip_special_tokens": True, "guided_json": None, "structured_outputs": None}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={
        **neutral, "continue_final_message": False, "add_generation_prompt": True, "echo": False})
    assert r.usage.completion_tokens == 2
    r = httpx.post(server.url + "/inference/v1/generate", timeout=60,
                   json={"model": MODEL, "token_ids": [1, 2], "sampling_params": {"max_tokens": 2, **neutral}})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text


def _names(content):
    return [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in content]


def test_return_tokens_as_token_ids_names_each_token_by_its_id(server, oai):
    kw = dict(model=MODEL, messages=ASK, max_tokens=6, logprobs=True, top_logprobs=2, seed=3)
    plain = oai.chat.completions.create(**kw).choices[0]
    named = oai.chat.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = named.model_extra["token_ids"]
    assert ids == plain.model_extra["token_ids"]  # the same sample, named otherwise
    assert [e.token for e in named.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert all(re.fullmatch(r"token_id:\d+", t.token) for e in named.logprobs.content for t in e.top_logprobs)
    assert [e.bytes for e in named.logprobs.content] == [e.bytes for e in plain.logprobs.content]  # the token's own
    assert not any(e.token.startswith("token_id:") for e in plain.logprobs.content)

    streamed = []
    for chunk in oai.chat.completions.create(**kw, stream=True, extra_body={"return_tokens_as_token_ids": True}):
        streamed += [e.token for e in (chunk.choices[0].logprobs.content or [])] if chunk.choices[0].logprobs else []
    assert streamed == [f"token_id:{t}" for t in ids]

    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "The colour", "max_tokens": 3, "logprobs": 2, "echo": True,
        "return_tokens_as_token_ids": True})
    choice = r.json()["choices"][0]
    every = choice["prompt_token_ids"] + choice["token_ids"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in every]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in choice["logprobs"]["top_logprobs"][1:] for k in top)


def test_tokenize_gives_the_ids_chat_would_prompt_with_sampled_turns_spliced(server, oai):
    tools = [{"type": "function", "function": {"name": "get_price", "parameters": {
        "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=6, seed=4)
    turn = first.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
    convo = [*ASK, turn, {"role": "user", "content": "Again."}]
    second = oai.chat.completions.create(model=MODEL, messages=convo, tools=tools, max_tokens=1)
    r = httpx.post(server.url + "/tokenize", timeout=60, json={"model": MODEL, "messages": convo, "tools": tools})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == second.model_extra["prompt_token_ids"]  # the first turn's sampled ids within
    assert r.json()["count"] == len(r.json()["tokens"])
    assert r.json()["max_model_len"] == oai.models.retrieve(MODEL).model_extra["max_model_len"]

    text = httpx.post(server.url + "/tokenize", timeout=60,
                      json={"prompt": "The colour is", "return_token_strs": True}).json()  # no model: the base's
    assert text["tokens"] == oai.completions.create(model=MODEL, prompt="The colour is",
                                                    max_tokens=1).choices[0].model_extra["prompt_token_ids"]
    assert len(text["token_strs"]) == text["count"]
    back = httpx.post(server.url + "/detokenize", timeout=60, json={"model": MODEL, "tokens": text["tokens"]}).json()
    assert back["prompt"].endswith("The colour is"), back


@pytest.mark.parametrize("route,body,status,field", [
    ("/tokenize", {"model": MODEL}, 400, None),
    ("/tokenize", {"prompt": "a", "messages": ASK}, 400, None),
    ("/tokenize", {"model": "no-such-run", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"messages": ASK, "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": ASK, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": [None], "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-5]}, 400, "tokens"),
    ("/detokenize", {"model": "no-such-run", "tokens": [1]}, 404, "model")])
def test_tokenize_and_detokenize_refuse_what_they_cannot_do_naming_it(server, route, body, status, field):
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == field, r.text
