"""Several runs trained together on the episodes their agents share (rollouts/team.py).

`team_groups` plays each task's episodes and splits them by role: one TrajectoryGroup per task per
role, holding that role's trajectory of each episode, with the role's reward. `train_together`
submits every role's groups as one joint job (protocol/jobs.py JointJob): the server computes every
run's step before committing any, so all the runs move to their next step at one boundary, or none
does. Never imports torch.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Iterable, Mapping

from client.gather import check_exceptions
from client.model import TrainableModel, session_groups
from protocol.config import TrainConfig
from protocol.jobs import JointJob, JointSessionJob, RLJob, SessionGroup, SessionJob, TrainResult
from protocol.trajectory import TrajectoryGroup
from rollouts.episode import Task
from rollouts.seeding import derive_seed, seeded
from rollouts.team import Seat, Team, TeamExample


async def team_groups(example: TeamExample, seats: Mapping[str, Seat], tasks: list[Task], group_size: int,
                      seed: int | None = None, max_exceptions: float = 0.5) -> dict[str, list[TrajectoryGroup]]:
    """`group_size` episodes of each task, as each role's groups (a role that did not act in an
    episode has no trajectory of it; an episode that failed is an exception of every role's group).
    TooManyExceptions past `max_exceptions` (a fraction of the episodes)."""

    async def episode(index: int, task: Task, member: int):
        team = Team(seats, example.settings)
        try:  # seeded by the task's place too: a task drawn twice in a batch is two groups, not one twice
            score = await seeded(example.play(team, task),
                                 None if seed is None else derive_seed(seed, index, task.id, member))
        except Exception as exc:  # the server or an environment failed, not the agents: not a reward
            return exc
        return team.trajectories(score)

    played = await asyncio.gather(*(episode(i, t, m) for i, t in enumerate(tasks) for m in range(group_size)))
    out: dict[str, list[TrajectoryGroup]] = {role: [] for role in seats}
    for i, task in enumerate(tasks):
        episodes = played[i * group_size:(i + 1) * group_size]
        errors = [f"{type(e).__name__}: {e}" for e in episodes if isinstance(e, BaseException)]
        for role in seats:
            out[role].append(TrajectoryGroup(
                trajectories=[e[role] for e in episodes if isinstance(e, dict) and role in e],
                exceptions=errors, metadata={**task.metadata, "task_id": task.id, "role": role}))
    any_role = next(iter(out.values()))
    check_exceptions(any_role, len(tasks) * group_size, max_exceptions, "episodes")
    return out


async def train_together(models: Mapping[str, TrainableModel], groups: Mapping[str, list[TrajectoryGroup]],
                         config: TrainConfig | Mapping[str, TrainConfig] | None = None,
                         idempotency_key: str | None = None) -> dict[str, TrainResult]:
    """Each role's groups trained by its run, all at one step boundary; results by role. Roles with
    no trajectory to train are left out (one left trains alone). An interrupted joint job is sent
    again under its key: the server trains only the runs whose step did not land."""
    configs = {r: (config.get(r) if isinstance(config, Mapping) else config) or TrainConfig() for r in models}
    # A role's group of a task it never acted in holds nothing: not a group to send.
    groups = {r: [g for g in groups.get(r, []) if g.trajectories or g.exceptions] for r in models}
    roles = [r for r in models if any(g.trajectories for g in groups[r])]
    if len(roles) < 2:
        return {r: await models[r].train(groups[r], configs[r], idempotency_key) for r in roles}
    joint = JointJob(jobs={models[r].name: RLJob(groups=groups[r], config=configs[r]) for r in roles},
                     idempotency_key=idempotency_key or uuid.uuid4().hex)
    return await _run_joint({r: models[r] for r in roles}, "joint-jobs", joint)


async def train_sessions_together(models: Mapping[str, TrainableModel],
                                  groups: Mapping[str, Iterable[SessionGroup | Iterable[tuple[str, float]]]],
                                  config: TrainConfig | None = None,
                                  idempotency_key: str | None = None) -> dict[str, TrainResult]:
    """`train_together` for sessions: each role's harness ran under its own run's session URLs
    (`TrainableModel.session_url`), and each role's (session id, reward) groups train its run, every
    run at one step boundary."""
    joint = JointSessionJob(jobs={models[r].name: SessionJob(groups=session_groups(g), config=config or TrainConfig())
                                  for r, g in groups.items()}, idempotency_key=idempotency_key or uuid.uuid4().hex)
    return await _run_joint({r: models[r] for r in groups}, "joint-session-jobs", joint)


async def _run_joint(models: Mapping[str, TrainableModel], route: str,
                     joint: JointJob | JointSessionJob) -> dict[str, TrainResult]:
    """Submit a joint job and follow every run's part to its end (TrainableModel.submit_jobs: an
    interrupted part sends the whole again under its key, which trains only the parts that did not
    land); each role's result, its model's step moved."""
    names = {m.name: r for r, m in models.items()}
    if len(names) < len(models):
        raise ValueError("two roles train the same run: give each role a run of its own")
    results = await next(iter(models.values())).submit_jobs(f"/v1/{route}", joint)
    for run, result in results.items():
        models[names[run]].step = result.step
    return {names[run]: result for run, result in results.items()}


__all__ = ["Seat", "Team", "TeamExample", "team_groups", "train_sessions_together", "train_together"]
