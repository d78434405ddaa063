"""Bad requests, auth, the bind guard and the bounded queue, against a real art-server.

Every failure a client can cause must come back as an OpenAI-style error body with the right
status, and the server must go on answering good requests afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import ROOT, free_port

MODEL = "artisan-tiny"
CONTEXT_WINDOW = 2048
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_still_serving(url: str, headers: dict | None = None) -> None:
    resp = httpx.post(url + "/v1/chat/completions", json=GOOD, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"]


def call(id_: str, name: str = "get_weather", arguments: str = "{}") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def tools_with(function: dict) -> list[dict]:
    return [{"type": "function", "function": function}]


# (body overrides, status, param, code); param/code None means "not checked"
BAD_BODIES = {
    "temperature_not_a_number": ({"temperature": "hot"}, 400, "temperature", None),
    "temperature_out_of_range": ({"temperature": 3}, 400, "temperature", None),
    "top_p_zero": ({"top_p": 0}, 400, "top_p", None),
    "messages_not_a_list": ({"messages": "hi"}, 400, "messages", None),
    "message_not_an_object": ({"messages": ["hi"]}, 400, "messages[0]", None),
    "model_missing": ({"model": None}, 400, "model", None),
    "unknown_model": ({"model": "no-such-model"}, 404, "model", "model_not_found"),
    "n_zero": ({"n": 0}, 400, "n", None),
    "n_too_large": ({"n": 1000}, 400, "n", None),
    "n_not_an_int": ({"n": "two"}, 400, "n", None),
    "max_tokens_zero": ({"max_tokens": 0}, 400, "max_tokens", None),
    "max_tokens_negative": ({"max_tokens": -5}, 400, "max_tokens", None),
    "max_completion_tokens_zero": ({"max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    "seed_beyond_int64": ({"seed": 2**64}, 400, "seed", None),
    "too_many_stops": ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    "top_logprobs_without_logprobs": ({"top_logprobs": 3}, 400, "top_logprobs", None),
    "top_logprobs_too_many": ({"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", None),
    "empty_messages": ({"messages": []}, 400, "messages", None),
    "tool_message_first": ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]},
                           400, "messages", "invalid_messages"),
    "tool_message_after_user": ({"messages": [{"role": "user", "content": "a"},
                                              {"role": "tool", "tool_call_id": "x", "content": "r"}]},
                                400, "messages", "invalid_messages"),
    "tool_message_after_assistant_without_calls": ({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "tool", "tool_call_id": "x", "content": "r"}]}, 400, "messages", "invalid_messages"),
    "tool_message_for_another_call": ({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call("x")]},
        {"role": "tool", "tool_call_id": "y", "content": "r"}]}, 400, "messages", "invalid_messages"),
    "system_in_the_middle": ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
                             400, "messages", "invalid_messages"),
    "unknown_role": ({"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages", "invalid_messages"),
    "image_content": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                      400, "messages", "invalid_messages"),
    "token_ids_out_of_vocab": ({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b", "token_ids": [10**9]},
                                             {"role": "user", "content": "c"}]}, 400, "messages[1].token_ids", None),
    "tool_bad_function_name": ({"tools": tools_with({"name": "get weather!", "parameters": {"type": "object"}})},
                               400, "tools[0].function.name", None),
    "tool_parameters_not_object": ({"tools": tools_with({"name": "f", "parameters": {"type": "string"}})},
                                   400, "tools[0].function.parameters", None),
    "tool_properties_not_schemas": ({"tools": tools_with({"name": "f", "parameters": {
        "type": "object", "properties": {"x": "string"}}})}, 400, "tools[0].function.parameters", None),
    "tool_wrong_type": ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools[0].type", None),
    "tool_choice_unknown": ({"tools": tools_with({"name": "f"}), "tool_choice": "sometimes"}, 400, "tool_choice", None),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_request_gets_an_openai_error_and_the_server_goes_on(server, name):
    overrides, status, param, code = BAD_BODIES[name]
    body = {**GOOD, **overrides}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    err = assert_error(resp, status, param, code)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert_still_serving(server.url)


# A check across fields (a model validator) names the field to blame, on every face; (path, body, param).
CROSS_FIELD = [
    ("/v1/chat/completions", {**GOOD, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**GOOD, "structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "stream": True}, "prompt"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "tool_choice": "required"}, "tool_choice"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                      "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/chat/completions", {**GOOD, "response_format": {"type": "json_schema"}}, "response_format"),
]


@pytest.mark.parametrize("path, body, param", CROSS_FIELD)
def test_a_check_across_fields_names_the_field_in_its_own_words(server, path, body, param):
    resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]  # Anthropic's body wraps it too, beside its "type"
    assert err["param"] == param and err["message"].startswith((param + " ", param + ": ")), err
    assert "Value error" not in err["message"] and "\n" not in err["message"], err


def test_the_problems_beyond_the_first_are_counted(server):
    one_more = assert_error(httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                       json={**GOOD, "temperature": "hot", "top_p": "high"}), 400)
    assert one_more["message"].endswith("(and 1 more problem)"), one_more
    two_more = assert_error(httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                       json={**GOOD, "temperature": "hot", "top_p": "high", "n": "two"}), 400)
    assert two_more["message"].endswith("(and 2 more problems)"), two_more


@pytest.mark.parametrize("raw", [b'{"model": "artisan-tiny", "messages": [', b"not json at all", b"\xff\xfe"])
def test_invalid_json_is_a_400(server, raw):
    resp = httpx.post(server.url + "/v1/chat/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=60)
    err = assert_error(resp, 400, code="invalid_json")
    assert "JSON" in err["message"]
    assert_still_serving(server.url)


def test_body_that_is_not_an_object_is_a_400(server):
    resp = httpx.post(server.url + "/v1/chat/completions", json=[1, 2, 3], timeout=60)
    assert_error(resp, 400)
    assert_still_serving(server.url)


def test_prompt_longer_than_the_context_window_says_by_how_much(server):
    tok = AutoTokenizer.from_pretrained(ROOT / "server" / "embedded" / "model")
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(1500))}]
    prompt_len = len(tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False))
    assert prompt_len > CONTEXT_WINDOW
    over = prompt_len - CONTEXT_WINDOW + 1  # one generated token must fit too
    resp = httpx.post(server.url + "/v1/chat/completions", json={**GOOD, "messages": messages}, timeout=60)
    err = assert_error(resp, 400, "messages", "context_length_exceeded")
    assert f"{prompt_len} tokens" in err["message"] and f"{over} more" in err["message"]
    assert str(CONTEXT_WINDOW) in err["message"]
    assert_still_serving(server.url)


def test_max_tokens_past_the_window_is_clamped_and_ends_with_length(server):
    # The longest prompt of this shape that still fits leaves room for a few tokens; ask for far more.
    tok = AutoTokenizer.from_pretrained(ROOT / "server" / "embedded" / "model")

    def prompt(words: int) -> tuple[list[dict], int]:
        messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(words))}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return messages, len(tok.encode(text, add_special_tokens=False))

    lo, hi = 1, 1500  # prompt(lo) fits, prompt(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if prompt(mid)[1] < CONTEXT_WINDOW else (lo, mid)
    messages, n = prompt(lo)
    room = CONTEXT_WINDOW - n
    assert 1 <= room <= 8
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={**GOOD, "messages": messages, "max_tokens": 500, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert len(choice["token_ids"]) == room and choice["finish_reason"] == "length"


def test_sdk_raises_typed_errors(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="nope", messages=GOOD["messages"])
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=GOOD["messages"], n=0)
        assert e.value.body["param"] == "n"
        assert c.chat.completions.create(**GOOD).choices


def test_oversize_body_is_a_413(server):
    """The CLI has no flag for the body limit (64 MiB by default), so announce a larger body than
    that on a raw socket: the server must refuse on the header, before reading it."""
    limit = 64 * 1024 * 1024
    payload = json.dumps(GOOD).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limit + 1}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + payload)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.split()[1] == b"413", data[:300]
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "payload_too_large" and str(limit) in body["error"]["message"]
    assert_still_serving(server.url)


def test_unknown_route_is_an_openai_style_404(server):
    error = assert_error(httpx.get(server.url + "/v1/nothing-here", timeout=30), 404, code="unknown_route")
    assert error["message"] == "no route GET /v1/nothing-here"


def test_a_method_a_path_does_not_take_is_the_client_s_error_in_one_line(server):
    error = assert_error(httpx.put(server.url + "/v1/models", timeout=30), 405, code="method_not_allowed")
    assert error["type"] == "invalid_request_error" and error["message"] == "/v1/models does not take PUT"


@pytest.mark.parametrize("method, path, allow", [
    ("PUT", "/v1/responses/resp_x", "DELETE, GET"),  # two routes at one path, each with one method
    ("POST", "/health", "GET"),  # the app's own route
    ("PUT", "/v1/sessions/s1/responses/resp_x", "DELETE, GET"),  # under a session: not the catch-all's methods
    ("OPTIONS", "/v1/sessions/s1/v1/responses", "POST"),
    ("GET", "/v1/chat/completions", "POST")])
def test_a_405_names_every_method_the_path_takes(server, method, path, allow):
    resp = httpx.request(method, server.url + path, timeout=30)
    assert resp.status_code == 405 and resp.headers["allow"] == allow, (resp.headers, resp.text)


# ---- auth ---------------------------------------------------------------------------------------

def test_api_key_is_required_on_every_route_but_health(fresh_server):
    srv = fresh_server(api_key="secret")
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"},
                    {"Authorization": "Basic secret"}):
        err = assert_error(httpx.get(srv.url + "/v1/models", headers=headers, timeout=30), 401, code="invalid_api_key")
        assert err["type"] == "authentication_error"
        resp = httpx.post(srv.url + "/v1/chat/completions", json=GOOD, headers=headers, timeout=30)
        assert_error(resp, 401, code="invalid_api_key")
        assert resp.headers.get("www-authenticate") == "Bearer"
    ok = {"Authorization": "Bearer secret"}
    assert MODEL in [m["id"] for m in httpx.get(srv.url + "/v1/models", headers=ok, timeout=30).json()["data"]]
    assert_still_serving(srv.url, ok)

    with openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(**GOOD)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="secret", max_retries=0) as c:
        assert c.chat.completions.create(**GOOD).choices[0].message.role == "assistant"


def test_cli_refuses_a_public_bind_without_an_api_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ARTISAN_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "server.cli", "--host", "0.0.0.0", "--port", str(free_port()),
                           "--data-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "API key" in proc.stdout + proc.stderr


# ---- bounded queue --------------------------------------------------------------------------------

async def test_full_queue_answers_503_with_retry_after(fresh_server):
    srv = fresh_server(extra=["--max-batch", "1", "--max-waiting", "2"])
    body = {**GOOD, "max_tokens": 200, "ignore_eos": True}

    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
        responses = await asyncio.gather(*[c.post("/v1/chat/completions", json=body) for _ in range(12)])
    ok = [r for r in responses if r.status_code == 200]
    full = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(full) == len(responses), [r.status_code for r in responses]
    assert ok and full
    for r in full:
        assert_error(r, 503, code="overloaded")
        assert int(r.headers["retry-after"]) >= 1
    for r in ok:
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == 200 and choice["finish_reason"] == "length"
    assert_still_serving(srv.url)
