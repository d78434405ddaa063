"""The environment interface for multi-turn tool use.

Three small types carry the design (the first two defined in rollouts/episode.py, re-exported here):
- `Task`: one thing to do, with whatever the environment needs to set it up and score it.
- `Environment`: one episode of one task. A fresh instance per rollout, so rollouts of a group
  never share mutable state (a database one rollout cancels an order in must not leak into the next).
- `Example`: a named task family: train and held-out tasks, how to build an Environment, and
  the sampling settings its rollouts should use.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from protocol.choices import Message
from protocol.trajectory import Conversation
from rollouts.agent import rollout
from rollouts.episode import Environment, RolloutSettings, Score, Task, ToolError, error_text

__all__ = ["Environment", "Example", "Message", "RolloutSettings", "Score", "Task", "ToolError", "error_text"]


@dataclass
class Example(abc.ABC):
    """A task family usable by `python -m client.train --example NAME`."""

    name: str = "example"
    settings: RolloutSettings = field(default_factory=RolloutSettings)
    # The difficulty the task source draws at, 0 the easiest: an example with levels() > 1 makes its
    # train and held-out tasks at this level, and a curriculum (client/loop/curriculum.py) raises it.
    level: int = 0

    def levels(self) -> int:
        """How many difficulty levels the example has (1: none to climb)."""
        return 1

    @abc.abstractmethod
    def train_tasks(self, seed: int) -> list[Task]: ...

    @abc.abstractmethod
    def eval_tasks(self) -> list[Task]: ...

    @abc.abstractmethod
    def make_env(self, task: Task) -> Environment: ...

    def demonstrations(self, n: int) -> list[Conversation]:
        """`n` worked episodes for a warm start (`client.train --warm-start N`: art-server's SFT job
        trains on them before GRPO), drawn apart from the held-out tasks. An example without them
        cannot be warm-started."""
        raise NotImplementedError(f"example {self.name!r} has no demonstrations for --warm-start")

    def group_scorer(self, judge: Any) -> Callable[[Any], Awaitable[Any]] | None:
        """A hook that scores each training group once its rollouts are done (a TrajectoryGroup in,
        the scored group out), for an example whose reward compares a group's rollouts, such as a
        RULER judge's; None (the default): each rollout's environment reward alone. `judge` is the
        judge `client.train` was given, or else art-server's base model (a rewards.ruler.JudgeConfig).
        Held-out evaluation runs groups of one and keeps the environment's reward."""
        return None

    async def rollout(self, client: Any, model: str, task: Task) -> Any:
        """One episode of `task`, sampled from `model` through `client` (an AsyncOpenAI client of the
        server): a Trajectory, or an exception for a failure that is not the model's. The default is
        artisan's agent loop over `make_env(task)`; an example whose episodes another harness drives
        (tau2-bench's orchestrator, examples/tau2) overrides it."""
        return await rollout(client, model, self.make_env(task), task, self.settings)
