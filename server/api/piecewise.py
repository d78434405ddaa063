"""A large body's models validated one list item at a time, deepest lists first.

pydantic-core validates a whole body in one call that holds the GIL: 0.3-0.5 s for a 20 MiB
training job, during which the event loop answers nobody, even with the call in a worker thread.
Item by item, the longest call is one trajectory's (under a millisecond), and between items the
interpreter can hand the GIL to the loop. The body's own validation then runs as before, on a
value whose items are already instances of their models (which pydantic takes as they are), so
its validators and its errors are the same: an item that does not validate is left as it came,
and the whole body's validation reports it at its place.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError


def list_item_model(annotation: Any) -> type[BaseModel] | None:
    """M for a field annotated list[M] with M a pydantic model; None otherwise."""
    if typing.get_origin(annotation) is not list:
        return None
    (item,) = typing.get_args(annotation) or (None,)
    return item if isinstance(item, type) and issubclass(item, BaseModel) else None


def body_model(annotation: Any, discriminator: str | None, value: Any) -> type[BaseModel] | None:
    """The model a body validates as: its annotation's, or, for a union told apart by a field
    (a discriminated union), the member whose tag the body's field holds; None when it is neither."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if not discriminator or typing.get_origin(annotation) not in (typing.Union, types.UnionType) \
            or not isinstance(value, dict):
        return None
    for member in typing.get_args(annotation):
        field = getattr(member, "model_fields", {}).get(discriminator)
        if field is not None and value.get(discriminator) in typing.get_args(field.annotation):
            return member
    return None


@functools.cache
def model_lists(model: type[BaseModel]) -> tuple[tuple[str, type[BaseModel]], ...]:
    """(JSON key, item model) of each list-of-models field of `model`: read once per model, not per item."""
    return tuple((field.alias or name, item) for name, field in model.model_fields.items()
                 if (item := list_item_model(field.annotation)) is not None)


def prevalidated(model: type[BaseModel], value: Any) -> Any:
    """`value` (parsed JSON meant for `model`) with the items of each list-of-models field replaced,
    in place, by their validated instances; anything else left as it is."""
    if not isinstance(value, dict):
        return value
    for key, item_model in model_lists(model):
        items = value.get(key)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            item = prevalidated(item_model, item)
            try:
                items[i] = item_model.model_validate(item)
            except ValidationError:
                items[i] = item
    return value
