"""The two parties of a tau2-bench conversation that artisan supplies.

`ArtisanAgent` is tau2's own LLM agent (its system prompt: tau2's instructions and the domain's
policy; the domain's tools) with one change: each model turn is sampled from art-server the way
artisan's rollouts sample it (rollouts.agent.complete), and the Choice itself is kept, so the
trajectory trains on the exact tokens and logprobs the sampler produced. tau2's own LLMAgent goes
through litellm, which drops them (the failure the ART tau-bench post-mortem found).

`ArtisanUser` is tau2's UserSimulator, unchanged but for how it fails: any error of the user model
(an outage, an empty or unparseable message) is a UserSimulatorError, which the rollout raises, so
the episode is excluded from training and counted rather than scored 0 (invariant 4).

tau2's orchestrator is synchronous and runs in a worker thread; the agent hands each turn to the
event loop the client's rollouts run on and waits for it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from openai.types.chat.chat_completion import Choice
from tau2.agent.llm_agent import LLMAgent, LLMAgentState
from tau2.data_model.message import AssistantMessage, Message, MultiToolMessage, ToolCall
from tau2.user.user_simulator import UserSimulator
from tau2.utils.llm_utils import to_litellm_messages

from protocol.choices import MessageOrChoice, malformed_tool_call


class UserSimulatorError(RuntimeError):
    """The user simulator failed: the episode says nothing about the agent."""


class AgentEnded(Exception):
    """The agent's turn ended the episode: a turn tau2 cannot take (a malformed tool call, an empty
    message), no room left in the context window, or the turn limit. tau2 scores such an episode as
    one that ended prematurely (reward 0), as its own runner does with an agent that errs."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """tau2 messages as the OpenAI dicts a chat template renders (tau2's own conversion, without
    the keys it leaves None)."""
    return [{k: v for k, v in m.items() if v is not None} for m in to_litellm_messages(messages)]


def tau2_message(choice: Choice) -> AssistantMessage:
    """The sampled turn as tau2's AssistantMessage; AgentEnded when tau2 cannot take it."""
    if malformed_tool_call(choice):
        raise AgentEnded("malformed_tool_call", (choice.message.content or "")[:200])
    calls = []
    for call in choice.message.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as exc:
            raise AgentEnded("malformed_tool_call", f"{call.function.name}: {exc}") from None
        if not isinstance(arguments, dict):
            raise AgentEnded("malformed_tool_call", f"{call.function.name}: arguments are not a JSON object")
        calls.append(ToolCall(id=call.id, name=call.function.name, arguments=arguments))
    message = AssistantMessage(role="assistant", content=choice.message.content, tool_calls=calls or None, cost=0.0)
    if not (message.has_text_content() or message.is_tool_call()):
        raise AgentEnded("empty_message")
    return message


Sample = Callable[[list[MessageOrChoice]], Choice]


class ArtisanAgent(LLMAgent):
    def __init__(self, tools: list, domain_policy: str, sample: Sample, max_turns: int):
        super().__init__(tools=tools, domain_policy=domain_policy, llm=None)
        self.sample, self.max_turns = sample, max_turns
        self.schemas = [t.openai_schema for t in tools]
        self.items: list[MessageOrChoice] = []  # the trajectory: context messages and sampled Choices
        self.turns = 0

    def get_init_state(self, message_history: Optional[list[Message]] = None) -> LLMAgentState:
        state = super().get_init_state(message_history)
        self.items = [{"role": "system", "content": self.system_prompt}, *openai_messages(state.messages)]
        return state

    def generate_next_message(self, message, state: LLMAgentState) -> tuple[AssistantMessage, LLMAgentState]:
        incoming = message.tool_messages if isinstance(message, MultiToolMessage) else [message]
        state.messages.extend(incoming)
        self.items.extend(openai_messages(incoming))
        if self.turns >= self.max_turns:
            raise AgentEnded("max_turns")
        choice = self.sample(self.items)
        self.items.append(choice)
        self.turns += 1
        reply = tau2_message(choice)
        state.messages.append(reply)
        return reply, state

    def set_seed(self, seed: int) -> None:
        """Sampling seeds are the rollout settings' (artisan's), not tau2's."""


class ArtisanUser(UserSimulator):
    def generate_next_message(self, message, state):
        try:
            reply, state = super().generate_next_message(message, state)
            reply.validate()  # an empty message: the orchestrator would crash on it
        except Exception as exc:
            raise UserSimulatorError(f"user simulator {self.llm}: {type(exc).__name__}: {exc}") from exc
        return reply, state
