"""Two agents that must both learn: a shop assistant who can only ask, and a clerk who can look up.

The user asks the assistant an item's price. The assistant's one tool, `get_price`, does not read a
price list: it asks the clerk, another agent (another run), who holds the real `get_price` tool and
answers in prose as the demo's agent does (examples/demo). The clerk's answer comes back to the
assistant as the tool's result, the number the clerk stated, and the assistant answers the user.
Both roles start from the same warm start, the embedded model, which often skips the lookup and
states a made-up price: an episode earns 1 only when the assistant asked, the clerk looked the item
up, and the assistant's answer states the real price. So each agent's habit caps the other's
reward, and training only one of them leaves the other's skips in every episode.

    python -m client.train --example shop_team --run duo --steps 12 ...
    python -m client.train --example shop_team --run solo --train-roles assistant ...   # the ablation

`--rewards own` gives the clerk its own reward (did it look the item up and state its price) in
place of the shared one.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from examples.demo import task as demo
from rollouts.episode import RolloutSettings, Task, ToolError
from rollouts.team import Team, TeamExample, TeamScore

ROLES = ("assistant", "clerk")
CLERK_QUESTION = "What is the price of {item}?"


class AssistantEnv(demo.ShopEnv):
    """The demo's environment, but `get_price` is the clerk's answer to the assistant's question."""

    def __init__(self, task: Task, team: Team):
        super().__init__(task)
        self.team = team
        self.clerk: demo.ShopEnv | None = None
        self.clerk_said: int | None = None

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        item = self.asked_item(name, arguments)  # the shop has one item per episode: the clerk is asked only of it
        asked = Task(id=f"{self.task.id}-clerk", metadata={**self.task.metadata, "role": "clerk"},
                     data={**self.task.data, "question": CLERK_QUESTION.format(item=item)})
        self.clerk = demo.ShopEnv(asked)
        part = await self.team.act("clerk", self.clerk, asked)
        final = part.messages()[-1]
        numbers = re.findall(r"\d+", (final.get("content") or "") if final.get("role") == "assistant" else "")
        if not numbers:
            raise ToolError("the clerk did not state a price")
        self.clerk_said = int(numbers[0])
        return {"item": item, "price": self.clerk_said}


class ShopTeam(TeamExample):
    def __init__(self, n_train: int = 512, n_eval: int = 64, rewards: Literal["shared", "own"] = "shared"):
        self.name, self.roles, self.rewards = "shop_team", ROLES, rewards
        self.settings = RolloutSettings(max_turns=4, max_tokens=48, temperature=0.6)
        self.tasks = demo.make_example(n_train=n_train, n_eval=n_eval)

    def train_tasks(self, seed: int) -> list[Task]:
        return self.tasks.train_tasks(seed)

    def eval_tasks(self) -> list[Task]:
        return self.tasks.eval_tasks()

    async def play(self, team: Team, task: Task) -> TeamScore:
        env = AssistantEnv(task, team)
        trajectory = await team.act("assistant", env, task)
        shared = await env.score(trajectory.messages())
        clerk = None if env.clerk is None else await env.clerk.score(team.parts["clerk"][-1].messages())
        metrics = {**shared.metrics, "asked_clerk": env.clerk is not None,
                   "clerk_looked_up": bool(clerk and clerk.metrics["looked_up"]),
                   "clerk_right": env.clerk_said == task.data["price"]}
        own = {"clerk": clerk.reward} if self.rewards == "own" and clerk is not None else {}
        return TeamScore(reward=shared.reward, roles=own, metrics=metrics)


def make_example(n_train: int = 512, n_eval: int = 64, rewards: Literal["shared", "own"] = "shared") -> ShopTeam:
    return ShopTeam(n_train=n_train, n_eval=n_eval, rewards=rewards)
