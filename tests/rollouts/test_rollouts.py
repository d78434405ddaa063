"""The rollout contract: what a rollout records, and how it fails."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from openai import AsyncOpenAI
from openai.types.chat.chat_completion import Choice

from client import TrajectoryGroup, gather_trajectory_groups
from client.gather import TooManyExceptions
from examples.demo import task as demo
from rollouts.agent import StopReason, rollout, truncate_middle
from rollouts.env import RolloutSettings
from protocol.retry import RetryPolicy
from tests.scripted_endpoint import ScriptedEndpoint, completion

FAST_RETRY = RetryPolicy(attempts=3, initial_wait=0.05, max_wait=0.2)


def _demo_task(i: int = 0):
    return demo.make_example().train_tasks(0)[i]


async def test_rollout_records_choices_and_tool_messages(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    class AnyItemShop(demo.ShopEnv):  # a structured result for every call, even a miscopied item
        async def call_tool(self, name, arguments):
            return {"item": arguments.get("item"), "price": self.task.data["price"]}

    # Seeded, at T=1, over several tasks: the warm-started model mostly answers without the
    # tool (at T=0.6 nine times in ten), and this test needs some calls.
    settings = replace(demo.make_example().settings, temperature=1.0)
    tasks = [_demo_task(i) for i in range(8)]
    # one seed per rollout: a seed shared across tasks would repeat the same random draws
    trajs = await asyncio.gather(*(rollout(client, "artisan-tiny", AnyItemShop(t), t,
                                           replace(settings, seed=i * 4 + s))
                                   for i, t in enumerate(tasks) for s in range(4)))
    with_tools = [t for t in trajs if t.metrics["tool_calls"] > 0]
    assert with_tools, "the warm-started model calls tools"
    for t in trajs:
        items = t.messages_and_choices
        assert items[0]["role"] == "system" and items[1]["role"] == "user"
        for i, item in enumerate(items[2:], start=2):
            if isinstance(item, Choice):
                assert item.token_ids and item.logprobs.content  # the training data is there
            else:
                assert item["role"] in ("tool", "user"), "every model turn is a Choice, not a dict"
            if isinstance(item, dict) and item["role"] == "tool":
                prev_calls = [c.id for c in items[i - 1].message.tool_calls] if isinstance(items[i - 1], Choice) else None
                assert isinstance(item["content"], str)
                assert set(item) == {"role", "tool_call_id", "content"}
                assert prev_calls is None or item["tool_call_id"] in prev_calls or isinstance(items[i - 1], dict)
        assert t.metrics["turns"] == len(t.choices()) and t.metrics["duration"] >= 0
        assert t.metadata["stop_reason"] in {s.value for s in StopReason}
        assert t.end_time is not None
    # structured tool results are JSON strings
    tool_msgs = [m for t in with_tools for m in t.messages_and_choices if isinstance(m, dict) and m["role"] == "tool"]
    assert any(m["content"].startswith("{") and json.loads(m["content"]) for m in tool_msgs)


@pytest.mark.unit
async def test_malformed_tool_call_stops_with_its_reason():
    with ScriptedEndpoint() as ep:
        ep.replies = [completion('<tool_call>{"name": "get_price", "arguments": {"item": ', finish="stop",
                                 malformed=True)]
        client = AsyncOpenAI(base_url=ep.url, api_key="x", max_retries=0)
        task = _demo_task()
        t = await rollout(client, "m", demo.ShopEnv(task), task, RolloutSettings(max_turns=4), FAST_RETRY)
        assert t.metadata["stop_reason"] == "malformed_tool_call"
        assert t.reward == 0.0 and t.metrics["stop_malformed_tool_call"] == 1


@pytest.mark.unit
async def test_transient_errors_are_retried_then_the_rollout_raises():
    with ScriptedEndpoint() as ep:
        task = _demo_task()
        client = AsyncOpenAI(base_url=ep.url, api_key="x", max_retries=0)
        ep.replies = [503, 500, completion("The apple costs 3 dollars.")]
        t = await rollout(client, "m", demo.ShopEnv(task), task, RolloutSettings(), FAST_RETRY)
        assert t.metadata["stop_reason"] == "answered" and len(ep.requests) == 3
        ep.replies = [400]  # the agent's request is wrong: no retry
        with pytest.raises(Exception):
            await rollout(client, "m", demo.ShopEnv(task), task, RolloutSettings(), FAST_RETRY)


async def test_server_dying_mid_rollout_becomes_an_exception_not_a_reward(fresh_server):
    srv = fresh_server()

    class DyingEnv(demo.ShopEnv):
        async def call_tool(self, name, arguments):
            srv.kill()  # the server goes down between two model turns
            return await super().call_tool(name, arguments)

    client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    task = _demo_task()
    settings = RolloutSettings(max_turns=4, max_tokens=48)

    async def one():
        # the first turn may answer without a tool; keep going until the env killed the server
        while srv.proc.poll() is None:
            await rollout(client, "artisan-tiny", DyingEnv(task), task, settings, FAST_RETRY)
        return await rollout(client, "artisan-tiny", DyingEnv(task), task, settings, FAST_RETRY)

    groups = await gather_trajectory_groups([[one()]], max_exceptions=1, progress=False)
    assert groups[0].trajectories == [] and len(groups[0].exceptions) == 1
    assert "Connection" in groups[0].exceptions[0]
    with pytest.raises(TooManyExceptions, match="1 of 1 rollouts failed"):
        await gather_trajectory_groups([[one()]], max_exceptions=0, progress=False)


@pytest.mark.unit
async def test_gather_hook_failure_excludes_the_group():
    from protocol.trajectory import Trajectory

    async def ok():
        return Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=1.0)

    async def judge(group: TrajectoryGroup) -> TrajectoryGroup:
        raise RuntimeError("judge unavailable")

    groups = await gather_trajectory_groups([[ok(), ok()]], max_exceptions=1.0, progress=False, after_each=judge)
    assert groups[0].trajectories == [] and len(groups[0].exceptions) == 2


@pytest.mark.unit
def test_truncation_keeps_start_and_end():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}, {"role": "tool", "content": "r1"},
            {"role": "tool", "content": "r2"}, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "more"}]
    cut = truncate_middle(msgs)
    assert cut[:2] == msgs[:2] and cut[-2:] == msgs[-2:]
    assert all(m["role"] != "tool" for m in cut)  # a call and its results leave together
    assert truncate_middle(msgs[:3]) is None


@pytest.mark.unit
def test_client_side_never_imports_torch():
    code = "import sys, client, rollouts.agent, rewards, rewards.ruler, client.train, examples.demo; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.unit
async def test_each_batch_of_rollouts_closes_its_client():
    """A client left to the garbage collector stalled later batches for minutes (responses sat
    unread in socket buffers); `client.train` closes each batch's client when the batch is done."""
    from client.loop.rollout_source import run_groups

    clients: list[AsyncOpenAI] = []

    class Model:
        name = "m"

        def openai_client(self, **kw):
            clients.append(AsyncOpenAI(base_url=ep.url, api_key="x", **kw))
            return clients[-1]

    with ScriptedEndpoint() as ep:
        ep.replies = [completion("The price of tea is 7.") for _ in range(4)]
        groups = await run_groups(Model(), demo.make_example(), [_demo_task(0), _demo_task(1)], 2, progress=False)
        assert [len(g.trajectories) for g in groups] == [2, 2]
    assert len(clients) == 1 and clients[0].is_closed()
