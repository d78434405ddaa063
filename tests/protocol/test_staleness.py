"""The staleness rules (protocol/staleness.py) and the pipeline that keeps them (client/pipeline.py),
without a server: a fake trainer applies the server's own filter."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from client.loop.config import LoopConfig
from client.pipeline import Journal, Pipeline, batch_key
from protocol.jobs import TrainResult
from protocol.metrics import StepMetrics
from protocol.staleness import expected_staleness, may_start_group, sampled_step, split_by_staleness, staleness
from protocol.trajectory import Trajectory, TrajectoryGroup
from tests.helpers import sampled_choice

pytestmark = pytest.mark.unit


def _group(*sampled_by: tuple[str, int], reward: float = 0.0) -> TrajectoryGroup:
    """One trajectory for each (policy, step) that sampled its choice."""
    return TrajectoryGroup(trajectories=[
        Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, sampled_choice(policy=p, step=s)],
                   reward=reward + i)
        for i, (p, s) in enumerate(sampled_by)])


def test_a_groups_sampler_is_its_oldest_choice_of_this_run():
    assert sampled_step(_group(("r@3", 3), ("r", 5)), "r") == 3
    # step 0 is the base model or the untrained adapter: the same policy, whatever it was called
    assert sampled_step(_group(("base-model", 0), ("r@2", 2)), "r") == 0
    # another run's steps say nothing about this one; a run whose name extends this one's is another run
    assert sampled_step(_group(("other@7", 7), ("r2@4", 4)), "r") is None
    assert sampled_step(TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])]), "r") is None


def test_staleness_is_steps_behind_the_weights_a_step_starts_from():
    assert staleness(4, 4) == 0  # synchronous: sampled from step 4, trained from step 4 into 5
    assert staleness(6, 4) == 2
    assert staleness(2, 4) == 0  # a run rolled back to an earlier checkpoint is not behind its sampler
    assert staleness(3, None) is None


def test_the_bound_drops_only_groups_past_it_and_figures_count_the_kept():
    split = split_by_staleness([0, 2, None, 3, 1], bound=2)
    assert (split.kept, split.dropped) == ([0, 1, 2, 4], [3])
    assert (split.mean, split.max) == (1.0, 2)
    everything = split_by_staleness([0, 9], bound=None)
    assert everything.kept == [0, 1] and everything.dropped == [] and everything.max == 9
    none_known = split_by_staleness([None], bound=0)
    assert none_known.kept == [0] and none_known.mean is None and none_known.max is None


@pytest.mark.parametrize("training, ahead, g, bound, expected, may", [
    (False, 0, 4, 0, 0, True), (False, 3, 4, 0, 0, True), (False, 4, 4, 0, 1, False),  # one batch per step
    (True, 0, 4, 0, 1, False),  # synchronous: nothing is sampled while a step trains
    (True, 3, 4, 1, 1, True), (True, 4, 4, 1, 2, False), (False, 11, 4, 2, 2, True), (False, 12, 4, 2, 3, False)])
def test_a_worker_waits_rather_than_start_a_group_that_would_train_too_stale(training, ahead, g, bound, expected, may):
    assert expected_staleness(training, ahead, g) == expected
    assert may_start_group(training, ahead, g, bound) is may


class FakeRun:
    """A run on a fake server: steps one batch at a time, applying the server's staleness filter,
    and remembering each idempotency key's result (a resubmitted key trains once)."""

    def __init__(self, bound: int, train_seconds: float = 0.02):
        self.step, self.bound, self.train_seconds = 0, bound, train_seconds
        self.training = False
        self.trained_groups: list[str] = []  # each trained group's id, once per training
        self.staleness: list[int] = []
        self.starts: list[tuple[int, bool, int]] = []  # (sampled step, a step was training, groups ahead)
        self.jobs: dict[str, TrainResult] = {}

    async def train(self, groups: list[TrajectoryGroup], key: str) -> TrainResult:
        if key in self.jobs:
            return self.jobs[key]
        self.training = True
        await asyncio.sleep(self.train_seconds)
        split = split_by_staleness([staleness(self.step, g.metadata["sampled"]) for g in groups], self.bound)
        self.staleness += [staleness(self.step, groups[i].metadata["sampled"]) for i in split.kept]
        self.trained_groups += [groups[i].metadata["id"] for i in split.kept]
        self.step += 1
        self.training = False
        self.jobs[key] = TrainResult(step=self.step, trained=True, metrics=StepMetrics(
            trained=True, groups_total=len(groups), groups_dropped_stale=len(split.dropped)))
        return self.jobs[key]


async def _short(run: FakeRun, index: int) -> None:
    await asyncio.sleep(0.005)


def _sampler(run: FakeRun, pipeline_ref: list[Pipeline], wait):
    async def sample(policy: str, index: int) -> TrajectoryGroup:
        p = pipeline_ref[0]
        step = int(policy.rpartition("@")[2])
        run.starts.append((step, p.state.training, p.state.sampling - 1 + len(p.state.ready)))
        started = len(run.starts)  # unique across pipelines on one run, unlike `index`
        await wait(run, index)
        return TrajectoryGroup(trajectories=[], metadata={"sampled": step, "id": f"g{started}-{index}"})
    return sample


async def _run(bound: int, steps: int, groups_per_step: int = 2, wait=_short, journal=None,
               train=None, run: FakeRun | None = None) -> tuple[FakeRun, list]:
    run = run or FakeRun(bound)
    ref: list[Pipeline] = []
    pipeline = Pipeline(_sampler(run, ref, wait), train or run.train, run="r", served_step=run.step,
                        groups_per_step=groups_per_step, max_steps_off_policy=bound, journal=journal,
                        max_exceptions=1.0)
    ref.append(pipeline)
    outcomes = []
    async with contextlib.aclosing(pipeline.steps(steps)) as it:
        async for o in it:
            outcomes.append(o)
    return run, outcomes


async def test_bound_zero_is_synchronous():
    run, outcomes = await _run(bound=0, steps=4)
    assert run.step == 4 and len(run.trained_groups) == 8  # one batch per step, nothing sampled to waste
    assert all(not training for _, training, _ in run.starts)
    assert run.staleness == [0] * 8
    assert [o.sampled_steps for o in outcomes] == [[0, 0], [1, 1], [2, 2], [3, 3]]


@pytest.mark.parametrize("bound", [1, 2, 4])
async def test_the_client_never_samples_a_group_that_would_train_more_than_the_bound_stale(bound):
    run, outcomes = await _run(bound=bound, steps=8)
    for sampled, training, ahead in run.starts:
        assert expected_staleness(training, ahead, 2) <= bound
    # Groups finish in the order they start here, so none is overtaken: every group trains within
    # the bound, and sampling ran ahead of training as far as the bound allows.
    assert max(run.staleness) == bound and min(run.staleness) == 0
    assert sum(o.result.metrics.groups_dropped_stale for o in outcomes) == 0
    assert len(set(run.trained_groups)) == len(run.trained_groups)


async def test_a_straggler_overtaken_past_the_bound_is_dropped_by_the_trainer_and_counted():
    async def wait(run: FakeRun, index: int) -> None:
        while index == 1 and run.step < 3:  # group 1 outlasts three steps: later groups fill the batches
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.005)

    run, outcomes = await _run(bound=1, steps=8, wait=wait)
    assert not any(g.endswith("-1") for g in run.trained_groups)
    assert sum(o.result.metrics.groups_dropped_stale for o in outcomes) == 1
    assert max(run.staleness) <= 1


async def test_an_interrupted_run_resubmits_its_journalled_batch_and_no_group_trains_twice(tmp_path):
    journal = Journal(tmp_path / "pending")
    run = FakeRun(bound=1)

    class Interrupted(Exception):
        pass

    async def train_then_die(groups, key):
        if run.step == 2:  # the job reaches the server, the client dies before it hears back
            await run.train(groups, key)
            raise Interrupted
        return await run.train(groups, key)

    with pytest.raises(Interrupted):
        await _run(bound=1, steps=5, journal=journal, train=train_then_die, run=run)
    assert run.step == 3 and len(journal.pending()) == 1
    pending_key, pending_groups = journal.pending()[0]
    assert pending_key == batch_key("r", pending_groups)

    _, outcomes = await _run(bound=1, steps=5, journal=journal, run=run)
    assert outcomes[0].resumed and outcomes[0].result.step == 3  # the server's answer, not a second step
    assert run.step == 5 and journal.pending() == []
    assert len(set(run.trained_groups)) == len(run.trained_groups) == 10


async def test_a_failing_sampler_ends_the_run_with_its_error():
    async def broken(policy, index):
        raise RuntimeError("environment is down")

    pipeline = Pipeline(broken, FakeRun(0).train, run="r", served_step=0, groups_per_step=2,
                        max_steps_off_policy=LoopConfig().max_steps_off_policy)

    with pytest.raises(RuntimeError, match="environment is down"):
        async with contextlib.aclosing(pipeline.steps(3)) as it:
            async for _ in it:
                pass
