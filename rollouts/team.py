"""Episodes played by several agents, each role sampled from its own run: one trajectory per role.

A multi-agent example (TeamExample) plays an episode through a Team: `team.act(role, env, task)`
runs that role's agent loop (rollouts/agent.py) on the role's own model, and every choice it samples
goes into that role's trajectory of the episode, never another's. A role that acts more than once
in an episode keeps one trajectory whose later parts are additional histories, so the episode is
one sample of each run's policy. The episode's score gives each role a reward: the team's shared
one, or the role's own.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Mapping

from pydantic import BaseModel, Field

from protocol.trajectory import Trajectory
from rollouts.agent import rollout
from rollouts.episode import Environment, RolloutSettings, Task


@dataclass(frozen=True)
class Seat:
    """Where a role samples from: an AsyncOpenAI client of the server and the model it names
    (the role's run, or run@step)."""

    client: Any
    model: str


class TeamScore(BaseModel):
    """An episode's outcome: the reward every role shares, unless `roles` gives a role its own."""

    reward: float
    roles: dict[str, float] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool | None] = Field(default_factory=dict)

    def reward_of(self, role: str) -> float:
        return self.roles.get(role, self.reward)


@dataclass
class Team:
    """One episode's seats, and what each role sampled in it."""

    seats: Mapping[str, Seat]
    settings: RolloutSettings
    parts: dict[str, list[Trajectory]] = field(default_factory=dict)

    async def act(self, role: str, env: Environment, task: Task) -> Trajectory:
        """`role`'s agent loop on `env`, sampled from the role's seat; kept as that role's."""
        if role not in self.seats:
            raise KeyError(f"no seat for role {role!r}: the team has {', '.join(self.seats)}")
        seat = self.seats[role]
        part = await rollout(seat.client, seat.model, env, task, self.settings)
        self.parts.setdefault(role, []).append(part)
        return part

    def trajectories(self, score: TeamScore) -> dict[str, Trajectory]:
        """Each role that acted: its first part with the later ones as additional histories, the
        role's reward and the episode's metrics (a role's own first, under its name)."""
        out = {}
        for role, (first, *rest) in self.parts.items():
            t = first.model_copy(update={"additional_histories": [*first.additional_histories, *rest]})
            t.reward = score.reward_of(role)
            t.metrics = {**first.metrics, **score.metrics, "team_reward": score.reward}
            t.metadata = {**first.metadata, "role": role, "parts": len(rest) + 1}
            out[role] = t
        return out


class TeamExample(abc.ABC):
    """A task family for several agents (`python -m client.train --example NAME` trains every role's
    run together, client/loop/team_loop.py): its roles, its tasks, and how one episode is played."""

    name: str = "team"
    roles: tuple[str, ...] = ()
    settings: RolloutSettings  # each role's agent loop samples with these (an instance's own: the CLI overrides them)

    @abc.abstractmethod
    def train_tasks(self, seed: int) -> list[Task]: ...

    @abc.abstractmethod
    def eval_tasks(self) -> list[Task]: ...

    @abc.abstractmethod
    async def play(self, team: Team, task: Task) -> TeamScore:
        """One episode of `task`: the roles act through `team`, and the episode is scored."""
