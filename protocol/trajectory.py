"""What a rollout produces: trajectories, their groups, and SFT conversations.

Names follow OpenPipe ART so that its users feel at home. Plain pydantic, importable on a laptop
without torch.
"""

from __future__ import annotations

import time
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol.choices import Message, MessageOrChoice, as_message, is_choice_dict
from protocol.nesting import check_arguments, check_message_calls

MAX_ABS_REWARD = 1e9


class History(BaseModel):
    """Another conversation the rollout's model held (ART's sub-agent or compaction histories):
    trained as its own sequences, sharing the trajectory's reward."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _revive_choices(cls, items: Any) -> Any:
        # Over HTTP a Choice arrives as a dict; bring it back so training sees a trainable turn.
        if not isinstance(items, list):
            return items
        return [Choice.model_validate(i) if is_choice_dict(i) else i for i in items]

    @field_validator("messages_and_choices")
    @classmethod
    def _check_items(cls, items: list[MessageOrChoice]) -> list[MessageOrChoice]:
        for i, item in enumerate(items):
            if not isinstance(item, Choice) and "role" not in item:
                raise ValueError(f"messages_and_choices[{i}] is neither a message (no 'role') nor a Choice")
            _check_calls(item, f"messages_and_choices[{i}]")
        return items

    def messages(self) -> list[Message]:
        """The conversation as plain OpenAI message dicts (Choices turned into assistant messages)."""
        return [as_message(i) for i in self.messages_and_choices]

    def choices(self) -> list[Choice]:
        return [i for i in self.messages_and_choices if isinstance(i, Choice)]


def _check_calls(item: MessageOrChoice, field: str) -> None:
    """Tool-call arguments that training could parse (protocol/nesting.py): refused when the job
    is submitted, not when it runs."""
    if not isinstance(item, Choice):
        check_message_calls(item, field)
        return
    for j, call in enumerate(item.message.tool_calls or []):
        fn = getattr(call, "function", None)
        if fn is not None:
            check_arguments(fn.arguments, f"{field}.message.tool_calls[{j}].function.arguments")


class Trajectory(History):
    """One rollout: context messages (dicts) interleaved with the model's sampled turns (Choices)."""

    additional_histories: list[History] = Field(default_factory=list)
    # Bounded so that group statistics (squares of rewards) stay finite: 1e308 passed validation and
    # then failed the job with an OverflowError.
    reward: float = Field(default=0.0, allow_inf_nan=False, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)
    metrics: dict[str, float | int | bool | None] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None

    def finish(self) -> "Trajectory":
        """Stamp the end time and duration; call once the reward is known, not before."""
        self.end_time = time.time()
        self.metrics["duration"] = self.end_time - self.start_time
        return self

    def histories(self) -> list[History]:
        """The main conversation first, then the additional ones: everything that trains."""
        return [self, *self.additional_histories]


class TrajectoryGroup(BaseModel):
    """The rollouts of one task. Exceptions are rollouts that failed for infrastructure reasons:
    recorded and counted, never scored (a zero reward there would teach the model a lie)."""

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    # The value of the group's prompt estimated before training (A*-PO's V*(x), client/loop/apo.py): with
    # TrainConfig.baseline "given", advantages are reward - value, and a group of one trains.
    value: float | None = Field(default=None, allow_inf_nan=False, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)

    @field_validator("exceptions", mode="before")
    @classmethod
    def _stringify(cls, items: Any) -> Any:
        if isinstance(items, list):
            return [i if isinstance(i, str) else f"{type(i).__name__}: {i}" for i in items]
        return items


def rewards_differ(rewards: list[float], min_spread: float) -> bool:
    """Whether a group's rewards differ by `min_spread` or more: only such a group carries a
    group-relative signal. The server drops the others (server/training/advantages.py), and
    `client.train --dynamic-sampling` samples others in their place, by this one rule."""
    return len(rewards) > 1 and max(rewards) - min(rewards) >= min_spread


def is_target(message: Message) -> bool:
    """An assistant message SFT trains on. `"weight": 0` makes one context only, as in OpenAI's
    fine-tuning format: a demonstration can show a mistake and its mending, and train the mending
    alone."""
    return isinstance(message, dict) and message.get("role") == "assistant" and message.get("weight", 1) == 1


class Conversation(BaseModel):
    """A demonstration for SFT: every assistant message is a target, but for those of weight 0."""

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages")
    @classmethod
    def _has_target(cls, messages: list[Message]) -> list[Message]:
        for i, m in enumerate(messages):
            check_message_calls(m, f"messages[{i}]")
            if isinstance(m, dict) and "weight" in m:
                weight = m["weight"]
                if m.get("role") != "assistant" or isinstance(weight, bool) or weight not in (0, 1):
                    raise ValueError(f"messages[{i}]: weight is 0 or 1, and only on an assistant message")
        if not any(is_target(m) for m in messages):
            raise ValueError("an SFT conversation needs at least one assistant message of weight 1")
        return messages
