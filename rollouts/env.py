"""The environment interface for multi-turn tool use.

Three small types carry the design:
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

from pydantic import BaseModel, Field

from protocol.choices import Message


class Task(BaseModel):
    id: str
    data: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


class Score(BaseModel):
    reward: float
    metrics: dict[str, float | int | bool | None] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)


class ToolError(Exception):
    """A tool rejected its call (bad arguments, unknown id). The model sees the message as the
    tool's result; this is the agent's mistake, not an infrastructure failure."""


class Environment(abc.ABC):
    """One episode. Subclasses set `tools` (OpenAI tool schemas) and implement the methods."""

    tools: list[dict[str, Any]] = []

    @abc.abstractmethod
    def initial_messages(self) -> list[Message]:
        """System prompt and the user's opening message."""

    @abc.abstractmethod
    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run one tool call. Return a string or anything JSON-serialisable; raise ToolError for
        a call the tool rejects. Any other exception is an infrastructure failure."""

    def finished(self) -> bool:
        """True once a tool call has ended the episode (a final-answer tool, say): the agent loop
        then stops after that turn's tool results instead of asking the model again."""
        return False

    async def user_reply(self, messages: list[Message]) -> str | None:
        """The simulated user's next message after an assistant answer, or None when the
        conversation is over. The default has no simulated user: the first answer ends it."""
        return None

    @abc.abstractmethod
    async def score(self, messages: list[Message]) -> Score:
        """Reward for the finished episode, with its breakdown in metrics."""


@dataclass
class RolloutSettings:
    """Sampling settings an example recommends for its rollouts."""

    max_turns: int = 8
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # server-side sampling seed, for reproducible rollouts in tests
    # OpenAI's tool_choice ("auto", "required", or a named function); None sends none. "required"
    # makes every turn a tool call (art-server and vLLM decode it constrained), for an agent whose
    # episode ends with an answer tool.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one tool call per turn; None sends none


@dataclass
class Example(abc.ABC):
    """A task family usable by `python -m client.train --example NAME`."""

    name: str = "example"
    settings: RolloutSettings = field(default_factory=RolloutSettings)
    # The difficulty the task source draws at, 0 the easiest: an example with levels() > 1 makes its
    # train and held-out tasks at this level, and a curriculum (client/curriculum.py) raises it.
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
        from rollouts.agent import rollout  # rollouts.agent imports this module

        return await rollout(client, model, self.make_env(task), task, self.settings)
