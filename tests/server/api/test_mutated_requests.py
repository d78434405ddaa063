"""One valid request per API face, and every copy of it with one value replaced by a wrong one
(or removed): none may get a 5xx, and every refusal is one line.

The OpenAPI fuzz (test_openapi_fuzz.py) draws whole bodies from the schema, so a deep field (a
tool message's `tool_call_id` in the fourth message) is rarely reached with everything around it
valid; this walks each leaf and container of a conversation that uses tools, reasoning and text
parts, on each face: chat completions, vLLM's /tokenize, Messages (and count_tokens), Responses;
and an RL job's sampled choices (their ids, logprobs and sampling record), refused at submission.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any, Iterable, Iterator

import httpx
import pytest

from client import TrainableModel
from protocol.choices import is_choice_dict
from protocol.jobs import RLJob
from tests.helpers import demo_groups, with_rewards

TOOL = {"type": "object", "properties": {"a": {"type": "integer"}}}
CHAT = {
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "assistant", "content": "ok", "name": "bob"},
        {"role": "user", "content": "again"}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": TOOL}}],
}
CHAT_SAMPLED = {**CHAT, "tool_choice": "auto", "stop": ["\n"], "logprobs": True, "top_logprobs": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}
MESSAGES = {
    "system": [{"type": "text", "text": "s"}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "out"}]}]}],
    "tools": [{"name": "f", "description": "d", "input_schema": TOOL}],
    "tool_choice": {"type": "auto"}, "stop_sequences": ["x"],
}
RESPONSES = {
    "instructions": "s",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "again"}],
    "tools": [{"type": "function", "name": "f", "parameters": TOOL}],
    "tool_choice": "auto", "text": {"format": {"type": "text"}},
}
# Wrong values of every JSON type, and the shapes code is tempted to hash, index or iterate.
WRONG = [None, True, 0, -1, 1.5, "", "x", [], {}, [None], [[1]], {"a": None}, "\ud800", 2**70,
         {"type": "text"}, [{"type": "text", "text": 1}], [{"type": None}]]
REMOVED = object()


def _places(value: Any, path: tuple = (), depth: int = 99) -> Iterator[tuple]:
    """The path of every value inside `value`, containers and leaves, at most `depth` levels down."""
    if path:
        yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items if depth > 0 else ():
        yield from _places(inner, path + (key,), depth - 1)


def _send(client: httpx.Client, route: str, body: dict) -> httpx.Response:
    return client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})


def _refusal_problem(r: httpx.Response) -> str | None:
    if r.status_code >= 500:
        return r.text[:200]
    if r.status_code >= 400 and "\n" in r.json()["error"]["message"]:
        return f"a refusal over several lines: {r.text[:200]}"
    return None


def _mutated(body: dict, path: tuple, wrong: Any) -> dict:
    out = copy.deepcopy(body)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if wrong is REMOVED:
        del parent[path[-1]]
    else:
        parent[path[-1]] = wrong
    return out


def _sweep(client: httpx.Client, route: str, base: dict, paths: Iterable[tuple]) -> tuple[Counter[int], list[str]]:
    """Every copy of `base` with the value at one of `paths` made wrong or removed, sent to `route`:
    the answers by class (2, 4, 5), and each 5xx or refusal over several lines. A job accepted is
    cancelled at once (each copy under a key of its own), so nothing trains."""
    answers: Counter[int] = Counter()
    failures: list[str] = []
    for path in paths:
        for wrong in [*WRONG, REMOVED]:
            body = _mutated(base, path, wrong)
            if "idempotency_key" in body:
                body["idempotency_key"] = f"mutated-{answers.total()}"
            r = _send(client, route, body)
            answers[r.status_code // 100] += 1
            if r.status_code == 202:
                client.delete(f"/v1/jobs/{r.json()['job_id']}")
            if problem := _refusal_problem(r):
                failures.append(f"{path} = {'removed' if wrong is REMOVED else repr(wrong)[:40]}: {problem}")
    return answers, failures


@pytest.fixture(scope="module")
def server(fresh_server_module):
    """A server of this module's own: the job sweep registers a run, and what it accepts it cancels."""
    return fresh_server_module()


@pytest.fixture(scope="module")
def faces(server) -> dict[str, dict]:
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return {
        "/tokenize": CHAT,
        "/v1/chat/completions": {**CHAT_SAMPLED, "model": model, "max_tokens": 2},
        "/v1/messages": {**MESSAGES, "model": model, "max_tokens": 2},
        "/v1/messages/count_tokens": {**MESSAGES, "model": model},
        "/v1/responses": {**RESPONSES, "model": model, "max_output_tokens": 2},
    }


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                                   "/v1/responses"])
def test_every_value_of_a_valid_request_made_wrong_gets_a_one_line_4xx(server, faces, route):
    base = faces[route]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert _send(client, route, base).status_code == 200  # the request mutated is valid
        answers, failures = _sweep(client, route, base, _places(base))
    assert failures == [], "\n".join(failures[:10])
    assert answers[4] > 100 and answers[2] > 20, answers  # the sweep refused much, and much stayed valid


async def test_every_field_of_an_rl_job_s_sampled_choice_made_wrong_gets_a_one_line_4xx_at_submission(server):
    """A choice's token_ids are a field OpenAI's Choice does not have, so any JSON reaches the server's
    checks: `true` there was a 500. What is accepted is cancelled, so nothing trains."""
    model = await TrainableModel("mutated-job").register(server.url)
    groups = with_rewards(await demo_groups(model, 1, 2, seed=3), [[0.0, 1.0]])
    base = RLJob(groups=groups).model_dump(mode="json")
    turns = base["groups"][0]["trajectories"][0]["messages_and_choices"]
    first = next(i for i, turn in enumerate(turns) if is_choice_dict(turn))
    at = ("groups", 0, "trajectories", 0, "messages_and_choices", first)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answers, failures = _sweep(client, f"/v1/runs/{model.name}/jobs", base,
                                   (at + inside for inside in _places(turns[first], depth=2)))
    assert failures == [], "\n".join(failures[:10])
    assert answers[4] > 50 and answers[2] > 5, answers
