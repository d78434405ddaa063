"""A customer-service desk in the style of tau-bench's retail domain.

The agent looks up users, orders and items and cancels, modifies or returns orders under the
store's rules. Reward is 1 only when the final database equals the expected one and the answers
state every required output (e.g. an order's total); partial credit goes to metrics.

The user is scripted (deterministic, no model) unless a user model is configured
(`user_model=` or ARTISAN_USER_MODEL, any litellm model name; ARTISAN_USER_API_BASE to point it
at an OpenAI-compatible server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from examples.retail import tasks
from examples.retail.db import DEFAULT_SEED
from examples.retail.env import RetailEnv
from examples.retail.tasks import RetailTask
from rollouts.env import Environment, Example, RolloutSettings, Task


@dataclass
class RetailExample(Example):
    name: str = "retail"
    settings: RolloutSettings = field(default_factory=lambda: RolloutSettings(max_turns=12, max_tokens=512))
    db_seed: int = DEFAULT_SEED
    train_size: int | None = None  # None: the whole training split
    eval_size: int | None = None
    user_model: str | None = None
    user_api_base: str | None = None

    def train_tasks(self, seed: int) -> list[Task]:
        return tasks.train_tasks(seed, db_seed=self.db_seed, n=self.train_size)

    def eval_tasks(self) -> list[Task]:
        return tasks.eval_tasks(db_seed=self.db_seed, n=self.eval_size)

    def make_env(self, task: Task) -> Environment:
        return RetailEnv(task, user_model=self.user_model, user_api_base=self.user_api_base)


def make_example(**kwargs: Any) -> RetailExample:
    return RetailExample(**kwargs)


__all__ = ["RetailEnv", "RetailExample", "RetailTask", "make_example"]
