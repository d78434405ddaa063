"""Ctrl-C ends `client.train` even when something it awaits swallows asyncio's cancellation."""

import asyncio
import contextlib
import os
import signal

import pytest

from client.loop.interrupt import run_interruptible

pytestmark = pytest.mark.unit


async def _swallows_one_cancel() -> str:
    asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGINT)
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        pass  # a library's except that eats the cancel: plain asyncio.run would return "finished"
    await asyncio.sleep(30)
    return "finished"


def test_ctrl_c_ends_a_run_that_swallowed_the_first_cancellation():
    with pytest.raises(KeyboardInterrupt):
        run_interruptible(_swallows_one_cancel())


def test_without_ctrl_c_the_result_and_errors_pass_through():
    async def value() -> int:
        return 7

    async def fails() -> None:
        raise ValueError("bad")

    assert run_interruptible(value()) == 7
    with pytest.raises(ValueError, match="bad"):
        run_interruptible(fails())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back


async def test_ctrl_c_while_a_step_trains_ends_the_train_call_before_the_run_unwinds():
    """The loop writes its summary as it unwinds, and says the step the run is at: a train call
    left running would answer later and move the run a step past both (CI saw the line say step 2
    with a summary at step 1)."""
    from client.pipeline import Pipeline
    from protocol.jobs import TrainResult
    from protocol.metrics import StepMetrics
    from protocol.trajectory import Trajectory, TrajectoryGroup

    ended: list[str] = []
    training = asyncio.Event()

    async def sample(policy: str, index: int) -> TrajectoryGroup:
        return TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], reward=r) for r in (0.0, 1.0)])

    async def train(groups: list[TrajectoryGroup], key: str) -> TrainResult:
        training.set()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        ended.append("trained")
        return TrainResult(step=1, trained=True, metrics=StepMetrics(trained=True, groups_total=len(groups)))

    async def run() -> None:
        async with contextlib.aclosing(Pipeline(sample, train, run="r", served_step=0, groups_per_step=1,
                                                max_steps_off_policy=0).steps(1)) as outcomes:
            async for _ in outcomes:
                pass

    task = asyncio.create_task(run())
    await training.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["cancelled"]
