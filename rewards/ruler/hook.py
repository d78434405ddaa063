"""The per-group hook a gather calls, so each group is judged as soon as its rollouts finish."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from protocol.trajectory import TrajectoryGroup
from rewards.ruler.config import JudgeConfig
from rewards.ruler.prompt import DEFAULT_RUBRIC
from rewards.ruler.scoring import score_group


def ruler_hook(
    judge: str | JudgeConfig, rubric: str = DEFAULT_RUBRIC, **kw: Any
) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup]]:
    """A per-group hook for a gather function, so each group is judged as soon as its rollouts finish.

    The hook raises :class:`JudgeError` when the judge fails. The gather must catch it and record
    the group as failed (its trajectories excluded, the error in ``exceptions``), never as zero
    rewards. ``kw`` goes to :func:`score_group`.
    """
    config = JudgeConfig.parse(judge)  # fail on a malformed spec now, not after the rollouts

    async def hook(group: TrajectoryGroup) -> TrajectoryGroup:
        return await score_group(group, config, rubric, **kw)

    return hook
