"""Where a run's rollouts happen, here or on Ray workers, behind one `run_groups`."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, AsyncContextManager, Awaitable

from client.gather import TooManyExceptions, gather_trajectory_groups
from client.loop.config import LoopConfig
from client.model import TrainableModel
from client.outage import MODEL_CALL_SECONDS, watch_for
from client.loop.ray_rollouts import RayRolloutPool
from protocol.domains import DOMAIN_KEY
from protocol.trajectory import Trajectory, TrajectoryGroup
from rollouts.env import Example, Task
from rollouts.seeding import derive_seed, seeded


class RolloutSource:
    """An example's rollouts from the server's policies; the subclasses say where each one runs."""

    figures: dict[str, Any] | None = None  # the Ray workers' figures, when rollouts run there

    def __init__(self, model: TrainableModel, example: Example):
        self.model, self.example = model, example

    def batch(self) -> AsyncContextManager[Any]:
        """What one batch of rollouts shares (opened before it, closed after)."""
        raise NotImplementedError

    def rollout(self, shared: Any, policy: str, task: Task, seed: int | None) -> Awaitable[Trajectory]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    async def run_groups(self, tasks: list[Task], group_size: int, hook=None, progress: bool = True,
                         description: str = "rollouts", policy: str | None = None,
                         max_exceptions: int | float = 0.5, seed: int | None = None) -> list[TrajectoryGroup]:
        """`policy`: the served name to sample from (`run@step`); the run's latest step by default.
        `seed`: every rollout's calls are seeded from it (the k-th rollout of the i-th task from
        derive_seed(seed, i, k)); None: unseeded."""
        policy = policy or self.model.name
        async with self.batch() as shared:
            def one(i: int, k: int, t: Task) -> Awaitable[Trajectory]:  # made anew for each try
                return self.rollout(shared, policy, t, None if seed is None else derive_seed(seed, i, k))

            # A rollout (or a judgment) cut off by a server restart runs again once it is back (client/outage.py).
            watch = watch_for(self.model)
            groups = [[watch.run(functools.partial(one, i, k, t)) for k in range(group_size)]
                      for i, t in enumerate(tasks)]
            scored = None if hook is None else lambda g: watch.run(lambda: hook(g))
            try:
                gathered = await gather_trajectory_groups(groups, progress=progress, after_each=scored,
                                                          description=description, max_exceptions=max_exceptions)
            except TooManyExceptions:
                if watch.gone is not None:  # the server did not come back within the retry window
                    raise watch.gone from None
                raise
            if watch.gone is not None:
                raise watch.gone
        # A group is one task's rollouts: it carries the task's domain, so that its failed rollouts are
        # counted against that domain too (protocol/domains.py).
        for g, t in zip(gathered, tasks):
            if DOMAIN_KEY in t.metadata:
                g.metadata.setdefault(DOMAIN_KEY, t.metadata[DOMAIN_KEY])
        return gathered

    async def one_group(self, task: Task, n: int, policy: str) -> TrajectoryGroup:
        """`n` rollouts of one task from `policy` (A*-PO's reference samples: the base model)."""
        return (await self.run_groups([task], n, progress=False, description="reference", policy=policy,
                                      max_exceptions=1.0))[0]


class LocalRollouts(RolloutSource):
    """Rollouts in this process, through the server's OpenAI-compatible API."""

    def batch(self) -> AsyncContextManager[Any]:
        # One client per batch, closed when the batch is done: an unclosed client's connections can
        # leave a later batch's responses unread until they time out.
        return self.model.openai_client(max_retries=0, timeout=MODEL_CALL_SECONDS)

    def rollout(self, shared: Any, policy: str, task: Task, seed: int | None) -> Awaitable[Trajectory]:
        return seeded(self.example.rollout(shared, policy, task), seed)


class RayRollouts(RolloutSource):
    """Rollouts on a pool of Ray workers (client/loop/ray_rollouts.py); the judge still scores here."""

    def __init__(self, model: TrainableModel, example: Example, pool: RayRolloutPool):
        super().__init__(model, example)
        self.pool = pool
        self.figures = pool.figures

    def batch(self) -> AsyncContextManager[Any]:
        return contextlib.nullcontext()

    def rollout(self, shared: Any, policy: str, task: Task, seed: int | None) -> Awaitable[Trajectory]:
        return self.pool.rollout(policy, task)  # the workers sample unseeded

    def close(self) -> None:
        self.pool.close()


async def rollout_source(cfg: LoopConfig, example: Example, model: TrainableModel) -> RolloutSource:
    """The run's rollouts: on Ray workers with `cfg.ray` (started here, said in one line), else here."""
    if cfg.ray is None:
        return LocalRollouts(model, example)
    pool = await RayRolloutPool(cfg.ray, example, model.server_url, cfg.api_key, cfg.run).start()
    print(pool.describe(), flush=True)
    return RayRollouts(model, example, pool)


async def run_groups(model: TrainableModel, example: Example, tasks: list[Task], group_size: int,
                     hook=None, progress: bool = True, description: str = "rollouts", policy: str | None = None,
                     max_exceptions: int | float = 0.5, workers: RayRolloutPool | None = None,
                     seed: int | None = None) -> list[TrajectoryGroup]:
    """RolloutSource.run_groups for one batch: `workers`, if given, run the rollouts instead of this process."""
    source = RayRollouts(model, example, workers) if workers else LocalRollouts(model, example)
    return await source.run_groups(tasks, group_size, hook, progress=progress, description=description,
                                   policy=policy, max_exceptions=max_exceptions, seed=seed)
