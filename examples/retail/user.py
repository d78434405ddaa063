"""Simulated customers: a scripted one (deterministic, no model) and one played by an LLM.

Both open with the task's request (so the first turn is the same whichever plays the user) and
return None when the conversation is over.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol

from protocol.choices import is_choice_dict
from examples.retail.db import CANCEL_REASONS
from examples.retail.tasks import RetailTask
from rollouts.env import Message

STOP = "###STOP###"
_CONFIRM_CUES = ("confirm", "proceed", "shall i", "should i", "go ahead", "would you like me to", "do you want me to", "yes/no")
_IDENTITY_CUES = ("email", "identity", "authenticate", "user id")
_ORDER_CUES = ("order id", "order number", "which order")


class SimulatedUser(Protocol):
    async def reply(self, messages: list[Message]) -> str | None: ...


def as_message(item: Any) -> Message:
    """A message dict from a dict, a pydantic message, or a Choice (its `.message`)."""
    item = item["message"] if is_choice_dict(item) else getattr(item, "message", item)
    if hasattr(item, "model_dump"):
        return item.model_dump(exclude_none=True)
    return dict(item)


def assistant_texts(messages: list[Any]) -> list[str]:
    """Everything the assistant said to the user (tool-call-only turns say nothing)."""
    out = []
    for m in map(as_message, messages):
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"].strip():
            out.append(m["content"])
    return out


class ScriptedUser:
    """Answers the questions a desk agent asks, by keyword, from the task's facts.

    A pure function of the conversation (no hidden state), so replaying a conversation replays
    the user. `goal_reached` is the environment's oracle: the user stops once the task is done.
    """

    def __init__(self, task: RetailTask, goal_reached: Callable[[list[Message]], bool], *, max_replies: int = 6):
        self.task = task
        self.goal_reached = goal_reached
        self.max_replies = max_replies

    async def reply(self, messages: list[Message]) -> str | None:
        replies_so_far = sum(1 for m in map(as_message, messages) if m.get("role") == "user") - 1
        if self.goal_reached(messages) or replies_so_far >= self.max_replies:
            return None
        said = assistant_texts(messages)
        return self.respond_to(said[-1] if said else "")

    def respond_to(self, assistant_text: str) -> str:
        text, task = assistant_text.casefold(), self.task
        if _any(text, _IDENTITY_CUES) and task.email not in text:
            return f"My email is {task.email}."
        if _any(text, _ORDER_CUES) and task.order_id.casefold() not in text:
            return f"It's order {task.order_id}."
        if task.reason and "reason" in text and self._reason_unsettled(text):
            return f"{task.reason}."
        if "payment method" in text and "?" in text:
            return "Please use the original payment method."
        if _any(text, _CONFIRM_CUES):
            return "Yes, please go ahead."
        return f"Sorry, let me repeat: {task.request}"

    def _reason_unsettled(self, text: str) -> bool:
        # A confirmation names one reason; a question names none or offers both. A confirmation
        # with the wrong reason gets the reason again rather than a "yes".
        mentioned = [r for r in CANCEL_REASONS if r in text]
        wanted = [a.arguments.get("reason") for a in self.task.ground_truth_actions if a.arguments]
        return len(mentioned) != 1 or mentioned[0] not in wanted


def _any(text: str, cues: tuple[str, ...]) -> bool:
    return any(cue in text for cue in cues)


def user_prompt(task: RetailTask) -> str:
    facts = [f"Your name is {task.user_name} and your email is {task.email}."]
    if task.reason:
        facts.append(f"If asked why: {task.reason}.")
    return (
        "You are a customer writing to an online store's support agent. You play the customer only.\n"
        f"{' '.join(facts)}\n"
        f"What you want: {task.request}\n"
        "Write one short message at a time, as the customer. Give your email or order id only when "
        "asked. Do not invent facts you were not given. Confirm with 'yes' when the agent asks you to "
        f"confirm what you want. When your request is done, or cannot be done, reply with exactly {STOP}."
    )


class LLMUser:
    """The customer played by a model through litellm (`model` is a litellm model name)."""

    def __init__(
        self,
        task: RetailTask,
        model: str,
        *,
        api_base: str | None = None,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_replies: int = 10,
    ):
        self.task = task
        self.model = model
        self.api_base = api_base
        self.api_key = api_key
        self.temperature = temperature
        self.max_replies = max_replies

    async def reply(self, messages: list[Message]) -> str | None:
        conversation = user_view(self.task, messages)
        if sum(1 for m in conversation if m["role"] == "assistant") > self.max_replies:
            return None
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no cost-map download on import
        import litellm  # lazily: only runs with a user model configured

        response = await litellm.acompletion(
            model=self.model,
            messages=conversation,
            api_base=self.api_base,
            api_key=self.api_key,
            temperature=self.temperature,
        )
        text = (response.choices[0].message.content or "").strip()
        if not text:
            # A user that says nothing is a broken user model, not the agent's failure.
            raise RuntimeError(f"user model {self.model} returned an empty message")
        return None if STOP in text else text


def user_view(task: RetailTask, messages: list[Any]) -> list[Message]:
    """The conversation as the user model sees it: roles swapped, tool traffic hidden."""
    # Chat models expect the first turn to be the other party's, so the agent "greets" first.
    view: list[Message] = [
        {"role": "system", "content": user_prompt(task)},
        {"role": "user", "content": "Hi! How can I help you today?"},
    ]
    for m in map(as_message, messages):
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        if m.get("role") == "user":
            view.append({"role": "assistant", "content": content})
        elif m.get("role") == "assistant":
            view.append({"role": "user", "content": content})
    return view
