"""Run many groups of rollouts concurrently and collect them as TrajectoryGroups.

A rollout that raises is recorded in its group's `exceptions` (counted, never scored). When
failures pass `max_exceptions` the whole gather stops with an error that says so, because a step
trained on the few rollouts that survived an outage teaches the wrong lesson.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from typing import Awaitable, Callable, Iterable

from protocol.trajectory import Trajectory, TrajectoryGroup

GroupHook = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup]]


class TooManyExceptions(RuntimeError):
    pass


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


async def gather_trajectory_groups(
    groups: Iterable[Iterable[Awaitable[Trajectory]]],
    max_exceptions: int | float = 0.5,
    progress: bool = True,
    concurrency: int = 32,
    after_each: GroupHook | None = None,
    description: str = "rollouts",
) -> list[TrajectoryGroup]:
    """`groups` yields, per task, the rollout coroutines of its group.

    max_exceptions: an int is a count of failed rollouts; a float below 1 a fraction of all.
    after_each: scores a group as soon as its rollouts finish (e.g. `rewards.ruler.ruler_hook`);
    if it raises, the whole group becomes exceptions (its trajectories are not trained).
    """
    specs = [list(g) for g in groups]
    total = sum(len(g) for g in specs)
    limit = asyncio.Semaphore(concurrency)
    bar = _Bar(total, description) if progress else None

    async def one(coro: Awaitable[Trajectory]) -> Trajectory | BaseException:
        async with limit:
            try:
                return await coro
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                return exc
            finally:
                if bar:
                    bar.advance()

    async def group(coros: list[Awaitable[Trajectory]]) -> TrajectoryGroup:
        results = await asyncio.gather(*(one(c) for c in coros))
        g = TrajectoryGroup(trajectories=[r for r in results if isinstance(r, Trajectory)],
                            exceptions=[_describe(r) for r in results if not isinstance(r, Trajectory)])
        if after_each is not None and g.trajectories:
            try:
                g = await after_each(g)
            except Exception as exc:
                # An error may say what to keep of the group (a judge's figures: rewards.ruler.JudgeError).
                g = TrajectoryGroup(trajectories=[], exceptions=g.exceptions + [_describe(exc)] * len(g.trajectories),
                                    metadata={**g.metadata, **getattr(exc, "group_metadata", {})})
        if bar:
            bar.record(g)
        return g

    try:
        out = await asyncio.gather(*(group(c) for c in specs))
    except asyncio.CancelledError:
        # A pipelined run that stops cancels the groups it was sampling: the rollouts that never
        # started are closed, not left for the garbage collector to warn about.
        for coro in (c for g in specs for c in g):
            if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()
        raise
    finally:
        if bar:
            bar.close()
    check_exceptions(out, total, max_exceptions)
    return out


def check_exceptions(groups: list[TrajectoryGroup], total: int, max_exceptions: int | float,
                     what: str = "rollouts") -> None:
    """Raise TooManyExceptions when more of the `total` rollouts failed than `max_exceptions` (a
    count, or a fraction of `total`) allows."""
    failed = sum(len(g.exceptions) for g in groups)
    allowed = max_exceptions if isinstance(max_exceptions, int) else int(max_exceptions * total)
    if failed > allowed:
        first = next(e for g in groups for e in g.exceptions)
        raise TooManyExceptions(f"{failed} of {total} {what} failed (limit {allowed}); first error: {first}")


class _Bar:
    """A rich progress bar showing the running mean reward."""

    def __init__(self, total: int, description: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.rewards: list[float] = []
        self.failed = 0
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[stats]}"), transient=True)
        self.task = self.progress.add_task(description, total=total, stats="")
        self.progress.start()

    def advance(self) -> None:
        self.progress.advance(self.task)

    def record(self, g: TrajectoryGroup) -> None:
        self.rewards += [t.reward for t in g.trajectories]
        self.failed += len(g.exceptions)
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")
        self.progress.update(self.task, stats=f"reward {mean:.3f} failed {self.failed}")

    def close(self) -> None:
        self.progress.stop()
