"""The agent loop: one rollout of one task against any OpenAI-compatible endpoint.

`messages_and_choices` is built as the rollout happens: the Choice the server returned for
every model turn (its token ids and logprobs are the training data), and tool results as
`{"role": "tool", "tool_call_id", "content": <string>}`. The reward is computed after the last
turn, from the environment, and the trajectory is finished only then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

import openai
from openai import AsyncOpenAI
from openai.types.chat.chat_completion import Choice

from protocol.choices import Message, malformed_tool_call
from protocol.retry import RetryPolicy
from protocol.trajectory import Trajectory
from rollouts.episode import Environment, RolloutSettings, Task, ToolError, error_text
from rollouts.seeding import next_request_seed


class StopReason(str, Enum):
    ANSWERED = "answered"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    MALFORMED_TOOL_CALL = "malformed_tool_call"
    CONTEXT_OVERFLOW = "context_overflow"


class ContextOverflow(Exception):
    """The server says the prompt does not fit the model's context window."""


def tool_content(result: Any) -> str:
    """Tool results reach the model as strings; structured results as JSON."""
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


def truncate_middle(messages: list[Message], keep_head: int = 2) -> list[Message] | None:
    """Drop the oldest turn after the head (system prompt and task), keeping the start and the
    end. A tool call and its results go together. None when nothing more can be dropped."""
    head, rest = messages[:keep_head], messages[keep_head:]
    if len(rest) < 2:
        return None
    cut = 1
    while cut < len(rest) - 1 and rest[cut].get("role") == "tool":
        cut += 1
    return head + rest[cut:]


@dataclass
class ContextWindow:
    """What the model is sent: the whole trajectory until the server says it no longer fits, then
    the head and the newest turns (invariant 7). The trajectory itself keeps every message."""

    head: int = 2
    dropped: int = 0  # messages cut from just after the head
    truncations: int = 0

    def view(self, messages: list[Message]) -> list[Message]:
        return messages[:self.head] + messages[self.head + self.dropped:]

    def shrink(self, messages: list[Message]) -> bool:
        current = self.view(messages)
        shorter = truncate_middle(current, self.head)
        if shorter is None:
            return False
        self.dropped += len(current) - len(shorter)
        self.truncations += 1
        return True


def _is_context_overflow(exc: openai.BadRequestError) -> bool:
    body = exc.body if isinstance(exc.body, dict) else {}
    code = body.get("code") or (body.get("error") or {}).get("code")
    return code == "context_length_exceeded" or "context" in str(exc).lower() and "window" in str(exc).lower()


async def complete(client: AsyncOpenAI, model: str, messages: list[Message], tools: list[dict[str, Any]] | None,
                   settings: RolloutSettings, retry: RetryPolicy) -> Choice:
    """One model turn, as every artisan rollout samples it: the returned Choice carries the token
    ids and logprobs training needs. Transient failures are retried; ContextOverflow when the
    prompt does not fit."""
    # The settings' fixed seed (tests), else the seeded rollout's next one (rollouts/seeding.py); a
    # retry of this call resends the same seed, so it samples what the first attempt would have.
    seed = settings.seed if settings.seed is not None else next_request_seed()
    try:
        response = await retry.call(lambda: client.chat.completions.create(
            model=model, messages=messages, tools=tools or openai.NOT_GIVEN,
            max_tokens=settings.max_tokens, temperature=settings.temperature, top_p=settings.top_p,
            seed=openai.NOT_GIVEN if seed is None else seed,
            tool_choice=settings.tool_choice if settings.tool_choice is not None and tools else openai.NOT_GIVEN,
            parallel_tool_calls=openai.NOT_GIVEN if settings.parallel_tool_calls is None or not tools
            else settings.parallel_tool_calls))
    except openai.BadRequestError as exc:
        if _is_context_overflow(exc):
            raise ContextOverflow() from exc
        raise
    return response.choices[0]


async def _act(choice: Choice, env: Environment, traj: Trajectory) -> StopReason | None:
    """Carry out what the model's turn asks for; a StopReason when the episode is over."""
    if choice.finish_reason == "length":
        return StopReason.MAX_TOKENS
    calls = choice.message.tool_calls or []
    for call in calls:
        result = await _run_tool(env, call.function.name, call.function.arguments)
        traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": tool_content(result)})
    if calls:
        return StopReason.ANSWERED if env.finished() else None
    if malformed_tool_call(choice):
        return StopReason.MALFORMED_TOOL_CALL
    reply = await env.user_reply(traj.messages())
    if reply is None:
        return StopReason.ANSWERED
    traj.messages_and_choices.append({"role": "user", "content": reply})
    return None


async def rollout(client: AsyncOpenAI, model: str, env: Environment, task: Task, settings: RolloutSettings,
                  retry: RetryPolicy | None = None) -> Trajectory:
    """Run one episode. Raises when the server, a tool backend or the user simulator fails for
    good: the caller records that as an exception of the group, not as a reward."""
    retry = retry or RetryPolicy()
    traj = Trajectory(messages_and_choices=list(env.initial_messages()), tools=env.tools or None,
                      metadata={**task.metadata, "task_id": task.id})
    window = ContextWindow()
    stop: StopReason | None = None
    turns = 0
    while stop is None and turns < settings.max_turns:
        try:
            choice = await complete(client, model, window.view(traj.messages()), env.tools, settings, retry)
        except ContextOverflow:
            stop = None if window.shrink(traj.messages()) else StopReason.CONTEXT_OVERFLOW
            continue
        traj.messages_and_choices.append(choice)
        turns += 1
        stop = await _act(choice, env, traj)
    stop = stop or StopReason.MAX_TURNS
    score = await env.score(traj.messages())
    traj.reward = score.reward
    traj.metrics.update(score.metrics)
    tool_calls = sum(len(c.message.tool_calls or []) for c in traj.choices())
    traj.metrics.update({"turns": turns, "tool_calls": tool_calls, "context_truncations": window.truncations,
                         f"stop_{stop.value}": 1})
    traj.metadata["stop_reason"] = stop.value
    traj.logs.extend(score.logs)
    return traj.finish()


async def _run_tool(env: Environment, name: str, arguments: str) -> Any:
    """A bad call is the agent's mistake and it sees the error; other failures propagate."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as e:
        return f"Error: arguments are not valid JSON ({e})"
    if not isinstance(args, dict):
        return "Error: arguments must be a JSON object"
    try:
        return await env.call_tool(name, args)
    except ToolError as e:
        return error_text(e)
