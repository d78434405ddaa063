"""What one episode is made of: its task, the environment it runs in, its score, its sampling settings.

The agent loop (rollouts/agent.py) runs these; an example (rollouts/env.py) hands them out. Both
import them from here, so imports point one way: episode <- agent <- env.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

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


def error_text(error: ToolError) -> str:
    """What the model sees in place of the result of a call its tool rejected."""
    return f"Error: {error}"


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

