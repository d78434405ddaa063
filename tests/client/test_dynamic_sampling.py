"""DAPO's dynamic sampling (client/pipeline.py, `client.train --dynamic-sampling N`), without a
server: a group whose rollouts all scored alike is sampled again in its place, up to N a step, and
a synchronous run sets aside the same groups whatever order its groups finish in."""

from __future__ import annotations

import asyncio
import contextlib
import random
from functools import partial

import pytest

from client.errors import ConfigError
from client.loop.config import LoopConfig
from client.loop.training_loop import scored_alike, train_loop
from client.pipeline import Pipeline
from protocol.jobs import TrainResult
from protocol.metrics import StepMetrics
from protocol.trajectory import Trajectory, TrajectoryGroup, rewards_differ

pytestmark = pytest.mark.unit


def _group(index: int, rewards: list[float], exceptions: tuple[str, ...] = ()) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], reward=r) for r in rewards],
        exceptions=list(exceptions), metadata={"index": index})


async def _run(alike: set[int], groups_per_step: int, cap: int, steps: int, delay=lambda index: 0.001):
    """The index of every trained and every set-aside group, batch by batch."""
    step, trained, set_aside = 0, [], []

    async def sample(policy: str, index: int) -> TrajectoryGroup:
        await asyncio.sleep(delay(index))
        return _group(index, [0.0, 0.0, 0.0] if index in alike else [0.0, 1.0, 0.0])

    async def train(groups: list[TrajectoryGroup], key: str) -> TrainResult:
        nonlocal step
        step += 1
        return TrainResult(step=step, trained=True, metrics=StepMetrics(trained=True, groups_total=len(groups)))

    pipeline = Pipeline(sample, train, run="r", served_step=0, groups_per_step=groups_per_step,
                        max_steps_off_policy=0, max_exceptions=1.0,
                        set_aside=partial(scored_alike, min_spread=1e-6), max_set_aside=cap)
    async with contextlib.aclosing(pipeline.steps(steps)) as outcomes:
        async for o in outcomes:
            trained.append([g.metadata["index"] for g in o.groups])
            set_aside.append([g.metadata["index"] for g in o.set_aside])
    return trained, set_aside


async def test_a_step_trains_groups_with_signal_in_place_of_groups_that_scored_alike():
    trained, set_aside = await _run(alike={0, 1, 3}, groups_per_step=2, cap=4, steps=2)
    # 0 and 1 scored alike: 2 and 3 start in their place; 3 too: 4 starts in its place
    assert trained == [[2, 4], [5, 6]]
    assert set_aside == [[0, 1, 3], []]


async def test_past_the_cap_groups_go_in_as_they_come_and_the_lowest_indices_are_set_aside():
    for slow in (0, 1):  # whichever of the first two finishes first, group 0 is the one set aside
        trained, set_aside = await _run(alike=set(range(10)), groups_per_step=2, cap=1, steps=2,
                                        delay=lambda index: 0.02 if index == slow else 0.001)
        assert trained == [[1, 2], [4, 5]] and set_aside == [[0], [3]]


async def test_a_synchronous_run_sets_aside_the_same_groups_whatever_order_they_finish_in():
    alike = {0, 2, 3, 4, 7, 8, 11, 12, 13, 14, 15, 16}
    runs = []
    for seed in (1, 2, 3):
        delays = random.Random(seed)
        jitter = {i: delays.uniform(0, 0.01) for i in range(64)}
        runs.append(await _run(alike, groups_per_step=3, cap=4, steps=4, delay=jitter.__getitem__))
    assert runs[0] == runs[1] == runs[2]
    trained, set_aside = runs[0]
    assert set_aside == [[0, 2, 3, 4], [7, 8, 11, 12], [14, 15, 16], []]
    # the second step reached the cap: 13 scored alike and went in, the lower 7, 8, 11, 12 set aside
    assert trained == [[1, 5, 6], [9, 10, 13], [17, 18, 19], [20, 21, 22]]


def test_only_a_group_whose_rollouts_all_scored_alike_is_set_aside():
    assert scored_alike(_group(0, [1.0, 1.0]), 1e-6) and scored_alike(_group(0, [0.5, 0.5 + 1e-9]), 1e-6)
    assert not scored_alike(_group(0, [0.0, 1.0]), 1e-6)
    assert scored_alike(_group(0, [1.0]), 1e-6)  # one rollout: nothing to compare it with
    # failed rollouts go to the server, which counts them, not into the set-aside pile
    assert not scored_alike(_group(0, [0.0, 0.0], exceptions=("TimeoutError: slow",)), 1e-6)
    assert rewards_differ([0.0, 0.25], 0.2) and not rewards_differ([0.0, 0.25], 0.3) and not rewards_differ([1.0], 0)


@pytest.mark.parametrize("change", [{"group_size": 1}, {"train": {"loss": "apo", "baseline": "given"}},
                                    {"train": {"distill": {"teacher": "base"}}}])
async def test_dynamic_sampling_is_refused_where_groups_carry_no_group_relative_signal(change, tmp_path):
    cfg = LoopConfig(**{"server": "http://127.0.0.1:9", "example": "demo", "dynamic_sampling": 4,
                        "out": tmp_path, **change})
    with pytest.raises(ConfigError, match="--dynamic-sampling"):  # before any connection is tried
        await train_loop(cfg)
