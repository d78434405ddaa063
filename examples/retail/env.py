"""One support conversation over a private copy of the store's database."""

from __future__ import annotations

import os
from typing import Any

from examples.retail.db import fresh_db
from examples.retail.tasks import RetailTask, expected_state
from examples.retail.tools import TOOL_SCHEMAS, WRITE_TOOLS, call_tool
from examples.retail.user import LLMUser, ScriptedUser, SimulatedUser, assistant_texts
from rewards.actions import compare_actions, extract_actions
from rewards.outputs import check_outputs
from rewards.state import compare_states
from rollouts.env import Environment, Message, Score, Task, ToolError

SYSTEM_PROMPT = """You are the customer-service agent of an online store. Help the user with their orders using the tools.

Policy:
- First authenticate the user: ask for their email and look it up with find_user_id_by_email, even if they already gave an order id.
- Only look at or change orders of the authenticated user.
- Before cancelling, modifying or returning anything, state exactly what you will do and ask the user to confirm; act only after they say yes.
- Only pending orders can be cancelled (reason 'no longer needed' or 'ordered by mistake') or have items changed, and an item can only be swapped for another available option of the same product.
- Only delivered orders can have items returned. Refunds go to the original payment method.
- Order ids start with '#W'. Prices are in US dollars.
- To talk to the user, reply in plain text without a tool call."""


class RetailEnv(Environment):
    tools = TOOL_SCHEMAS

    def __init__(
        self,
        task: Task,
        *,
        user: SimulatedUser | None = None,
        user_model: str | None = None,
        user_api_base: str | None = None,
        user_api_key: str | None = None,
    ):
        self.task = RetailTask.from_task(task)
        self.initial_db = fresh_db(self.task.db_seed)
        self.db = fresh_db(self.task.db_seed)
        self.expected_db = expected_state(self.task)
        self.tool_errors = 0
        self.user = user or _default_user(self.task, self.goal_reached, user_model, user_api_base, user_api_key)

    def initial_messages(self) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task.request}]

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        try:
            return call_tool(self.db, name, arguments)
        except ToolError:
            self.tool_errors += 1
            raise

    async def user_reply(self, messages: list[Message]) -> str | None:
        return await self.user.reply(messages)

    def goal_reached(self, messages: list[Message]) -> bool:
        return (
            compare_states(self.db, self.expected_db).match
            and check_outputs(assistant_texts(messages), self.task.required_outputs).all_found
        )

    async def score(self, messages: list[Message]) -> Score:
        state = compare_states(self.db, self.expected_db, baseline=self.initial_db)
        outputs = check_outputs(assistant_texts(messages), self.task.required_outputs)
        # Reads are free exploration (an agent may look an order up or be told about it), so only
        # writes are graded as actions.
        taken = [a for a in extract_actions(messages) if a.name in WRITE_TOOLS]
        actions = compare_actions(taken, self.task.ground_truth_actions)
        logs = [f"db: {line}" for line in state.diff]
        logs += [f"missing output: {o!r}" for o in outputs.missing]
        logs += [f"unexpected action: {a.name} {a.arguments if a.arguments is not None else a.raw_arguments}" for a in actions.unexpected]
        logs += [f"missing action: {a.name} {a.arguments}" for a in actions.missing]
        return Score(
            reward=1.0 if state.match and outputs.all_found else 0.0,
            metrics={
                "state_match": state.match,
                "records_match_fraction": state.records_match_fraction,
                "outputs_found_fraction": outputs.fraction,
                "action_precision": actions.precision,
                "action_recall": actions.recall,
                "action_f1": actions.f1,
                "tool_errors": self.tool_errors,
            },
            logs=logs,
        )


def _default_user(task: RetailTask, goal_reached: Any, model: str | None, api_base: str | None, api_key: str | None) -> SimulatedUser:
    model = model or os.environ.get("ARTISAN_USER_MODEL")
    if not model:
        return ScriptedUser(task, goal_reached)
    return LLMUser(task, model, api_base=api_base or os.environ.get("ARTISAN_USER_API_BASE"), api_key=api_key)
