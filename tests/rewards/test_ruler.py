"""RULER judging against a real OpenAI-compatible HTTP judge on loopback.

The judge is a scripted FastAPI server (a hosted judge LLM can't run here); the clients are real:
litellm (model "openai/judge" with api_base on loopback) and the openai SDK.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat.chat_completion import Choice

from protocol.trajectory import Trajectory, TrajectoryGroup
from rewards.ruler import (
    JudgeConfig,
    JudgeError,
    build_judge_prompt,
    ruler_hook,
    score_group,
)
from tests.helpers import sampled_choice

pytestmark = pytest.mark.unit

SYSTEM = "You are the support agent of ACME-SYSTEM-PROMPT-7731. Be precise."
USER = "Where is my order A17? USER-TASK-TEXT-5521"
TOKEN_IDS = [987654321, 123456789]
LOGPROB = -0.4242421
LOGPROB_TOKEN = "LOGPROB-TOKEN-TEXT-X9"
SAMPLED = {"token": LOGPROB_TOKEN, "logprob": LOGPROB, "policy": "run", "step": 3, "prompt_fingerprint": "fp-abc",
           "prompt_len": 42}

# ------------------------------------------------------------------------------------------------
# The scripted judge


class ScriptedJudge:
    """Answers each request with the next scripted item and records what it was asked."""

    def __init__(self) -> None:
        self.script: deque[Any] = deque()
        self.requests: list[dict[str, Any]] = []
        self.url = ""

    def reset(self) -> None:
        self.script.clear()
        self.requests.clear()

    def then(self, *items: Any) -> "ScriptedJudge":
        self.script.extend(items)
        return self

    def prompt(self, i: int = -1) -> str:
        return "\n".join(m["content"] for m in self.requests[i]["messages"])


def _completion(model: str, content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
    }


def _app(judge: ScriptedJudge) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        judge.requests.append(body)
        item = judge.script.popleft() if judge.script else {"status": 500, "body": {"error": {"message": "script exhausted"}}}
        if isinstance(item, dict):  # an HTTP error
            return JSONResponse(status_code=item["status"], content=item["body"])
        return JSONResponse(_completion(body["model"], item))

    return app


@pytest.fixture(scope="module")
def server():
    judge = ScriptedJudge()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the bound socket goes to uvicorn: no free-port race
    judge.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    srv = uvicorn.Server(uvicorn.Config(_app(judge), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "judge server did not start"
        time.sleep(0.02)
    yield judge
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def judge_server(server):
    server.reset()
    yield server
    server.reset()


def _litellm_judge(server: ScriptedJudge, model: str = "openai/judge") -> JudgeConfig:
    return JudgeConfig(model=model, base_url=server.url, api_key="test-key", backend="litellm")


def _openai_judge(server: ScriptedJudge) -> str:
    return f"{server.url}#judge"  # URL spec string: openai SDK path


@pytest.fixture(params=["litellm", "openai"])
def judge(request, judge_server):
    return _litellm_judge(judge_server) if request.param == "litellm" else _openai_judge(judge_server)


async def score(group: TrajectoryGroup, judge_spec, **kw) -> TrajectoryGroup:
    kw.setdefault("backoff_s", 0.0)
    return await score_group(group, judge_spec, **kw)


# ------------------------------------------------------------------------------------------------
# Trajectories


TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "Look up an order by id.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}]


def _traj(answer: str, reward: float = 0.0, call_id: str = "call_1", tool_output: str = "status: shipped") -> Trajectory:
    return Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER},
            sampled_choice(None, TOKEN_IDS, **SAMPLED, tool_calls=[{"id": call_id, "type": "function", "function": {
                "name": "lookup_order", "arguments": json.dumps({"order_id": "A17"})}}]),
            {"role": "tool", "tool_call_id": call_id, "content": tool_output},
            sampled_choice(answer, TOKEN_IDS, **SAMPLED),
        ],
        tools=TOOLS,
        reward=reward,
    )


def _group(*answers: str, rewards: list[float] | None = None, **kw) -> TrajectoryGroup:
    rewards = rewards or [0.0] * len(answers)
    return TrajectoryGroup(trajectories=[_traj(a, r) for a, r in zip(answers, rewards)], **kw)


def _reply(scores: dict[str, Any], explain: str = "because") -> str:
    return json.dumps({"scores": [{"trajectory_id": k, "explanation": f"{explain} {k}", "score": v} for k, v in scores.items()]})


# ------------------------------------------------------------------------------------------------
# Tests


async def test_correct_reply(judge, judge_server):
    group = _group("It shipped yesterday.", "No idea.", "It shipped.", rewards=[0.1, 0.2, 0.3])
    before = group.model_dump_json()
    judge_server.then(_reply({"t1": 0.9, "t2": 0.1, "t3": 0.6}))

    out = await score(group, judge)

    assert [t.reward for t in out.trajectories] == [0.9, 0.1, 0.6]
    assert [t.metrics["ruler_score"] for t in out.trajectories] == [0.9, 0.1, 0.6]
    assert [t.metrics["independent_reward"] for t in out.trajectories] == [0.1, 0.2, 0.3]
    first = out.trajectories[0]
    assert "because t1" in first.logs[-1]
    assert first.metrics["ruler_attempts"] == 1
    assert first.metrics["ruler_prompt_tokens"] == 100 and first.metrics["ruler_completion_tokens"] == 20
    assert first.metrics["ruler_latency_s"] > 0
    assert "ruler_cost_usd" not in first.metrics  # litellm has no price for "judge"
    assert len(judge_server.requests) == 1
    assert judge_server.requests[0]["model"] == "judge"
    fmt = judge_server.requests[0]["response_format"]
    assert fmt["type"] == "json_schema"
    entry = fmt["json_schema"]["schema"]["properties"]["scores"]["items"]["properties"]
    assert entry["trajectory_id"]["enum"] == ["t1", "t2", "t3"]
    assert (entry["score"]["minimum"], entry["score"]["maximum"]) == (0, 1)
    assert group.model_dump_json() == before  # input untouched
    prompt = judge_server.prompt()
    for tid in ("t1", "t2", "t3"):
        assert f'<trajectory id="{tid}">' in prompt
    assert "lookup_order(order_id): Look up an order by id." in prompt
    assert '"order_id": "A17"' in prompt


async def test_scores_follow_ids_not_order(judge, judge_server):
    group = _group("a", "b", "c")
    judge_server.then(json.dumps({"scores": [
        {"trajectory_id": "t3", "explanation": "third", "score": 0.3},
        {"trajectory_id": "t1", "explanation": "first", "score": 1},
        {"trajectory_id": "t2", "explanation": "second", "score": 0.0},
    ]}))
    out = await score(group, judge)
    assert [t.metrics["ruler_score"] for t in out.trajectories] == [1.0, 0.0, 0.3]
    assert "first" in out.trajectories[0].logs[-1] and "third" in out.trajectories[2].logs[-1]


async def test_missing_id_is_retried(judge, judge_server):
    group = _group("a", "b")
    judge_server.then(_reply({"t1": 0.5}), _reply({"t1": 0.5, "t2": 0.7}))
    out = await score(group, judge)
    assert [t.reward for t in out.trajectories] == [0.5, 0.7]
    assert len(judge_server.requests) == 2
    assert "missing ids t2" in judge_server.requests[1]["messages"][-1]["content"]
    metrics = out.trajectories[0].metrics
    assert metrics["ruler_attempts"] == 2
    assert metrics["ruler_prompt_tokens"] == 200 and metrics["ruler_completion_tokens"] == 40


BAD_REPLIES = {
    "out_of_range_high": _reply({"t1": 1.5, "t2": 0.2}),
    "out_of_range_low": _reply({"t1": -0.1, "t2": 0.2}),
    "nan": '{"scores": [{"trajectory_id": "t1", "explanation": "", "score": NaN}, {"trajectory_id": "t2", "explanation": "", "score": 0.1}]}',
    "non_numeric": _reply({"t1": "high", "t2": 0.2}),
    "bool": _reply({"t1": True, "t2": 0.2}),
    "invalid_json": '{"scores": [ {"trajectory_id": "t1", ',
    "prose": "Trajectory 1 is better.",
    "duplicate": json.dumps({"scores": [{"trajectory_id": "t1", "score": 0.1}, {"trajectory_id": "t1", "score": 0.2},
                                        {"trajectory_id": "t2", "score": 0.3}]}),
    "extra_id": _reply({"t1": 0.1, "t2": 0.2, "t3": 0.3}),
    "empty": "",
    "wrong_shape": json.dumps({"t1": 0.1, "t2": 0.2}),
}


@pytest.mark.parametrize("bad", list(BAD_REPLIES))
async def test_invalid_reply_is_retried(bad, judge_server):
    judge_server.then(BAD_REPLIES[bad], _reply({"t1": 0.25, "t2": 0.75}))
    out = await score(_group("a", "b"), _openai_judge(judge_server))
    assert [t.metrics["ruler_score"] for t in out.trajectories] == [0.25, 0.75]
    assert len(judge_server.requests) == 2
    retry = judge_server.requests[1]["messages"]
    assert retry[-1]["role"] == "user" and "That reply was invalid" in retry[-1]["content"]
    # the bad reply is counted as the judge's malformed answer, on each trajectory and the group
    assert out.trajectories[0].metrics["ruler_malformed"] == 1
    assert out.metadata["ruler"] == {"judged": 1, "failed": 0, "skipped": 0, "attempts": 2, "malformed": 1}


async def test_code_fences_are_tolerated(judge, judge_server):
    judge_server.then("```json\n" + _reply({"t1": 0.4, "t2": 0.6}) + "\n```")
    out = await score(_group("a", "b"), judge)
    assert [t.reward for t in out.trajectories] == [0.4, 0.6]
    assert len(judge_server.requests) == 1


async def _gather_one(hook, group: TrajectoryGroup) -> TrajectoryGroup:
    """The real gather, scoring the group with `hook` as soon as its rollouts finish."""
    from client import gather_trajectory_groups

    async def done(t):
        return t

    out = await gather_trajectory_groups([[done(t) for t in group.trajectories]], max_exceptions=1.0,
                                         progress=False, after_each=hook)
    return out[0].model_copy(update={"metadata": group.metadata})


async def test_never_valid_raises_and_gather_records_exception(judge, judge_server):
    group = _group("a", "b", metadata={"task": "order-A17"})
    judge_server.then(*[_reply({"t1": 0.5})] * 4)
    with pytest.raises(JudgeError, match=r"after 4 attempt\(s\).*missing ids t2") as info:
        await score(group, judge, max_retries=3)
    assert info.value.attempts == 4 and info.value.malformed == 4
    assert "(4 malformed)" in str(info.value)
    assert len(judge_server.requests) == 4

    judge_server.reset()
    judge_server.then(*["not json"] * 2)
    gathered = await _gather_one(ruler_hook(judge, max_retries=1, backoff_s=0.0), group)
    assert gathered.trajectories == []  # never zero rewards
    assert len(gathered.exceptions) == 2 and all(e.startswith("JudgeError:") for e in gathered.exceptions)
    assert gathered.metadata == {"task": "order-A17"}


async def test_a_failed_judgment_keeps_its_figures_in_the_gathered_group(judge_server):
    from client import gather_trajectory_groups

    judge_server.then(_reply({"t1": 0.5}), {"status": 503, "body": {"error": {"message": "overloaded"}}})

    async def done(t):
        return t

    group = _group("a", "b")
    out = await gather_trajectory_groups(
        [[done(t) for t in group.trajectories]], max_exceptions=1.0, progress=False,
        after_each=ruler_hook(_openai_judge(judge_server), max_retries=1, backoff_s=0.0))
    assert out[0].trajectories == [] and len(out[0].exceptions) == 2
    assert out[0].metadata["ruler"] == {"judged": 0, "failed": 1, "skipped": 0, "attempts": 2, "malformed": 1}


async def test_a_group_with_nothing_to_compare_is_counted_as_skipped(judge_server):
    out = await score(_group("same", "same"), _openai_judge(judge_server))
    assert judge_server.requests == []
    assert out.metadata["ruler"]["skipped"] == 1


async def test_hook_scores_group(judge, judge_server):
    judge_server.then(_reply({"t1": 0.3, "t2": 0.8}))
    out = await _gather_one(ruler_hook(judge, backoff_s=0.0), _group("a", "b"))
    assert [t.reward for t in out.trajectories] == [0.3, 0.8]


async def test_transient_http_error_is_retried(judge, judge_server):
    judge_server.then({"status": 503, "body": {"error": {"message": "overloaded"}}}, _reply({"t1": 0.1, "t2": 0.2}))
    out = await score(_group("a", "b"), judge)
    assert [t.reward for t in out.trajectories] == [0.1, 0.2]
    assert out.trajectories[0].metrics["ruler_attempts"] == 2
    assert out.trajectories[0].metrics["ruler_malformed"] == 0  # an outage is not a malformed answer


async def test_auth_error_is_not_retried(judge, judge_server):
    judge_server.then({"status": 401, "body": {"error": {"message": "bad key"}}})
    with pytest.raises(JudgeError, match="after 1 attempt"):
        await score(_group("a", "b"), judge)
    assert len(judge_server.requests) == 1


async def test_refused_json_mode_falls_back(judge_server):
    judge_server.then({"status": 400, "body": {"error": {"message": "response_format not supported"}}},
                      _reply({"t1": 0.1, "t2": 0.2}))
    out = await score(_group("a", "b"), _openai_judge(judge_server))
    assert [t.reward for t in out.trajectories] == [0.1, 0.2]
    assert "response_format" in judge_server.requests[0]
    assert "response_format" not in judge_server.requests[1]


async def test_identical_trajectories_judged_once(judge, judge_server):
    group = TrajectoryGroup(trajectories=[
        _traj("It shipped.", call_id="call_aaa"),
        _traj("No idea."),
        _traj("It shipped.", call_id="call_zzz"),  # same behaviour, different random call id
    ])
    judge_server.then(_reply({"t1": 0.8, "t2": 0.2}))
    out = await score(group, judge)
    prompt = judge_server.prompt()
    assert '<trajectory id="t1">' in prompt and '<trajectory id="t2">' in prompt
    assert '<trajectory id="t3">' not in prompt
    assert prompt.count("It shipped.") == 1
    assert [t.reward for t in out.trajectories] == [0.8, 0.2, 0.8]


async def test_all_identical_or_single_is_not_judged(judge_server):
    for group in (_group("same", "same"), _group("alone")):
        out = await score(group, _openai_judge(judge_server))
        assert all("RULER: not judged" in t.logs[-1] for t in out.trajectories)
        assert all("ruler_score" not in t.metrics for t in out.trajectories)
    assert judge_server.requests == []
    # ...unless asked to judge anyway
    judge_server.then(_reply({"t1": 0.7}))
    out = await score(_group("alone", rewards=[0.2]), _openai_judge(judge_server), judge_single=True)
    assert out.trajectories[0].reward == 0.7


async def test_shared_prefix_sent_once(judge, judge_server):
    judge_server.then(_reply({"t1": 0.1, "t2": 0.2, "t3": 0.3}))
    await score(_group("a", "b", "c"), judge)
    prompt = judge_server.prompt()
    assert prompt.count("ACME-SYSTEM-PROMPT-7731") == 1
    assert prompt.count("USER-TASK-TEXT-5521") == 1
    assert prompt.count("status: shipped") == 1  # the tool turn is shared too
    shared = prompt.split("<shared_context>")[1].split("</shared_context>")[0]
    assert SYSTEM in shared and USER in shared


async def test_weight_combines_with_independent_reward(judge, judge_server):
    judge_server.then(_reply({"t1": 1.0, "t2": 0.0}))
    out = await score(_group("a", "b", rewards=[0.2, 0.6]), judge, weight=0.25)
    assert out.trajectories[0].reward == pytest.approx(0.25 * 1.0 + 0.75 * 0.2)
    assert out.trajectories[1].reward == pytest.approx(0.25 * 0.0 + 0.75 * 0.6)
    assert out.trajectories[1].metrics["independent_reward"] == 0.6
    with pytest.raises(ValueError):
        await score(_group("a", "b"), judge, weight=1.5)


async def test_metadata_exceptions_and_fields_preserved(judge, judge_server):
    group = _group("a", "b", metadata={"task": "order-A17", "split": "train"}, exceptions=["TimeoutError: tool backend"])
    group.trajectories[0].metadata["seed"] = 7
    group.trajectories[0].metrics["turns"] = 3
    group.trajectories[0].logs.append("rollout log")
    judge_server.then(_reply({"t1": 0.5, "t2": 0.6}))
    out = await score(group, judge)
    # the group's own metadata kept, the judgment's figures added beside it
    assert out.metadata == {"task": "order-A17", "split": "train",
                            "ruler": {"judged": 1, "failed": 0, "skipped": 0, "attempts": 1, "malformed": 0}}
    assert out.exceptions == ["TimeoutError: tool backend"]
    first = out.trajectories[0]
    assert first.metadata == {"seed": 7} and first.metrics["turns"] == 3
    assert first.logs[0] == "rollout log" and len(first.logs) == 2
    assert first.tools == TOOLS
    assert isinstance(first.messages_and_choices[2], Choice)
    assert first.messages_and_choices[2].token_ids == TOKEN_IDS
    assert group.trajectories[0].logs == ["rollout log"]  # the input kept its own logs


async def test_no_logprobs_or_token_ids_sent(judge, judge_server):
    judge_server.then(_reply({"t1": 0.5, "t2": 0.6}))
    await score(_group("a", "b"), judge)
    raw = json.dumps(judge_server.requests[0])
    for needle in (str(TOKEN_IDS[0]), str(TOKEN_IDS[1]), str(LOGPROB), LOGPROB_TOKEN, "logprob", "token_ids",
                   "fp-abc", "mf-xyz", "finish_reason"):
        assert needle not in raw, needle


def test_large_outputs_are_shortened():
    big = "HEAD" + "x" * 10_000 + "TAIL"
    group = TrajectoryGroup(trajectories=[
        _traj("a", tool_output=big),
        _traj("b" * 50_000),
    ])
    prompt = build_judge_prompt(group, max_tool_output_chars=500, max_trajectory_chars=2000)
    text = "\n".join(m["content"] for m in prompt.messages)
    assert "HEAD" in text and "TAIL" in text and "x" * 600 not in text
    assert "chars omitted ...]" in text
    assert "b" * 2001 not in text
    assert prompt.ids == ["t1", "t2"]


async def test_litellm_cost_recorded_when_price_known(judge_server):
    judge_server.then(_reply({"t1": 0.5, "t2": 0.6}))
    out = await score(_group("a", "b"), _litellm_judge(judge_server, model="openai/gpt-4o-mini"))
    assert out.trajectories[0].metrics["ruler_cost_usd"] > 0


def test_judge_spec_parsing():
    cfg = JudgeConfig.parse("http://127.0.0.1:9/v1#my-judge")
    assert cfg.uses_openai_sdk and cfg.base_url == "http://127.0.0.1:9/v1" and cfg.model == "my-judge"
    assert not JudgeConfig.parse("anthropic/claude-sonnet-4").uses_openai_sdk
    with pytest.raises(ValueError):
        JudgeConfig.parse("http://127.0.0.1:9/v1")
