"""The store's database: products and their item variants, users, orders.

Generated from a seed so that tasks, expected states and every episode agree on the same data
without shipping a data file. Plain dicts (tables of id -> record) so that `rewards.state` can
compare them and a tool result is already JSON.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from typing import Any

Db = dict[str, dict[str, Any]]

# name, base price, option name -> values; every combination of options is one item.
_CATALOG: list[tuple[str, float, dict[str, list[str]]]] = [
    ("T-Shirt", 24.0, {"color": ["black", "white", "blue"], "size": ["S", "M", "L"]}),
    ("Running Shoes", 89.0, {"color": ["black", "white"], "size": ["8", "9", "10"]}),
    ("Water Bottle", 18.0, {"capacity": ["500ml", "750ml", "1000ml"], "color": ["green", "blue"]}),
    ("Backpack", 64.0, {"color": ["black", "navy", "olive"], "size": ["small", "large"]}),
    ("Desk Lamp", 42.0, {"color": ["black", "white", "brass"]}),
    ("Wireless Headphones", 149.0, {"color": ["black", "silver"], "style": ["over-ear", "in-ear"]}),
    ("Coffee Mug", 12.0, {"color": ["white", "black", "yellow"], "capacity": ["300ml", "450ml"]}),
    ("Yoga Mat", 35.0, {"color": ["purple", "green", "black"], "thickness": ["4mm", "6mm"]}),
]
_FIRST = ["Ava", "Liam", "Mia", "Noah", "Zoe", "Omar", "Lena", "Ivan", "Sara", "Yuki", "Ravi", "Nora", "Hugo", "Ines", "Tariq"]
_LAST = ["Garcia", "Chen", "Smith", "Kowalski", "Okafor", "Silva", "Novak", "Haddad", "Ito", "Moreau"]
_STATUSES = ["pending", "delivered", "cancelled"]
_STATUS_WEIGHTS = [0.4, 0.4, 0.2]
CANCEL_REASONS = ("no longer needed", "ordered by mistake")

DEFAULT_SEED = 0
NUM_USERS = 30


def fresh_db(seed: int = DEFAULT_SEED) -> Db:
    """A private copy for one episode: tools mutate it in place."""
    # A JSON round trip copies plain data several times faster than copy.deepcopy.
    return json.loads(_generate_json(seed))


def order_total(order: dict[str, Any]) -> float:
    return round(sum(item["price"] for item in order["items"]), 2)


def format_options(options: dict[str, str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in options.items())


@functools.lru_cache(maxsize=4)
def _generate_json(seed: int) -> str:
    return json.dumps(_generate(seed))


def _generate(seed: int) -> Db:
    rng = random.Random(seed)
    taken: set[str] = set()
    products, items = _generate_catalog(rng, taken)
    users: dict[str, Any] = {}
    orders: dict[str, Any] = {}
    for first, last in rng.sample(list(itertools.product(_FIRST, _LAST)), NUM_USERS):
        user = _generate_user(rng, taken, first, last)
        users[user["user_id"]] = user
        for _ in range(rng.randint(1, 2)):
            order = _generate_order(rng, taken, user, products, items)
            orders[order["order_id"]] = order
            user["orders"].append(order["order_id"])
    return {"products": products, "items": items, "users": users, "orders": orders}


def _generate_catalog(rng: random.Random, taken: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    products: dict[str, Any] = {}
    items: dict[str, Any] = {}
    for name, base_price, option_values in _CATALOG:
        product_id = _unique_id(rng, taken, "", 10)
        product = {"product_id": product_id, "name": name, "item_ids": []}
        for combo in itertools.product(*option_values.values()):
            item_id = _unique_id(rng, taken, "", 10)
            items[item_id] = {
                "item_id": item_id,
                "product_id": product_id,
                "name": name,
                "options": dict(zip(option_values, combo)),
                "price": round(base_price * rng.uniform(0.85, 1.2), 2),
                "available": rng.random() > 0.2,
            }
            product["item_ids"].append(item_id)
        products[product_id] = product
    return products, items


def _generate_user(rng: random.Random, taken: set[str], first: str, last: str) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for kind in rng.sample(["credit_card", "paypal", "gift_card"], rng.randint(1, 2)):
        method_id = _unique_id(rng, taken, f"{kind}_", 7)
        method: dict[str, Any] = {"id": method_id, "type": kind}
        if kind == "credit_card":
            method["last_four"] = f"{rng.randint(0, 9999):04d}"
        methods[method_id] = method
    return {
        "user_id": f"{first}_{last}_{_unique_id(rng, taken, '', 4)}".lower(),
        "name": f"{first} {last}",
        "email": f"{first}.{last}{rng.randint(10, 99)}@example.com".lower(),
        "payment_methods": methods,
        "orders": [],
    }


def _generate_order(
    rng: random.Random, taken: set[str], user: dict[str, Any], products: dict[str, Any], items: dict[str, Any]
) -> dict[str, Any]:
    # Distinct products per order, so "the T-Shirt in order X" names one line of it.
    lines = [dict(items[rng.choice(p["item_ids"])]) for p in rng.sample(list(products.values()), rng.randint(1, 3))]
    for line in lines:
        del line["available"]
    method_id = rng.choice(list(user["payment_methods"]))
    order = {
        "order_id": _unique_id(rng, taken, "#W", 7),
        "user_id": user["user_id"],
        "status": rng.choices(_STATUSES, _STATUS_WEIGHTS)[0],
        "items": lines,
        "payment_method_id": method_id,
        "payment_history": [],
    }
    total = order_total(order)
    order["payment_history"].append({"transaction_type": "payment", "amount": total, "payment_method_id": method_id})
    if order["status"] == "cancelled":
        order["cancel_reason"] = rng.choice(CANCEL_REASONS)
        order["payment_history"].append({"transaction_type": "refund", "amount": total, "payment_method_id": method_id})
    return order


def _unique_id(rng: random.Random, taken: set[str], prefix: str, digits: int) -> str:
    while True:
        candidate = prefix + "".join(rng.choice("0123456789") for _ in range(digits))
        if candidate not in taken:
            taken.add(candidate)
            return candidate
