"""The served-name grammar (protocol/names.py): `run` is a run's latest step, `run@N` its step N."""

import pytest

from protocol.names import names_run, policy_name, run_of, split_policy

pytestmark = pytest.mark.unit


def test_a_step_name_round_trips():
    assert policy_name("legs", 3) == "legs@3"
    assert split_policy(policy_name("legs", 3)) == ("legs", 3)
    assert split_policy("legs") == ("legs", None)


def test_a_name_without_a_step_number_names_no_step():
    assert split_policy("legs@latest") == ("legs@latest", None)
    assert split_policy("@3") == ("@3", None)
    assert split_policy("legs@") == ("legs@", None)


def test_the_run_a_name_belongs_to():
    assert run_of("legs@12") == "legs" and run_of("legs") == "legs"
    assert names_run("legs@2", "legs") and names_run("legs", "legs")
    assert not names_run("legs2@1", "legs") and not names_run("other@1", "legs")
