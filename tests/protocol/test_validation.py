"""`first_problem`: a pydantic error as the field that failed first (dotted, "" for the whole object) and why."""

import pytest
from pydantic import BaseModel, ValidationError, model_validator

from protocol.validation import first_problem

pytestmark = pytest.mark.unit


class Inner(BaseModel):
    n: int


class Outer(BaseModel):
    items: list[Inner]

    @model_validator(mode="after")
    def _some(self) -> "Outer":
        if not self.items:
            raise ValueError("no items")
        return self


def _problem(data: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as e:
        Outer.model_validate(data)
    return first_problem(e.value)


def test_the_first_failing_field_is_named_by_its_dotted_path_and_a_whole_object_by_none():
    assert _problem({"items": [{"n": 1}, {"n": "x"}, {"n": "y"}]}) == (
        "items.1.n", "Input should be a valid integer, unable to parse string as an integer")
    assert _problem({"items": []}) == ("", "Value error, no items")
