"""The agent loop: one rollout of one task against any OpenAI-compatible endpoint.

`messages_and_choices` is built as the rollout happens: the Choice the server returned for
every model turn (its token ids and logprobs are the training data), and tool results as
`{"role": "tool", "tool_call_id", "content": <string>}`. The reward is computed after the last
turn, from the environment, and the trajectory is finished only then.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import openai
from openai import AsyncOpenAI

from client.types import Trajectory
from rollouts.env import Environment, Message, RolloutSettings, Task, ToolError
from rollouts.retry import RetryPolicy


class StopReason(str, Enum):
    ANSWERED = "answered"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    MALFORMED_TOOL_CALL = "malformed_tool_call"
    CONTEXT_OVERFLOW = "context_overflow"


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


def _is_context_overflow(exc: openai.BadRequestError) -> bool:
    body = exc.body if isinstance(exc.body, dict) else {}
    code = body.get("code") or (body.get("error") or {}).get("code")
    return code == "context_length_exceeded" or "context" in str(exc).lower() and "window" in str(exc).lower()


async def rollout(client: AsyncOpenAI, model: str, env: Environment, task: Task, settings: RolloutSettings,
                  retry: RetryPolicy | None = None) -> Trajectory:
    """Run one episode. Raises when the server, a tool backend or the user simulator fails for
    good: the caller records that as an exception of the group, not as a reward."""
    retry = retry or RetryPolicy()
    traj = Trajectory(messages_and_choices=list(env.initial_messages()), tools=env.tools or None,
                      metadata={**task.metadata, "task_id": task.id})
    stop = StopReason.MAX_TURNS
    turns = tool_calls = truncations = 0
    context: list[Message] | None = None  # set once the history had to be cut
    for _ in range(settings.max_turns):
        messages = context if context is not None else traj.messages()
        try:
            response = await retry.call(lambda: client.chat.completions.create(
                model=model, messages=messages, tools=env.tools or openai.NOT_GIVEN,
                max_tokens=settings.max_tokens, temperature=settings.temperature, top_p=settings.top_p,
                seed=openai.NOT_GIVEN if settings.seed is None else settings.seed))
        except openai.BadRequestError as exc:
            if not _is_context_overflow(exc):
                raise
            context = truncate_middle(messages)
            truncations += 1
            if context is None:
                stop = StopReason.CONTEXT_OVERFLOW
                break
            continue
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        if context is not None:
            context = context + [traj.messages()[-1]]
        turns += 1
        if choice.finish_reason == "length":
            stop = StopReason.MAX_TOKENS
            break
        calls = choice.message.tool_calls or []
        if calls:
            for call in calls:
                tool_calls += 1
                result = await _run_tool(env, call.function.name, call.function.arguments)
                msg = {"role": "tool", "tool_call_id": call.id, "content": tool_content(result)}
                traj.messages_and_choices.append(msg)
                if context is not None:
                    context.append(msg)
            continue
        if "<tool_call>" in (choice.message.content or ""):
            stop = StopReason.MALFORMED_TOOL_CALL
            break
        reply = await env.user_reply(traj.messages())
        if reply is None:
            stop = StopReason.ANSWERED
            break
        user = {"role": "user", "content": reply}
        traj.messages_and_choices.append(user)
        if context is not None:
            context.append(user)
    score = await env.score(traj.messages())
    traj.reward = score.reward
    traj.metrics.update(score.metrics)
    traj.metrics.update({"turns": turns, "tool_calls": tool_calls, "context_truncations": truncations,
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
        return f"Error: {e}"
