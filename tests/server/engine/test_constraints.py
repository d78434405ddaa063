"""`closed`: an object schema that lists its properties admits no others unless it says so, as
xgrammar and outlines read JSON Schema (vLLM's default); what a schema states is kept as stated."""

from __future__ import annotations

import copy

import pytest

from server.engine.constraints import closed

pytestmark = pytest.mark.unit


def test_every_object_that_lists_properties_is_closed_wherever_it_nests():
    item = {"type": "object", "properties": {"sku": {"type": "string"}}}
    order = {"type": "object", "properties": {"items": {"type": "array", "items": item}}}
    schema = {"type": "object", "properties": {"order": order, "either": {"anyOf": [item, {"type": "string"}]},
                                               "ref": {"$ref": "#/$defs/a"}},
              "$defs": {"a": {"type": "object", "properties": {"n": {"type": "integer"}}}}}
    before = copy.deepcopy(schema)
    out = closed(schema)
    assert schema == before  # the caller's schema is not changed
    assert out["additionalProperties"] is False
    order = out["properties"]["order"]
    assert order["additionalProperties"] is False
    assert order["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["a"]["additionalProperties"] is False


def test_what_a_schema_states_is_kept_and_an_object_without_properties_stays_open():
    stated = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert closed(stated) == stated
    patterned = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x-": {}}}
    assert closed(patterned) == patterned
    assert closed({"type": "object"}) == {"type": "object"}  # json_object: any object
    # a property named like a keyword, and values that are data, not schemas, are left alone
    named = {"type": "object", "properties": {"properties": {"type": "string"}},
             "default": {"properties": {"x": 1}}, "enum": [{"properties": {}}]}
    out = closed(named)
    assert out["properties"] == {"properties": {"type": "string"}}
    assert out["default"] == {"properties": {"x": 1}} and out["enum"] == [{"properties": {}}]
    assert out["additionalProperties"] is False
