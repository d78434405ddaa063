"""The Responses and Messages routes and recorded sessions over HTTP, on the embedded model: bad
items and blocks get a 400 naming the field, previous_response_id continues a conversation with
the sampled ids spliced, a kept response is retrieved, listed and deleted as OpenAI's are,
sessions belong to the key that opened them, are bounded and expire, and the new routes take
whatever their OpenAPI schema generates without a 5xx.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from client import TrainConfig, TrainableModel
from server.harness.responses import ResponseStore
from server.harness.sessions import SessionError, Sessions
from server.settings import Settings
from server.store import Store

KEYS = ("key-one", "key-two")
TOOL = {"type": "function", "name": "lookup", "description": "Look an item up.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string", "maxLength": 8}},
                       "required": ["item"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def srv(fresh_server_module):
    return fresh_server_module(api_key=",".join(KEYS))


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
async def model_name(srv):
    return (await TrainableModel("harness-http").register(srv.url, api_key=KEYS[0])).name


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


BAD_MESSAGES = [  # (messages, the field the 400 must name)
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t1", "name": "lookup"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}], "messages[1].content[0]"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"item": "a"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}],
     "messages[2].content[0]"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0]"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
]


@pytest.mark.parametrize("messages,field", BAD_MESSAGES)
def test_malformed_blocks_get_a_400_naming_the_field(http, model_name, messages, field):
    r = http.post("/v1/messages", json={"model": model_name, "max_tokens": 4, "messages": messages})
    err = _error(r)
    assert r.json()["type"] == "error"  # Anthropic's clients read this shape
    assert err["message"].startswith(field) and (err["param"] or "").startswith(field), err
    ok = http.post("/v1/messages", json={"model": model_name, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and ok.json()["content"][0]["type"] == "text"  # and the server serves on


BAD_ITEMS = [
    ([{"role": "user", "content": "hi"}, {"type": "function_call", "name": "lookup", "arguments": "{}"}],
     "input[1]"),
    ([{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c1", "output": "x"}],
     "input[1]"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], "input[0]"),
    ([{"type": "web_search_call", "id": "w"}], "input[0]"),
]


@pytest.mark.parametrize("items,field", BAD_ITEMS)
def test_malformed_items_get_a_400_naming_the_field(http, model_name, items, field):
    err = _error(http.post("/v1/responses", json={"model": model_name, "input": items, "max_output_tokens": 4}))
    assert err["message"].startswith(field) and (err["param"] or "").startswith(field), err


def test_refused_parameters_are_named(http, model_name):
    base = {"model": model_name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert _error(http.post("/v1/messages", json={**base, "top_k": 5}))["param"] == "top_k"
    err = _error(http.post("/v1/messages", json={**base, "tool_choice": {"type": "tool", "name": "lookup"}}))
    assert "tool_choice names 'lookup'" in err["message"]
    err = _error(http.post("/v1/responses", json={"model": model_name, "input": "hi", "previous_response_id": "resp_x"}))
    assert err["param"] == "previous_response_id"


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools"),
    ("/v1/responses", {"conversation": "conv_1"}, "conversation"),
    ("/v1/responses", {"prompt": {"id": "pmpt_1"}}, "prompt"),
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ("/v1/messages", {"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:9", "name": "m"}]}, "mcp_servers"),
])
def test_what_the_provider_would_hold_or_run_is_refused_naming_it(http, model_name, path, extra, param):
    """A hosted tool, a stored conversation or prompt, an MCP server: ignored, the model would answer
    without what the client thinks it has."""
    body = {"input": "hi", "max_output_tokens": 4} if path == "/v1/responses" else \
        {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    err = _error(http.post(path, json={"model": model_name, **body, **extra}))
    assert err["param"] == param and err["message"].startswith(param) and "\n" not in err["message"], err
    assert http.post(path, json={"model": model_name, **body}).status_code == 200  # and it serves on


def test_previous_response_id_continues_with_the_sampled_ids(srv, http, model_name):
    first = http.post("/v1/responses", json={"model": model_name, "input": "What does a hat cost?", "tools": [TOOL],
                                             "tool_choice": "required", "max_output_tokens": 60, "seed": 3}).json()
    [call] = [o for o in first["output"] if o["type"] == "function_call"]
    second = http.post("/v1/responses", json={
        "model": model_name, "previous_response_id": first["id"], "tools": [TOOL], "max_output_tokens": 4,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "12"}]})
    assert second.status_code == 200, second.text
    prompt, ids = first["prompt_token_ids"], first["token_ids"]
    assert second.json()["prompt_token_ids"][: len(prompt) + len(ids)] == prompt + ids
    other = httpx.post(f"{srv.url}/v1/responses", headers={"x-api-key": KEYS[1]}, timeout=60, json={
        "model": model_name, "previous_response_id": first["id"], "input": "more"})
    assert _error(other)["param"] == "previous_response_id"  # another key's response is not there for it


def test_a_kept_response_is_retrieved_listed_and_deleted_as_openai_does(srv, model_name):
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS[0], max_retries=0)
    first = sdk.responses.create(model=model_name, input="What does a hat cost?", max_output_tokens=4)
    second = sdk.responses.create(model=model_name, previous_response_id=first.id, max_output_tokens=4, input=[
        {"role": "user", "content": "And a cap?"}, {"type": "function_call", "call_id": "c1", "name": "lookup",
                                                    "arguments": '{"item": "cap"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "7"}], tools=[TOOL])
    assert sdk.responses.retrieve(second.id).model_dump() == second.model_dump()  # as it was answered

    listed = sdk.responses.input_items.list(second.id)  # newest first, by default
    assert [i.type for i in listed.data] == ["function_call_output", "function_call", "message"]
    assert len({i.id for i in listed.data}) == 3  # not the items of the response it continued
    pages = [page.data for page in sdk.responses.input_items.list(second.id, order="asc", limit=1).iter_pages()]
    assert [[i.type for i in p] for p in pages] == [["message"], ["function_call"], ["function_call_output"]]
    assert pages[0][0].content[0].text == "And a cap?" and pages[1][0].arguments == '{"item": "cap"}'
    [only] = sdk.responses.input_items.list(first.id).data
    assert (only.role, only.content[0].type, only.content[0].text) == ("user", "input_text", "What does a hat cost?")

    stream = list(sdk.responses.create(model=model_name, input="hi", max_output_tokens=4, stream=True))
    assert sdk.responses.retrieve(stream[-1].response.id).model_dump() == stream[-1].response.model_dump()
    unkept = sdk.responses.create(model=model_name, input="hi", max_output_tokens=2, store=False)
    other = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS[1], max_retries=0)
    for missing, client in ((unkept.id, sdk), (second.id, other), ("resp_nothing", sdk)):
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.retrieve(missing)
        assert gone.value.body["param"] == "response_id" and "\n" not in gone.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(missing)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(second.id)  # another key's response is not there for it to delete

    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as cut:
        sdk.responses.create(model=model_name, previous_response_id=first.id, input="more", max_output_tokens=2)
    assert cut.value.body["param"] == "previous_response_id"
    assert sdk.responses.retrieve(second.id).id == second.id  # deleting one keeps the others
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.responses.input_items.list(second.id, after="msg_nothing")
    assert bad.value.body["param"] == "after"


def test_a_retrieve_can_include_the_texts_logprobs_and_echoed_items_keep_their_ids(srv, model_name):
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS[0], max_retries=0)
    ask = dict(model=model_name, input="What does a hat cost?", max_output_tokens=8, extra_body={"seed": 5})
    included = sdk.responses.create(**ask, include=["message.output_text.logprobs"])
    plain = sdk.responses.create(**ask)
    assert plain.output_text == included.output_text  # one sample, asked for twice

    def text(response):
        [message] = [item for item in response.output if item.type == "message"]
        return message.content[0]

    assert text(sdk.responses.retrieve(plain.id)).logprobs is None  # as it was answered
    later = sdk.responses.retrieve(plain.id, include=["message.output_text.logprobs"])
    assert text(later).logprobs == text(included).logprobs and len(text(later).logprobs) > 0
    with pytest.raises(openai.BadRequestError) as streamed:
        sdk.responses.retrieve(plain.id, stream=True)
    assert streamed.value.body["param"] == "stream"

    echoed = sdk.responses.create(model=model_name, max_output_tokens=4, tools=[TOOL], input=[
        {"role": "user", "content": "And a cap?"},
        {"type": "function_call", "id": "fc_echoed", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "7"}])
    ids = [i.id for i in sdk.responses.input_items.list(echoed.id, order="asc").data]
    assert ids[1] == "fc_echoed" and ids[0].startswith("msg_") and ids[2].startswith("fco_")


async def test_a_session_belongs_to_its_key_and_trains_from_what_was_recorded(srv, http, model_name):
    body = {"model": model_name, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    for seed, sid in enumerate(("owned-a", "owned-b")):
        r = httpx.post(f"{srv.url}/v1/sessions/{sid}/messages", headers={"x-api-key": KEYS[0]},
                       json={**body, "seed": seed}, timeout=60)
        assert r.status_code == 200, r.text
    assert http.get("/v1/sessions/owned-a").json()["exchanges"] == 1
    other = {"Authorization": f"Bearer {KEYS[1]}"}  # ids are per key: to it, another key's id is a new session
    assert httpx.get(f"{srv.url}/v1/sessions/owned-a", headers=other).status_code == 404
    r = httpx.post(f"{srv.url}/v1/sessions/owned-a/chat/completions", headers=other, timeout=60, json=body)
    assert r.status_code == 200, r.text
    assert http.get("/v1/sessions/owned-a").json()["exchanges"] == 1  # not recorded into the first key's
    jobs = {"groups": [{"sessions": [{"session_id": "owned-a", "reward": 0}, {"session_id": "owned-b", "reward": 1}]}]}
    r = httpx.post(f"{srv.url}/v1/runs/{model_name}/session-jobs", headers=other, json=jobs, timeout=60)
    assert _error(r, 404)["param"] == "groups[0].sessions[1].session_id"  # its own owned-a, and no owned-b
    r = http.post(f"/v1/runs/{model_name}/session-jobs", json={"groups": [{"sessions": [
        {"session_id": "never-used", "reward": 0}]}]})
    assert _error(r, 404)["param"] == "groups[0].sessions[0].session_id"

    model = await TrainableModel(model_name).register(srv.url, api_key=KEYS[0])
    result = await model.train_sessions([[("owned-a", 0.0), ("owned-b", 1.0)]], TrainConfig(learning_rate=1e-3))
    m = result.metrics
    assert m.trained_choices == m.choices == 2 and m.prompt_mismatches == 0


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/sessions/s1/nothing-here", 404, "unknown_route"),
    ("POST", "/v1/sessions/s1/v1/embeddings", 404, "unknown_route"),
    ("PUT", "/v1/sessions/s1/models", 405, "method_not_allowed"),  # served, with GET
    ("GET", "/v1/sessions/s1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/sessions/s1/v1/messages", 405, "method_not_allowed")])
def test_a_route_a_session_lacks_is_named_with_the_routes_it_has(http, method, path, status, code):
    error = _error(http.request(method, path), status)
    assert error["code"] == code and "a session serves POST chat/completions" in error["message"], error


def _recorded(sessions: Sessions, sid: str, owner: str, choice: dict) -> None:
    recording = sessions.recording(sid, owner)
    recording.begin([{"role": "user", "content": "hi"}], None)
    recording(choice)
    recording.end()


@pytest.mark.unit
def test_sessions_are_bounded_and_expire():
    now = [0.0]
    defaults = Settings()
    sessions = Sessions(ttl=10, max_sessions=3, max_per_key=2, max_exchanges=2, max_tokens=defaults.session_max_tokens,
                        max_bytes=defaults.session_max_bytes, clock=lambda: now[0])
    choice = {"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop", "token_ids": [1],
              "sampling": {"prompt_len": 3}}
    for _ in range(2):
        _recorded(sessions, "a", "k", choice)
    with pytest.raises(SessionError) as full:
        sessions.recording("a", "k").begin([], None)
    assert full.value.status == 409 and "full" in full.value.message
    _recorded(sessions, "b", "k", choice)
    with pytest.raises(SessionError) as many:
        sessions.recording("c", "k").begin([], None)
    assert many.value.status == 429 and "this key" in many.value.message  # the key's count
    _recorded(sessions, "b", "someone else", choice)  # their own "b"
    with pytest.raises(SessionError) as all_:
        sessions.recording("c", "a third").begin([], None)
    assert all_.value.status == 429 and "this server" in all_.value.message  # the server's count
    now[0] = 11.0
    with pytest.raises(SessionError) as gone:
        sessions.get("a", "k")
    assert gone.value.status == 404
    _recorded(sessions, "c", "k", choice)  # the expired ones made room


@pytest.mark.unit
def test_kept_responses_are_bounded_in_bytes_and_time_and_owned():
    now = [0.0]
    store = ResponseStore(ttl=10, max_bytes=3_000, clock=lambda: now[0])
    for i in range(3):
        store.put(f"r{i}", "k", "m", [{"role": "user", "content": "x" * 1_200}], {"id": f"r{i}"}, [])
    # three are over 3,000 bytes: the oldest goes
    assert [store.get(f"r{i}", "k") is not None for i in range(3)] == [False, True, True]
    assert store.get("r2", "someone else") is None and not store.delete("r2", "someone else")
    assert json.loads(store.get("r2", "k").body) == {"id": "r2"}
    assert store.delete("r2", "k") and store.get("r2", "k") is None and not store.delete("r2", "k")
    store.put("big", "k", "m", [{"role": "user", "content": "x" * 5_000}], {}, [])  # alone over the bound: kept
    assert store.get("big", "k") is not None and store.get("r1", "k") is None
    now[0] = 11.0
    assert store.get("big", "k") is None  # expired


@pytest.mark.unit
def test_kept_responses_read_back_from_the_store_keep_its_order_and_bounds(tmp_path):
    store = Store(tmp_path / "artisan.sqlite")
    kept = ResponseStore(ttl=3600, store=store.responses)
    for i in range(4):
        kept.put(f"r{i}", "k", "m", [{"role": "user", "content": "x" * 1_200}], {"id": f"r{i}"}, [{"id": f"i{i}"}])
    kept.delete("r3", "k")
    again = ResponseStore(ttl=3600, max_bytes=3_000, store=store.responses)  # room for two now
    assert [again.get(f"r{i}", "k") is not None for i in range(4)] == [False, True, True, False]
    assert again.get("r2", "k").input_items == ({"id": "i2"},) and json.loads(again.get("r2", "k").body) == {"id": "r2"}
    assert [row["id"] for row in store.responses.load()] == ["r1", "r2"]  # what did not fit is gone from the store
    store.close()


NEW_ROUTES = ("/v1/responses", "/v1/messages", "/v1/sessions/")


def _short(body) -> None:
    if isinstance(body, dict):
        for key in ("max_tokens", "max_output_tokens"):
            if key in body or key == "max_output_tokens" and "input" in body:
                body[key] = 4
        body.pop("n", None)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_to_the_new_routes_gets_a_server_error(srv, model_name, mode):
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [o for o in operations if o.path.startswith(NEW_ROUTES) or o.path.endswith("/session-jobs")]
    assert len(operations) >= 8, [o.path for o in operations]
    failures: list[str] = []
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            _short(case.body)
            response = case.call(base_url=srv.url, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{operation.method.upper()} {operation.path} -> {response.status_code}: "
                                f"{response.text[:300]} for {case.as_curl_command()[:500]}")

        try:
            run()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, operation.path
    assert failures == [], "\n".join(failures[:10])
