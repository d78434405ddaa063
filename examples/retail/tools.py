"""The desk's tools: OpenAI schemas, their implementations over a `Db`, and one dispatcher.

Store policy lives in the tools (only pending orders can be cancelled, ...) and is enforced by
raising ToolError: the model reads the message as the tool's result and can recover, which is
what it must learn, and an illegal action can never reach the database.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from examples.retail.db import CANCEL_REASONS, Db, order_total
from rollouts.env import ToolError

_STRING = {"type": "string"}
_STRINGS = {"type": "array", "items": {"type": "string"}}


def _schema(name: str, description: str, **params: tuple[dict[str, Any], str]) -> dict[str, Any]:
    properties = {p: {**spec, "description": text} for p, (spec, text) in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _schema(
        "find_user_id_by_email",
        "Find a user's id from their email address.",
        email=(_STRING, "The user's email, e.g. 'ava.chen42@example.com'."),
    ),
    _schema(
        "get_user_details",
        "Get a user's name, email, payment methods and order ids.",
        user_id=(_STRING, "The user's id, e.g. 'ava_chen_1234'."),
    ),
    _schema(
        "get_order_details",
        "Get an order's status, items (with prices), payment method and payment history.",
        order_id=(_STRING, "The order id, starting with '#W', e.g. '#W1234567'."),
    ),
    _schema(
        "get_item_details",
        "Get one item: its product, options, price and availability.",
        item_id=(_STRING, "The item id, e.g. '1008292230'."),
    ),
    _schema(
        "list_product_items",
        "List every item (option combination) of a product, with price and availability.",
        product_id=(_STRING, "The product id, e.g. '6086499569'."),
    ),
    _schema(
        "cancel_pending_order",
        "Cancel a pending order; the amount paid is refunded to the original payment method.",
        order_id=(_STRING, "The order id, starting with '#W'."),
        reason=({"type": "string", "enum": list(CANCEL_REASONS)}, "Why the user cancels."),
    ),
    _schema(
        "modify_pending_order_items",
        "In a pending order, swap items for other available options of the same products. The "
        "price difference is charged or refunded to the order's payment method.",
        order_id=(_STRING, "The order id, starting with '#W'."),
        item_ids=(_STRINGS, "The ids of the items to replace."),
        new_item_ids=(_STRINGS, "The ids of the new items, in the same positions as item_ids."),
    ),
    _schema(
        "return_delivered_order_items",
        "Request a return of items from a delivered order; they are refunded to the original payment method.",
        order_id=(_STRING, "The order id, starting with '#W'."),
        item_ids=(_STRINGS, "The ids of the items to return."),
    ),
]

# Tools that change the database: the ones ground-truth actions are made of.
WRITE_TOOLS = frozenset({"cancel_pending_order", "modify_pending_order_items", "return_delivered_order_items"})


def call_tool(db: Db, name: str, arguments: dict[str, Any]) -> Any:
    """Check the arguments against the tool's schema, then run it on `db`."""
    if name not in _TOOLS:
        raise ToolError(f"unknown tool {name!r}; the tools are: {', '.join(_TOOLS)}")
    if not isinstance(arguments, dict):
        raise ToolError(f"{name}: arguments must be a JSON object")
    _check_arguments(_SCHEMAS[name], arguments)
    return copy.deepcopy(_TOOLS[name](db, **arguments))


def find_user_id_by_email(db: Db, email: str) -> str:
    for user in db["users"].values():
        if user["email"] == email.strip().lower():
            return user["user_id"]
    raise ToolError(f"no user with email {email!r}")


def get_user_details(db: Db, user_id: str) -> dict[str, Any]:
    return _lookup(db, "users", user_id, "user")


def get_order_details(db: Db, order_id: str) -> dict[str, Any]:
    return _order(db, order_id)


def get_item_details(db: Db, item_id: str) -> dict[str, Any]:
    return _lookup(db, "items", item_id, "item")


def list_product_items(db: Db, product_id: str) -> dict[str, Any]:
    product = _lookup(db, "products", product_id, "product")
    return {"product_id": product_id, "name": product["name"], "items": [db["items"][i] for i in product["item_ids"]]}


def cancel_pending_order(db: Db, order_id: str, reason: str) -> dict[str, Any]:
    order = _order(db, order_id, status="pending", verb="cancelled")
    paid = _net_paid(order)
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    order["payment_history"].append(_transaction("refund", paid, order["payment_method_id"]))
    return order


def modify_pending_order_items(db: Db, order_id: str, item_ids: list[str], new_item_ids: list[str]) -> dict[str, Any]:
    order = _order(db, order_id, status="pending", verb="modified")
    if not item_ids or len(item_ids) != len(new_item_ids):
        raise ToolError("item_ids and new_item_ids must be non-empty lists of the same length")
    positions = _positions_in_order(order, item_ids)
    new_lines = []
    for old_id, new_id in zip(item_ids, new_item_ids):
        new = _lookup(db, "items", new_id, "item")
        old = db["items"][old_id]
        if new["product_id"] != old["product_id"]:
            raise ToolError(f"item {new_id} is a {new['name']}, not another option of the {old['name']} {old_id}")
        if new_id == old_id:
            raise ToolError(f"item {new_id} is the item already in the order")
        if not new["available"]:
            raise ToolError(f"item {new_id} ({new['name']}, {new['options']}) is not available")
        new_lines.append({k: v for k, v in new.items() if k != "available"})
    before = order_total(order)
    for position, line in zip(positions, new_lines):
        order["items"][position] = line
    difference = round(order_total(order) - before, 2)
    if difference:
        kind = "payment" if difference > 0 else "refund"
        order["payment_history"].append(_transaction(kind, abs(difference), order["payment_method_id"]))
    return order


def return_delivered_order_items(db: Db, order_id: str, item_ids: list[str]) -> dict[str, Any]:
    order = _order(db, order_id, status="delivered", verb="returned")
    if not item_ids:
        raise ToolError("item_ids must list at least one item to return")
    positions = _positions_in_order(order, item_ids)
    refund = round(sum(order["items"][p]["price"] for p in positions), 2)
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["payment_history"].append(_transaction("refund", refund, order["payment_method_id"]))
    return order


_TOOLS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in [
        find_user_id_by_email,
        get_user_details,
        get_order_details,
        get_item_details,
        list_product_items,
        cancel_pending_order,
        modify_pending_order_items,
        return_delivered_order_items,
    ]
}
_SCHEMAS = {s["function"]["name"]: s for s in TOOL_SCHEMAS}
assert set(_TOOLS) == set(_SCHEMAS), "every tool needs exactly one schema"


def _check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> None:
    name, params = schema["function"]["name"], schema["function"]["parameters"]
    properties = params["properties"]
    unknown = sorted(set(arguments) - set(properties))
    missing = [p for p in params["required"] if p not in arguments]
    if unknown or missing:
        raise ToolError(f"{name}: unknown arguments {unknown}, missing arguments {missing}; expected {list(properties)}")
    for param, value in arguments.items():
        spec = properties[param]
        if spec["type"] == "string" and not isinstance(value, str):
            raise ToolError(f"{name}: {param} must be a string")
        if spec["type"] == "array" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ToolError(f"{name}: {param} must be a list of strings")
        if "enum" in spec and value not in spec["enum"]:
            raise ToolError(f"{name}: {param} must be one of {spec['enum']}, not {value!r}")


def _lookup(db: Db, table: str, key: str, what: str) -> dict[str, Any]:
    if key not in db[table]:
        raise ToolError(f"{what} not found: {key!r}")
    return db[table][key]


def _order(db: Db, order_id: str, *, status: str | None = None, verb: str = "") -> dict[str, Any]:
    if order_id not in db["orders"]:
        hint = "" if order_id.startswith("#W") else " (order ids start with '#W', e.g. '#W1234567')"
        raise ToolError(f"order not found: {order_id!r}{hint}")
    order = db["orders"][order_id]
    if status is not None and order["status"] != status:
        raise ToolError(f"order {order_id} is {order['status']}; only {status} orders can be {verb}")
    return order


def _positions_in_order(order: dict[str, Any], item_ids: list[str]) -> list[int]:
    """Where each requested item sits in the order; each line can be used once."""
    if len(set(item_ids)) != len(item_ids):
        raise ToolError(f"duplicate item ids: {item_ids}")
    in_order = {line["item_id"]: i for i, line in enumerate(order["items"])}
    absent = [i for i in item_ids if i not in in_order]
    if absent:
        raise ToolError(f"items not in order {order['order_id']}: {absent}")
    return [in_order[i] for i in item_ids]


def _net_paid(order: dict[str, Any]) -> float:
    signed = (t["amount"] if t["transaction_type"] == "payment" else -t["amount"] for t in order["payment_history"])
    return round(sum(signed), 2)


def _transaction(kind: str, amount: float, method_id: str) -> dict[str, Any]:
    return {"transaction_type": kind, "amount": amount, "payment_method_id": method_id}
