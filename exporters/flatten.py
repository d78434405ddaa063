"""Trajectories flattened into what an observability tool shows: one `Item` per trajectory (where it
came from), and its model `Turn`s with the context each one saw, its tool calls and their results.
Shared by every exporter, on the server and the laptop."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice

from protocol.choices import choice_logprobs, choice_sampling, choice_token_ids
from protocol.trajectory import Trajectory, TrajectoryGroup


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: Any  # parsed JSON when it parses; the raw string when the model wrote bad JSON
    result: str | None  # None: the rollout ended before the tool answered


@dataclass
class Turn:
    index: int  # model turn number within the trajectory
    request: list[dict[str, Any]]  # the messages the model was prompted with
    output: dict[str, Any]  # the assistant message it produced
    finish_reason: str | None
    model: str  # the served policy (run, run@step or base), else "unknown"
    policy_step: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    parameters: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Item:
    """One trajectory with where it came from; what an exporter sends as one trace."""

    run: str
    step: int
    split: str
    group_index: int
    traj_index: int
    trajectory: Trajectory

    @property
    def key(self) -> str:
        return f"{self.run}/{self.split}/{self.step}/{self.group_index}/{self.traj_index}"

    def tags(self) -> dict[str, str]:
        # string values: OpenPipe and Langfuse metadata filters take strings
        return {"run": self.run, "step": str(self.step), "split": self.split, "group": str(self.group_index),
                "trajectory": str(self.traj_index), "reward": f"{self.trajectory.reward:.6g}"}


def items(groups: list[Any], run: str, step: int, split: str) -> list[Item]:
    out = []
    for gi, g in enumerate(groups):
        g = g if isinstance(g, TrajectoryGroup) else TrajectoryGroup.model_validate(g)
        out += [Item(run, step, split, gi, ti, t) for ti, t in enumerate(g.trajectories)]
    return out


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return raw


def turns(traj: Trajectory) -> list[Turn]:
    msgs = traj.messages()  # one per item of messages_and_choices, Choices as assistant messages
    results = {m.get("tool_call_id"): m.get("content") for m in msgs if m.get("role") == "tool"}
    out: list[Turn] = []
    for i, item in enumerate(traj.messages_and_choices):
        if not isinstance(item, Choice):
            continue
        sampling = choice_sampling(item)
        ids, lps = choice_token_ids(item), choice_logprobs(item)
        completion = len(ids) if ids is not None else (len(lps) if lps is not None else None)
        calls = [ToolCall(c.id, c.function.name, _arguments(c.function.arguments), results.get(c.id))
                 for c in (item.message.tool_calls or []) if getattr(c, "function", None) is not None]
        params = {"temperature": sampling.temperature, "top_p": sampling.top_p} if sampling else {}
        out.append(Turn(index=len(out), request=msgs[:i], output=msgs[i], finish_reason=item.finish_reason,
                        model=sampling.policy if sampling else "unknown",
                        policy_step=sampling.step if sampling else None,
                        prompt_tokens=sampling.prompt_len if sampling else None,
                        completion_tokens=completion, parameters=params, tool_calls=calls))
    return out


def initial_messages(traj: Trajectory) -> list[dict[str, Any]]:
    """The context before the first model turn (system prompt and task)."""
    out = []
    for item in traj.messages_and_choices:
        if isinstance(item, Choice):
            break
        out.append(item)
    return out
