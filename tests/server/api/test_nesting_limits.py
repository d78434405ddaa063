"""JSON nested past its bound is refused where it arrives, and a large body holds up no one.

Tool-call arguments a few thousand levels deep (a few KB) made Chat and Responses answer 500 (the
template's parser raised RecursionError) and a training job holding them was accepted, to fail
later; a body validated on the event loop held every other request up for seconds.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from pydantic import BaseModel, field_validator

from protocol.nesting import MAX_ARGUMENT_DEPTH, MAX_BODY_DEPTH, TooDeep, check_arguments, nesting_depth

DEEP_ARGS = '{"a": ' * 3000 + "1" + "}" * 3000  # about 18 KB
FINE_ARGS = json.dumps({"city": "Paris", "filters": {"when": {"from": "2024-01-01", "to": ["x", {"y": 1}]}}})
RUN = "nesting-run"


def _post(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=120)


def _call_messages(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _still_serving(url: str) -> None:
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    r = _post(url, "/v1/chat/completions", {"model": "artisan-tiny", "max_tokens": 2,
                                            "messages": _call_messages(FINE_ARGS)})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def run(server):
    assert _post(server.url, "/v1/runs", {"name": RUN}).status_code == 200
    return RUN


# ---- the bound itself ---------------------------------------------------------------------------

@pytest.mark.unit
def test_depth_is_measured_without_recursion_and_names_where():
    deep: list = []
    for _ in range(200_000):  # far past Python's recursion limit
        deep = [deep]
    assert nesting_depth(deep, 64)[0] == 65  # measured up to the first point past the bound
    assert nesting_depth({"a": [{"b": 1}], "c": 2}, 64) == (3, "")
    assert nesting_depth("text", 64) == (0, "")
    check_arguments(FINE_ARGS, "arguments")
    check_arguments("not JSON at all", "arguments")  # kept as text, as templates print it
    check_arguments('{"a": ' * MAX_ARGUMENT_DEPTH + "1" + "}" * MAX_ARGUMENT_DEPTH, "arguments")
    for too_deep in ('{"a": ' * (MAX_ARGUMENT_DEPTH + 1) + "1" + "}" * (MAX_ARGUMENT_DEPTH + 1), DEEP_ARGS):
        with pytest.raises(TooDeep, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments nests deeper"):
            check_arguments(too_deep, "messages[1].tool_calls[0].function.arguments")


# ---- tool-call arguments on the serving routes --------------------------------------------------

def test_deep_tool_call_arguments_on_chat_are_a_400_naming_them(server):
    r = _post(server.url, "/v1/chat/completions", {"model": "artisan-tiny", "max_tokens": 2,
                                                   "messages": _call_messages(DEEP_ARGS)})
    assert r.status_code == 400, r.text
    assert "messages[1].tool_calls[0].function.arguments nests deeper than" in r.json()["error"]["message"]
    _still_serving(server.url)


def test_deep_tool_call_arguments_on_responses_are_a_400_naming_them(server):
    body = {"model": "artisan-tiny", "max_output_tokens": 2, "input": [
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": DEEP_ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}
    r = _post(server.url, "/v1/responses", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input[1].function_call.arguments" and "nests deeper than" in error["message"], r.text
    _still_serving(server.url)


def test_deep_tool_use_input_on_messages_is_a_400_naming_it(server):
    deep = json.loads('{"a": ' * (MAX_ARGUMENT_DEPTH + 5) + "1" + "}" * (MAX_ARGUMENT_DEPTH + 5))
    body = {"model": "artisan-tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": deep}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}
    r = _post(server.url, "/v1/messages", body)
    assert r.status_code == 400, r.text
    assert "input nests deeper than" in r.json()["error"]["message"] and r.json()["error"]["param"].endswith("input")
    _still_serving(server.url)


# ---- any body -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/inference/v1/generate",
                                  "/v1/completions", "/v1/sessions/s-1/chat/completions", "/v1/runs", f"/v1/runs/{RUN}/jobs", f"/v1/runs/{RUN}/session-jobs",
                                  f"/v1/runs/{RUN}/log", f"/v1/runs/{RUN}/checkpoints/prune",
                                  f"/v1/runs/{RUN}/adapters/retain"])
@pytest.mark.parametrize("depth", [100_000, MAX_BODY_DEPTH + 1])
def test_a_body_nested_past_the_bound_is_a_400(server, run, path, depth):
    r = _post(server.url, path, "[" * depth + "]" * depth)
    assert r.status_code == 400, (path, r.text)
    error = r.json()["error"]
    assert error["code"] == "nested_too_deeply" and f"nests deeper than {MAX_BODY_DEPTH} levels" in error["message"]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_a_body_within_the_bound_is_read_as_before(server, run):
    r = _post(server.url, "/v1/chat/completions", {"model": "artisan-tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}], "metadata": json.loads("[" * 100 + "]" * 100)})
    assert r.status_code == 200, r.text
    r = _post(server.url, "/v1/chat/completions", b'{"model": "artisan-tiny", "messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


# ---- training jobs: refused at submission, not when they run ------------------------------------

def _trajectory(arguments: str) -> dict:
    return {"messages_and_choices": _call_messages(arguments) + [{"role": "assistant", "content": "done"}],
            "reward": 1.0}


@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_a_training_job_with_deep_arguments_is_a_400_at_submission(server, run, kind):
    if kind == "rl":
        body = {"kind": "rl", "groups": [{"trajectories": [_trajectory(FINE_ARGS), _trajectory(DEEP_ARGS)]}],
                "idempotency_key": "deep-rl"}
        where = "groups[0].trajectories[1].messages_and_choices"
    else:
        body = {"kind": "sft", "conversations": [{"messages": _call_messages(FINE_ARGS) + [
            {"role": "assistant", "content": "ok"}]}, {"messages": _call_messages(DEEP_ARGS) + [
                {"role": "assistant", "content": "ok"}]}], "idempotency_key": "deep-sft"}
        where = "conversations[1].messages"
    r = _post(server.url, f"/v1/runs/{run}/jobs", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == where and "tool_calls[0].function.arguments nests deeper than" in error["message"], r.text


# ---- a large body is validated off the event loop ------------------------------------------------

_release, _entered, _calls = threading.Event(), threading.Event(), []


class SlowToValidate(BaseModel):
    groups: list[int]

    @field_validator("groups")
    @classmethod
    def _wait(cls, v: list[int]) -> list[int]:
        # Holds whichever thread validates it until the test lets it go.
        _calls.append(threading.current_thread().name)
        _entered.set()
        _release.wait(60)
        return v


@pytest.mark.unit
def test_a_body_is_validated_off_the_event_loop_and_once():
    """A body model whose validation waits until the test says so: while it waits, another request
    is answered. Validated on the event loop, as FastAPI does, it held every request up (a 1.9 MiB
    job body: 2.2 s; 23.7 MiB: 6.7 s). FastAPI then takes the model as validated, not again."""
    from fastapi import FastAPI

    from server.api.errors import install
    from server.api.limits import GuardedRoute
    from tests.helpers import ServedApp

    app = FastAPI()
    install(app)
    app.router.route_class = GuardedRoute

    @app.post("/jobs")
    async def submit(job: SlowToValidate) -> dict:
        return {"groups": len(job.groups)}

    @app.get("/fine")
    async def fine() -> dict:
        return {"ok": True}

    answers: list[httpx.Response] = []
    with ServedApp(app, log_level="critical") as served, httpx.Client(base_url=served.url, timeout=20) as http:
        large = list(range(100_000))  # about 600 KB: a small body is read on the loop, as before
        pending = threading.Thread(target=lambda: answers.append(http.post("/jobs", json={"groups": large})))
        pending.start()
        try:
            assert _entered.wait(20), "the body was never validated"
            r = http.get("/fine")  # a ReadTimeout here: the loop is held by the validation
            assert r.status_code == 200 and r.json() == {"ok": True}
        finally:
            _release.set()
            pending.join(30)
        assert answers[0].status_code == 200 and answers[0].json() == {"groups": len(large)}, answers[0].text
        assert len(_calls) == 1, _calls  # validated once, in the worker thread
        r = http.post("/jobs", json={"groups": ["x"]})  # a body that fails: FastAPI's 400, as before
        assert r.status_code == 400 and r.json()["error"]["param"] == "groups[0]", r.text


@pytest.mark.unit
def test_the_collector_is_paused_while_any_large_body_is_read_and_restored_after():
    import gc

    from server.api.limits import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # a second large body at once
            assert not gc.isenabled()
        assert not gc.isenabled()  # the first is still being read
    assert gc.isenabled()
    gc.disable()  # someone else's choice is kept
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.unit
def test_what_a_large_body_leaves_alive_goes_to_the_oldest_generation_unscanned():
    """Left young, the body's objects were all scanned by the collector's next run on whichever
    thread allocated next: 0.7 s on the event loop for a 20 MiB job."""
    import gc

    from server.api.limits import collector_paused

    with collector_paused():
        kept = [[i] for i in range(20_000)]
    assert gc.get_count()[0] < 1_000
    assert any(o is kept[-1] for o in gc.get_objects(generation=2))
