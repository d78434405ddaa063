"""Tasks for the desk, derived from the database: what the user wants and what counts as done.

Each task carries its ground-truth write actions; the expected final state is those actions
applied to a fresh database. Tasks about one order all fall in the same split (by a hash of the
order id), so a held-out task never asks about an order seen in training.
"""

from __future__ import annotations

import functools
import hashlib
import random
from typing import Any, Literal

from pydantic import BaseModel

from examples.retail.db import CANCEL_REASONS, DEFAULT_SEED, Db, format_options, fresh_db, order_total
from examples.retail.tools import call_tool
from rewards.actions import Action
from rewards.state import state_hash
from rollouts.env import Task

TaskKind = Literal["cancel", "modify", "return", "total"]
Split = Literal["train", "eval"]

# How a user says each cancel reason; the agent has to map it onto the tool's enum.
_REASON_PHRASES = {"no longer needed": "I don't need it anymore", "ordered by mistake": "I ordered it by mistake"}
assert set(_REASON_PHRASES) == set(CANCEL_REASONS)


class RetailTask(BaseModel):
    id: str
    kind: TaskKind
    request: str  # the user's opening message, in the first person
    user_id: str
    user_name: str
    email: str
    order_id: str
    reason: str | None = None  # for cancel tasks: how the user words the reason when asked
    ground_truth_actions: list[Action]
    required_outputs: list[str] = []
    db_seed: int
    # Pins the target: a task stored by an older version of the generator must not be scored
    # against a database that has since changed.
    expected_state_hash: str

    def to_task(self, split: Split) -> Task:
        return Task(id=self.id, data=self.model_dump(mode="json"), metadata={"kind": self.kind, "split": split})

    @classmethod
    def from_task(cls, task: Task) -> "RetailTask":
        return cls.model_validate(task.data)


def expected_state(task: RetailTask) -> Db:
    db = fresh_db(task.db_seed)
    for action in task.ground_truth_actions:
        call_tool(db, action.name, action.arguments or {})
    if state_hash(db) != task.expected_state_hash:
        raise ValueError(f"task {task.id} was made from a different database (seed {task.db_seed}); regenerate it")
    return db


def split_of(order_id: str) -> Split:
    return "eval" if hashlib.sha256(order_id.encode()).digest()[0] % 5 == 0 else "train"


def train_tasks(seed: int, *, db_seed: int = DEFAULT_SEED, n: int | None = None) -> list[Task]:
    """The training split in an order (and, with n, a subset) fixed by `seed`."""
    pool = [t.to_task("train") for t in all_tasks(db_seed) if split_of(t.order_id) == "train"]
    random.Random(seed).shuffle(pool)
    return pool[:n]


def eval_tasks(*, db_seed: int = DEFAULT_SEED, n: int | None = None) -> list[Task]:
    return [t.to_task("eval") for t in all_tasks(db_seed) if split_of(t.order_id) == "eval"][:n]


def all_tasks(db_seed: int = DEFAULT_SEED) -> list[RetailTask]:
    """Every task the database supports, in a fixed order."""
    return [t.model_copy(deep=True) for t in _all_tasks(db_seed)]


@functools.lru_cache(maxsize=4)
def _all_tasks(db_seed: int) -> tuple[RetailTask, ...]:
    db = fresh_db(db_seed)
    tasks: list[RetailTask] = []
    for order_id, order in db["orders"].items():
        user = db["users"][order["user_id"]]
        rng = random.Random(f"{db_seed}:{order_id}")
        specs = [_total_spec(order)]
        if order["status"] == "pending":
            specs.append(_cancel_spec(order, rng))
            specs.extend(_modify_specs(db, order, rng))
        elif order["status"] == "delivered":
            specs.extend(_return_specs(order, rng))
        for i, spec in enumerate(specs):
            tasks.append(_build(db_seed, user, order_id, f"retail-{spec['kind']}-{order_id.lstrip('#')}-{i}", spec))
    return tuple(tasks)


def _build(db_seed: int, user: dict[str, Any], order_id: str, task_id: str, spec: dict[str, Any]) -> RetailTask:
    db = fresh_db(db_seed)
    for action in spec["actions"]:
        call_tool(db, action["name"], action["arguments"])
    return RetailTask(
        id=task_id,
        kind=spec["kind"],
        request=spec["request"],
        user_id=user["user_id"],
        user_name=user["name"],
        email=user["email"],
        order_id=order_id,
        reason=spec.get("reason"),
        ground_truth_actions=spec["actions"],
        required_outputs=spec.get("outputs", []),
        db_seed=db_seed,
        expected_state_hash=state_hash(db),
    )


def _total_spec(order: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "total",
        "request": f"Hi! Could you tell me the total price of my order {order['order_id']}?",
        "actions": [],
        "outputs": [f"{order_total(order):.2f}"],
    }


def _cancel_spec(order: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    reason = rng.choice(CANCEL_REASONS)
    return {
        "kind": "cancel",
        "request": f"Hi, I want to cancel my order {order['order_id']}.",
        "reason": _REASON_PHRASES[reason],
        "actions": [_action("cancel_pending_order", order_id=order["order_id"], reason=reason)],
    }


def _modify_specs(db: Db, order: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    swaps = []
    for line in order["items"]:
        siblings = db["products"][line["product_id"]]["item_ids"]
        options = [db["items"][i] for i in siblings if i != line["item_id"] and db["items"][i]["available"]]
        if options:
            swaps.append((line, rng.choice(options)))
    if not swaps:
        return []
    old, new = rng.choice(swaps)
    request = (
        f"Hi, in my order {order['order_id']} I'd like to change the {old['name']} "
        f"({format_options(old['options'])}) to the one with {format_options(new['options'])}."
    )
    action = _action("modify_pending_order_items", order_id=order["order_id"], item_ids=[old["item_id"]], new_item_ids=[new["item_id"]])
    return [{"kind": "modify", "request": request, "actions": [action]}]


def _return_specs(order: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    picks = [[rng.choice(order["items"])]]
    if len(order["items"]) > 1:
        picks.append(order["items"])
    specs = []
    for lines in picks:
        described = " and the ".join(f"{line['name']} ({format_options(line['options'])})" for line in lines)
        specs.append(
            {
                "kind": "return",
                "request": f"Hi, I'd like to return the {described} from my order {order['order_id']}.",
                "actions": [_action("return_delivered_order_items", order_id=order["order_id"], item_ids=[l["item_id"] for l in lines])],
            }
        )
    return specs


def _action(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}
