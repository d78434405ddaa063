"""A request's one door to the runs (server/runs/facade.py's Runs.acquire; a route's is Runs.find,
with the same rule): the policy a model name serves is held from the moment the name resolves, so no
unload comes between finding an adapter and decoding with it; another tenant's run is a name that
does not exist; a request cancelled while its name resolves lets go of what the resolving thread
took. On the embedded model's server state, with steps landed as training lands them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from protocol.config import RunSpec
from server.app import build_state
from server.runs.facade import NotServed
from server.runs.ownership import Caller
from server.runs.served_steps import SERVED_SNAPSHOTS
from server.sampling.engine_requests import acquire_policy
from server.sampling.served_names import ServedModels
from server.settings import Settings
from server.training.jobs import found

ADMIN = Caller(None, "admin")


@pytest.fixture
def state(tmp_path):
    state = build_state(Settings(data_dir=tmp_path / "data", device="cpu"))
    yield state
    state.store.close()


def run_with_steps(state, name: str, steps: int, owner: str | None = None):
    run, _ = state.runs.create(RunSpec(name=name), Caller(owner, digest=""), max_runs=10)
    for step in range(1, steps + 1):
        state.runs.land(run, step, {"kind": "rl"})
    return run


def test_a_held_step_stays_loaded_past_the_steps_that_unload_it_and_goes_once_let_go(state):
    run = run_with_steps(state, "held", 1)
    policy = state.runs.acquire("held@1", ADMIN)
    for step in range(2, SERVED_SNAPSHOTS + 3):  # each publish unloads the steps past the newest few
        state.runs.land(run, step, {"kind": "rl"})
    state.runs.retain(run, set())  # as a client that samples from no older step asks
    assert 1 in run.snapshots and state.served.resolve("held@1") == policy
    assert 2 not in run.snapshots  # a step no request held is gone

    state.runs.release(policy)
    state.runs.retain(run, set())
    assert 1 not in run.snapshots and state.served.resolve("held@1") is None
    again = state.runs.acquire("held@1", ADMIN)  # an unloaded step loads from its checkpoint, held
    assert again.step == 1 and again.adapter == run.snapshots[1] and state.served.in_use(again.adapter)
    state.runs.release(again)
    assert not state.served.in_use(again.adapter)


@pytest.mark.unit
def test_a_name_is_withdrawn_only_while_no_request_holds_its_adapter():
    served = ServedModels("base", {"base-alias"})
    served.publish("r", 1, "a1", latest=False)
    held = served.acquire("r@1")
    assert held is not None and served.in_use("a1")
    assert not served.withdraw_idle("r@1", "a1") and served.resolve("r@1") == held  # held: it stays
    served.release(held)
    assert served.withdraw_idle("r@1", "a1")
    assert served.acquire("r@1") is None and not served.in_use("a1")  # withdrawn: no request takes it
    assert served.acquire("base-alias") == served.base  # the base model is never withdrawn nor held


def test_another_tenants_run_is_a_name_that_does_not_exist(state):
    run = run_with_steps(state, "mine", 1, owner="a")
    with pytest.raises(NotServed):  # a route's door (Runs.find) keeps the same rule as a request's
        state.runs.find("mine", Caller("b", "key-b"))
    assert state.runs.find("mine", Caller("a", "key-a")) is state.runs.find("mine") is run
    with pytest.raises(NotServed):
        state.runs.find("nobody")
    assert found(state.runs, "mine") is run and found(state.runs, "nobody") is None  # the job worker's
    for name in ("mine", "mine@1"):
        with pytest.raises(NotServed):
            state.runs.acquire(name, Caller("b", "key-b"))
        for who in (Caller("a", "key-a"), ADMIN):
            policy = state.runs.acquire(name, who)
            assert (policy.run, policy.step) == ("mine", 1)
            state.runs.release(policy)
    assert state.runs.acquire(state.host.name, Caller("b", "key-b")).adapter is None  # the base model: everyone's
    with pytest.raises(NotServed):
        state.runs.acquire("mine@2", ADMIN)
    state.runs.forget(run)  # a run being deleted: no route, request or queued job finds it
    for door in (lambda: state.runs.find("mine"), lambda: state.runs.acquire("mine@1", ADMIN)):
        with pytest.raises(NotServed):
            door()
    assert found(state.runs, "mine") is None


async def test_a_request_cancelled_while_its_name_resolves_lets_go_of_the_policy(state, monkeypatch):
    run = run_with_steps(state, "slow", 1)
    resolving, go_on, held = threading.Event(), threading.Event(), []
    acquire = state.runs.acquire

    def slow_acquire(model, who=None):  # as loading an older step from its checkpoint takes a while
        resolving.set()
        go_on.wait(10)
        held.append(acquire(model, who))
        return held[-1]

    monkeypatch.setattr(state.runs, "acquire", slow_acquire)
    request = asyncio.create_task(acquire_policy(state, "slow@1", ADMIN))
    assert await asyncio.to_thread(resolving.wait, 10)
    request.cancel()  # the client went away, or the server is stopping
    with pytest.raises(asyncio.CancelledError):
        await request
    go_on.set()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if held and not state.served.in_use(run.snapshots[1]):
            break
    assert held, "the resolving thread never took the policy"
    assert not state.served.in_use(run.snapshots[1]), "a cancelled request kept its policy held"
