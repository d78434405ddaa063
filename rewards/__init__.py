"""Reward helpers for environments: final database state, required outputs, tool-call actions.

The RULER-style group judge lives in `rewards.ruler` and is imported from there, not here, so
that the plain helpers stay free of its dependencies.
"""

from rewards.actions import Action, ActionComparison, actions_match, compare_actions, extract_actions
from rewards.outputs import OutputsCheck, check_outputs, contains_output, normalize_text
from rewards.state import StateComparison, compare_states, state_hash

__all__ = [
    "Action",
    "ActionComparison",
    "OutputsCheck",
    "StateComparison",
    "actions_match",
    "check_outputs",
    "compare_actions",
    "compare_states",
    "contains_output",
    "extract_actions",
    "normalize_text",
    "state_hash",
]
