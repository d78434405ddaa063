"""The environment reward helpers: database state, required outputs, tool-call actions."""

import copy
import json

import pytest
from openai.types.chat.chat_completion import Choice

from rewards import (
    Action,
    actions_match,
    check_outputs,
    compare_actions,
    compare_states,
    contains_output,
    extract_actions,
    normalize_text,
    state_hash,
)

pytestmark = pytest.mark.unit

DB = {
    "orders": {
        "O123": {"status": "pending", "items": ["a", "b"], "total": 10.0},
        "O124": {"status": "delivered", "items": ["c"], "total": 5},
    },
    "events": [{"kind": "created", "order": "O123"}, {"kind": "created", "order": "O124"}],
}


# --- state ---------------------------------------------------------------------------------


def test_identical_states_match_regardless_of_key_and_list_order_and_number_spelling():
    reordered = {
        "events": list(reversed(DB["events"])),
        "orders": {
            "O124": {"total": 5.0, "items": ["c"], "status": "delivered"},
            "O123": {"items": ["b", "a"], "status": "pending", "total": 10},
        },
    }
    result = compare_states(reordered, DB)
    assert result.match and result.diff == []
    assert result.records_match_fraction == 1.0
    assert state_hash(reordered) == state_hash(DB)


def test_changed_field_is_a_readable_diff_line_and_partial_credit():
    actual = copy.deepcopy(DB)
    actual["orders"]["O123"]["status"] = "pending"
    expected = copy.deepcopy(DB)
    expected["orders"]["O123"]["status"] = "cancelled"
    result = compare_states(actual, expected)
    assert not result.match
    assert result.diff == ["orders/O123.status: expected 'cancelled', got 'pending'"]
    # 4 records (2 orders, 2 events), 3 equal.
    assert (result.records_matched, result.records_total) == (3, 4)
    assert result.records_match_fraction == 0.75
    assert state_hash(actual) != state_hash(expected)


def test_missing_and_unexpected_records_and_fields():
    actual = copy.deepcopy(DB)
    del actual["orders"]["O124"]
    actual["orders"]["O999"] = {"status": "pending"}
    actual["orders"]["O123"]["note"] = "hi"
    del actual["orders"]["O123"]["total"]
    result = compare_states(actual, DB)
    assert "orders/O124: missing (expected {'status': 'delivered', 'items': ['c'], 'total': 5})" in result.diff
    assert "orders/O999: unexpected record {'status': 'pending'}" in result.diff
    assert "orders/O123.note: unexpected 'hi'" in result.diff
    assert "orders/O123.total: missing (expected 10.0)" in result.diff
    assert result.records_matched == 2  # the two events
    assert result.records_total == 5  # O123, O124, O999 and two events


def test_list_tables_compare_as_multisets():
    actual = copy.deepcopy(DB)
    actual["events"].append({"kind": "created", "order": "O123"})  # a duplicate is a difference
    result = compare_states(actual, DB)
    assert not result.match
    assert result.diff == ['events[]: unexpected record {"kind":"created","order":"O123"}']
    assert (result.records_matched, result.records_total) == (4, 5)


def test_missing_table_is_reported():
    actual = {"orders": DB["orders"]}
    result = compare_states(actual, DB)
    assert not result.match
    assert result.diff[0] == "events: table missing"
    assert result.records_total == 4 and result.records_matched == 2


def test_baseline_leaves_untouched_records_out_of_partial_credit():
    expected = copy.deepcopy(DB)
    expected["orders"]["O123"]["status"] = "cancelled"
    did_nothing = compare_states(DB, expected, baseline=DB)
    assert did_nothing.records_match_fraction == 0.0 and did_nothing.records_total == 1
    did_it = compare_states(copy.deepcopy(expected), expected, baseline=DB)
    assert did_it.match and did_it.records_match_fraction == 1.0
    # Touching another record counts it too.
    wrong = copy.deepcopy(expected)
    wrong["orders"]["O124"]["status"] = "cancelled"
    result = compare_states(wrong, expected, baseline=DB)
    assert (result.records_matched, result.records_total) == (1, 2)


def test_empty_states_match_fully():
    result = compare_states({}, {})
    assert result.match and result.records_match_fraction == 1.0


def test_diff_is_capped():
    actual = {"t": {str(i): {"v": i} for i in range(10)}}
    expected = {"t": {str(i): {"v": -i - 1} for i in range(10)}}
    result = compare_states(actual, expected, max_diff_lines=3)
    assert len(result.diff) == 4 and result.diff[-1] == "... and 7 more differences"


def test_state_hash_is_a_stable_sha256():
    assert state_hash({"a": [1, 2]}) == state_hash({"a": [2, 1]})
    assert state_hash({"a": [1, 2]}) != state_hash({"a": [1, 3]})
    assert len(state_hash({})) == 64


# --- outputs -------------------------------------------------------------------------------


def test_outputs_case_insensitive_and_fraction():
    result = check_outputs("Your order was DELIVERED on Monday.", ["delivered", "monday", "tuesday"])
    assert result.found == ["delivered", "monday"]
    assert result.missing == ["tuesday"]
    assert result.fraction == pytest.approx(2 / 3)
    assert not result.all_found


def test_outputs_tolerate_thousands_separators_and_trailing_zeros():
    assert contains_output("The total is $1,234.50.", "1234.5")
    assert contains_output("The total is $1234.5", "1,234.50")
    assert contains_output("It costs 1,000,000 dollars", "1000000")
    assert contains_output("It costs $54.00", "54")


def test_outputs_do_not_match_inside_longer_numbers():
    assert not contains_output("The total is $254.10", "54.1")
    assert not contains_output("The total is 54.15", "54.1")
    assert not contains_output("item 12345", "1234")
    assert contains_output("Refund: 54.1.", "54.1")


def test_outputs_over_several_answers_and_nothing_required():
    assert check_outputs(["first answer: 12", "second: blue"], ["12", "blue"]).all_found
    empty = check_outputs("anything", [])
    assert empty.all_found and empty.fraction == 1.0


def test_normalize_text_leaves_non_numbers_alone():
    assert normalize_text("  Hello,   World 1,2,3 v1.2.3 ") == "hello, world 1,2,3 v1.2.3"


# --- actions -------------------------------------------------------------------------------

CANCEL = {"name": "cancel", "arguments": {"order_id": "O1", "reason": "mistake"}}
RETURN = {"name": "return", "arguments": {"order_id": "O2", "item_ids": ["a", "b"]}}


def test_exact_and_unordered_match():
    assert actions_match([CANCEL, RETURN], [CANCEL, RETURN])
    assert not actions_match([RETURN, CANCEL], [CANCEL, RETURN])
    assert actions_match([RETURN, CANCEL], [CANCEL, RETURN], ordered=False)
    # Argument key order and int/float spelling do not matter.
    respelled = {"name": "cancel", "arguments": {"reason": "mistake", "order_id": "O1"}}
    assert actions_match([respelled], [CANCEL])
    assert actions_match([{"name": "pay", "arguments": {"amount": 5}}], [{"name": "pay", "arguments": {"amount": 5.0}}])
    assert not actions_match([{"name": "pay", "arguments": {"amount": 5}}], [{"name": "refund", "arguments": {"amount": 5}}])


def test_list_arguments_keep_their_order():
    swapped = {"name": "return", "arguments": {"order_id": "O2", "item_ids": ["b", "a"]}}
    assert not actions_match([swapped], [RETURN], ordered=False)


def test_precision_recall_f1():
    extra = {"name": "cancel", "arguments": {"order_id": "O9", "reason": "mistake"}}
    result = compare_actions([CANCEL, extra], [CANCEL, RETURN])
    assert result.matched == 1
    assert result.precision == 0.5 and result.recall == 0.5 and result.f1 == 0.5
    assert [a.arguments["order_id"] for a in result.unexpected] == ["O9"]
    assert [a.name for a in result.missing] == ["return"]


def test_duplicates_count_once_each():
    result = compare_actions([CANCEL, CANCEL], [CANCEL])
    assert result.matched == 1 and result.precision == 0.5 and result.recall == 1.0
    assert not result.unordered_match


def test_no_actions_edge_cases():
    nothing = compare_actions([], [])
    assert nothing.exact_match and nothing.f1 == 1.0
    missed = compare_actions([], [CANCEL])
    assert missed.precision == 1.0 and missed.recall == 0.0 and missed.f1 == 0.0
    spurious = compare_actions([CANCEL], [])
    assert spurious.precision == 0.0 and spurious.recall == 1.0 and not spurious.exact_match


def _call(name, arguments, call_id="c1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_extract_actions_from_openai_messages():
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": None, "tool_calls": [_call("return", json.dumps(RETURN["arguments"]), "c3")]},
        }
    )
    messages = [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "cancel O1", "tool_calls": [_call("cancel", "{}")]},  # not the assistant's
        {"role": "assistant", "content": None, "tool_calls": [_call("cancel", json.dumps(CANCEL["arguments"]))]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "Done."},
        choice,
        {"role": "assistant", "content": None, "tool_calls": [_call("cancel", "{not json", "c4"), _call("ping", "", "c5")]},
    ]
    actions = extract_actions(messages)
    assert [a.name for a in actions] == ["cancel", "return", "cancel", "ping"]
    assert actions[0] == Action(**CANCEL)
    assert actions[2].arguments is None and actions[2].raw_arguments == "{not json"
    assert actions[3].arguments == {}
    # A Choice that travelled over HTTP as a dict reads the same.
    assert extract_actions([choice.model_dump()]) == extract_actions([choice]) == [Action(**RETURN)]


def test_unparsable_arguments_never_match():
    bad = extract_actions([{"role": "assistant", "tool_calls": [_call("cancel", "[1, 2]")]}])
    assert bad[0].arguments is None
    result = compare_actions(bad, [CANCEL])
    assert result.matched == 0 and result.precision == 0.0
    assert compare_actions(bad, bad).matched == 0  # not even with itself
