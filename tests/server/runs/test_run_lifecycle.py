"""A run's creation and deletion, as the routes call them (server/runs/facade.py's Runs.create and
Runs.delete): the name is claimed before the run is made and given back when it is not, and a
deleted run leaves nothing behind, neither files nor stored rows nor its owner's claim on the name.
On the embedded model's server state; the HTTP answers each refusal maps to are tests/server/api/test_tenants.py's."""

from __future__ import annotations

import pytest

from protocol.config import RunSpec
from server.app import build_state
from server.runs.base_models import NameCaseConflict
from server.runs.ownership import Caller, NameTaken, RunLimit
from server.settings import Settings

ADMIN, ALICE, BOB = Caller(None, "admin"), Caller("alice", "key-a"), Caller("bob", "key-b")


@pytest.fixture
def state(tmp_path):
    state = build_state(Settings(data_dir=tmp_path / "data", device="cpu"))
    yield state
    state.store.close()


def test_a_run_is_its_creators_and_a_refused_creation_gives_its_name_back(state):
    runs = state.runs
    run, created = runs.create(RunSpec(name="a1"), ALICE, max_runs=2)
    assert created and runs.owners.owner("a1") == "alice"
    assert runs.create(RunSpec(name="a1"), ALICE, max_runs=2) == (run, False)  # asked again: the same run
    with pytest.raises(NameTaken):
        runs.create(RunSpec(name="a1"), BOB, max_runs=2)
    with pytest.raises(NameCaseConflict):  # refused after the claim: the claim goes with it
        runs.create(RunSpec(name="A1"), BOB, max_runs=1)
    assert runs.owners.owner("A1") is None
    assert runs.create(RunSpec(name="b1"), BOB, max_runs=1)[1]  # so Bob's one run is still his to make
    with pytest.raises(RunLimit):
        runs.create(RunSpec(name="b2"), BOB, max_runs=1)
    assert runs.owners.owner("b2") is None and [r.name for r in runs.all()] == ["a1", "b1"]


def test_a_tenant_never_takes_over_a_run_whose_owner_is_not_recorded(state):
    runs = state.runs
    runs.create(RunSpec(name="old"), ADMIN, max_runs=1)
    runs.owners.release("old")  # a run from before tenant keys, or whose store row was lost: the admin's
    with pytest.raises(NameTaken):
        runs.create(RunSpec(name="old"), ALICE, max_runs=1)
    assert "old" not in [r["name"] for r in state.store.runs.all()] and runs.owners.owner("old") is None
    assert runs.create(RunSpec(name="mine"), ALICE, max_runs=1)[1]  # the refused claim did not count
    assert not runs.create(RunSpec(name="old"), ADMIN, max_runs=1)[1]  # the admin still has it


def test_a_deleted_run_leaves_no_files_rows_or_claim_and_its_name_is_free(state):
    runs, cancelled = state.runs, []
    run, _ = runs.create(RunSpec(name="gone"), ALICE, max_runs=1)
    runs.land(run, 1, {"kind": "rl"})
    state.store.steps.put("gone", 1, "rl", {"loss": 0.5}, [], [])
    assert run.dir.exists() and state.store.steps.of("gone")
    runs.forget(run)
    with pytest.raises(NameTaken):  # still being deleted: nobody else may take the name yet
        runs.create(RunSpec(name="gone"), BOB, max_runs=1)
    runs.delete(run, cancelled.append)
    assert cancelled == ["gone"] and not run.dir.exists()
    assert state.store.steps.of("gone") == [] and state.store.runs.all() == []
    assert runs.owners.owner("gone") is None
    again, created = runs.create(RunSpec(name="gone"), BOB, max_runs=1)
    assert created and again is not run and again.step == 0 and runs.owners.owner("gone") == "bob"
    assert runs.create(RunSpec(name="other"), ALICE, max_runs=1)[1]  # Alice's place in the count is free
