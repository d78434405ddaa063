"""Off-policy training through a real server: the staleness a step reports, the bound that drops
stale groups, and a pipelined `client.train` run that is interrupted and resumed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace

import pytest

from client import TrainConfig, TrainableModel, TrajectoryGroup
from client.pipeline import Journal, Pipeline
from examples.demo import task as demo
from rollouts.agent import rollout


async def _groups(model: TrainableModel, policy: str, n: int, size: int = 4, seed: int = 0) -> list[TrajectoryGroup]:
    """Demo rollouts sampled from `policy` (`run@step`), with rewards that always differ within a
    group (what is learnt does not matter here; that the step trains does)."""
    example = demo.make_example()
    out = []
    async with model.openai_client(max_retries=0) as client:
        for g, task in enumerate(example.train_tasks(seed)[:n]):
            trajs = await asyncio.gather(*(rollout(client, policy, example.make_env(task), task,
                                                   replace(example.settings, seed=seed * 1000 + g * size + i))
                                           for i in range(size)))
            out.append(TrajectoryGroup(trajectories=[t.model_copy(update={"reward": float(i % 2)})
                                                     for i, t in enumerate(trajs)]))
    return out


@pytest.fixture(scope="module")
async def two_steps_on(fresh_server_module):
    """A run trained to step 2, with a group sampled at each of steps 0, 1 and 2 kept aside."""
    server = fresh_server_module()
    model = await TrainableModel("stale").register(server.url)
    kept = {}
    for step in range(3):
        fresh = await _groups(model, f"stale@{step}", 3, seed=step)
        kept[step] = fresh[0]
        if step < 2:
            result = await model.train(fresh[1:], TrainConfig(learning_rate=2e-3))
            assert result.trained and result.metrics.staleness_max == 0
    return server, model, kept


async def test_a_group_past_the_bound_is_dropped_counted_and_warned_about(two_steps_on):
    server, _, kept = two_steps_on
    model = await TrainableModel("stale").register(server.url)
    result = await model.train([kept[2], kept[0]], TrainConfig(learning_rate=1e-9, max_steps_off_policy=1))
    m = result.metrics
    assert (m.groups_total, m.groups_dropped_stale, m.staleness_bound) == (2, 1, 1)
    assert (m.staleness_mean, m.staleness_max) == (0.0, 0)  # the figures are of the group that trained
    assert result.trained and m.groups_trainable == 1
    assert any("1 of 2 groups were sampled more than 1 steps before" in w for w in result.warnings)


async def test_groups_within_the_bound_train_with_their_staleness_and_the_behaviour_policys_logprobs(two_steps_on):
    server, _, kept = two_steps_on
    model = await TrainableModel("stale").register(server.url)
    step = await model.get_step()  # 2, or more where another test of this module trained first
    result = await model.train([kept[0], kept[1]], TrainConfig(learning_rate=1e-9, max_steps_off_policy=step))
    m = result.metrics
    assert step >= 2 and result.trained and m.groups_dropped_stale == 0
    assert (m.staleness_mean, m.staleness_max, m.staleness_bound) == (step - 0.5, step, step)
    # The ratio is taken against the sampler's logprobs: two steps on, the policy is no longer the
    # sampler's, and the step measures the gap and clips where the ratio left the trust region.
    assert m.logprob_gap > 1e-3 and m.clip_fraction is not None


async def test_every_group_too_stale_trains_nothing_and_says_so(two_steps_on):
    server, _, kept = two_steps_on
    model = await TrainableModel("stale").register(server.url)
    before = await model.get_step()
    result = await model.train([kept[0]], TrainConfig(max_steps_off_policy=0))
    after = await model.get_step()
    assert not result.trained and before == after
    assert result.metrics.groups_dropped_stale == 1
    assert any("nothing was trained" in w for w in result.warnings)


async def test_an_interrupted_pipelined_run_resumes_without_training_a_group_twice(fresh_server_module, tmp_path):
    """The client dies after a batch reached the server and before its result came back; restarted,
    it resubmits the journalled batch under the same key and the server answers with the step it
    already trained."""
    server = fresh_server_module()
    journal = Journal(tmp_path / "pending")
    example = demo.make_example()
    tasks = example.train_tasks(0)

    class Interrupted(Exception):
        pass

    async def pipelined(model: TrainableModel, until: int, die_at: int | None) -> list:
        async def sample(policy: str, index: int) -> TrajectoryGroup:
            return (await _groups(model, policy, 1, size=2, seed=index))[0]

        async def train(groups, key):
            if die_at is not None and model.step == die_at:
                await model.request("POST", f"/v1/runs/{model.name}/jobs", content=json.dumps(
                    {"kind": "rl", "groups": [g.model_dump(mode="json") for g in groups],
                     "config": cfg.model_dump(mode="json"), "idempotency_key": key}),
                    headers={"Content-Type": "application/json"})
                raise Interrupted
            return await model.train(groups, cfg, idempotency_key=key)

        pipeline = Pipeline(sample, train, run=model.name, served_step=model.step, groups_per_step=2,
                            max_steps_off_policy=1, journal=journal)
        outcomes = []
        async with contextlib.aclosing(pipeline.steps(until)) as it:
            async for o in it:
                outcomes.append(o)
        return outcomes

    cfg = TrainConfig(learning_rate=1e-4, max_steps_off_policy=1)
    assert tasks  # the demo has tasks to sample

    model = await TrainableModel("resumed").register(server.url)
    with pytest.raises(Interrupted):
        await pipelined(model, 3, die_at=1)
    assert len(journal.pending()) == 1
    for _ in range(100):  # the job it left behind finishes on the server meanwhile
        if await model.get_step() == 2:
            break
        await asyncio.sleep(0.2)
    again = await TrainableModel("resumed").register(server.url)
    outcomes = await pipelined(again, 3, die_at=None)
    rows = (await again.request("GET", "/v1/runs/resumed/trajectories", params={"split": "train"}))["data"]
    step = await again.get_step()
    assert outcomes[0].resumed and outcomes[0].result.step == 2  # the job's own result, not a new step
    assert step == 3 and journal.pending() == []
    assert sorted({r["step"] for r in rows}) == [1, 2, 3] and len(rows) == 3 * 2 * 2  # each group once
