"""bench/trajectory_walk.py's counting rule: entries into run-related modules from outside them,
returns inside them, distinct functions of ours; first on a planted call graph, then on real calls."""

from __future__ import annotations

import contextlib
import threading

import pytest

from client.local_server import ROOT
from tests.helpers import bench_module

pytestmark = pytest.mark.unit

bench = bench_module("trajectory_walk")
Event = bench.Event


def call(function: str, caller: str | None, thread: int = 0) -> Event:
    return Event("call", function.partition(":")[0], function, caller, thread)


def ret(function: str) -> Event:
    return Event("return", function.partition(":")[0], function)


def test_an_entry_is_a_call_into_the_set_from_outside_it_and_returns_count_inside_it():
    # A route asks the runs facade, which asks the registry (inside: no entry), then the trainer
    # commits a step that writes its rows (inside) and its trajectories (outside), and the
    # trajectories' store reads the run's rows back (an entry from outside again).
    events = [
        call("server.api.routes:create", None),
        call("server.runs.facade:Runs.get", "server.api.routes"),
        call("server.runs.registry:RunRegistry.get", "server.runs.facade"),
        ret("server.runs.registry:RunRegistry.get"),
        ret("server.runs.facade:Runs.get"),
        call("server.runs.facade:Runs.get", "server.api.routes"),
        ret("server.runs.facade:Runs.get"),
        ret("server.api.routes:create"),
        call("server.training.commit:commit_step", "server.training.jobs"),
        call("server.store.steps:Steps.put", "server.training.commit"),
        ret("server.store.steps:Steps.put"),
        call("server.store.trajectories:rows", "server.training.commit"),
        call("server.store.runs:Runs.row", "server.store.trajectories"),
        ret("server.store.runs:Runs.row"),
        ret("server.store.trajectories:rows"),
        ret("server.training.commit:commit_step"),
        call("server.runs.facade:Runs.resolve", None),  # asyncio.to_thread: no caller of ours on its stack
        ret("server.runs.facade:Runs.resolve"),
        call("server.store.runsheet:load", "server.api.routes"),  # a name that only starts like one
    ]
    counts = bench.count_walk(events)
    assert counts["entries"] == {"server.runs.facade": 3, "server.training.commit": 1, "server.store.runs": 1}
    assert counts["entered_from"]["server.runs.facade"] == {"server.api.routes": 2, bench.NO_CALLER: 1}
    assert counts["entered_from"]["server.store.runs"] == {"server.store.trajectories": 1}
    assert counts["max_entries"] == 3
    assert counts["run_returns"] == 7
    assert counts["functions"] == 9


def test_a_reader_reads_each_function_once_and_counts_doors_moves_and_returns_per_thread():
    # Thread 1: the client leaves its module for a helper and comes back (a return), then a request
    # takes its one door to the runs from a thread hop, twice: the second time is the same door.
    # Thread 2: the job worker numbers an attempt and commits it, two doors into commit; commit's own
    # call into the run is inside the set, and the path's way back into commit is a run-related return.
    events = [
        call("client.a:f", None, 1),
        call("protocol.x:g", "client.a", 1),
        call("client.a:h", "client.a", 1),
        call("server.runs.facade:Runs.acquire", None, 1),
        ret("server.runs.facade:Runs.acquire"),
        call("server.runs.facade:Runs.acquire", None, 1),
        call("server.training.jobs:run", None, 2),
        call("server.training.commit:next_attempt", "server.training.jobs", 2),
        call("server.runs.run:Run.next_step", "server.training.commit", 2),
        call("server.training.commit:commit_step", "server.training.jobs", 2),
        call("client.a:f", None, 2),  # read already, on thread 1
    ]
    read = bench.read_walk(events)
    assert read["doors"] == {"server.training.commit": 2, "server.runs.facade": 1}
    assert read["max_doors"] == 2
    assert (read["moves"], read["returns"], read["run_returns"], read["modules"]) == (6, 2, 1, 6)
    assert (read["functions"], read["returns_per_function"]) == (8, 0.25)


def test_the_same_path_read_by_package_and_by_top_package_keeps_only_the_returns_between_them():
    # Back into steps after advantages is a return between modules of one package; back into the
    # runs after the trainer is one between packages too; back into server after protocol is one
    # between top-level packages. The facade after run is a new module of a package already left.
    functions = ["server.runs.run:a", "server.training.steps:b", "server.training.advantages:c",
                 "server.training.steps:d", "server.runs.run:e", "protocol.names:f", "server.runs.facade:g",
                 "server.runs.run:h"]
    read = bench.read_walk([call(f, None) for f in functions])
    assert read["returns"] == 3
    assert read["returns_one_module_per_package"] == 2
    assert read["returns_one_module_per_top_package"] == 1
    assert bench.package_of("server.runs.facade") == bench.package_of("server.runs") == "server.runs"
    assert bench.package_of("server.faults") == "server"


def test_a_functions_comprehensions_and_closures_are_read_with_it_not_as_returns():
    # f calls a helper elsewhere, then its own list comprehension and a closure run: the reader read
    # both with f. A new function of f's module after the helper is a return, as before.
    events = [
        call("client.a:f", None),
        call("protocol.x:g", "client.a"),
        call("client.a:f.<locals>.<listcomp>", "client.a"),
        call("client.a:f.<locals>.inner.<locals>.<genexpr>", "client.a"),
    ]
    assert bench.read_walk(events)["returns"] == 0
    assert bench.read_walk([*events, call("client.a:h", "client.a")])["returns"] == 1
    assert bench.outermost("client.a:C.m.<locals>.<lambda>") == "client.a:C.m"


def test_real_calls_into_served_names_count_from_the_nearest_caller_of_ours_or_from_a_thread():
    from server.sampling.served_names import ServedModels

    tracer = bench.Tracer()
    with tracer.installed():  # before the thread starts, as the bench installs it before the server's threads
        tracer.active = True
        served = ServedModels("base", set())
        served.publish("run", 1, "adapter-1", latest=True)  # calls protocol.names.policy_name: outside, no entry
        with contextlib.ExitStack() as stack:  # contextlib's frames between the test and the call: still the test's
            stack.callback(served.resolve, "run")
        worker = threading.Thread(target=served.resolve, args=("run@1",))
        worker.start()
        worker.join()
    counts = bench.count_walk(tracer.events)
    assert counts["entries"] == {"server.sampling.served_names": 4}
    assert counts["entered_from"]["server.sampling.served_names"] == {"tests.bench.test_trajectory_walk": 3,
                                                                      bench.NO_CALLER: 1}
    assert counts["run_returns"] == 4  # __init__, publish, resolve twice; policy_name's returns are outside
    assert {e.function for e in tracer.events} == {
        "server.sampling.served_names:ServedModels.__init__", "server.sampling.served_names:ServedModels.publish",
        "server.sampling.served_names:ServedModels.resolve", "protocol.names:policy_name"}


def counting_up():
    yield 1
    yield 2


def test_a_generator_starts_and_returns_once_however_often_it_yields():
    tracer = bench.Tracer()
    with tracer.installed():
        tracer.active = True
        assert list(counting_up()) == [1, 2]
        tracer.active = False
    assert [e.kind for e in tracer.events if e.function.endswith(":counting_up")] == ["call", "return"]


def test_only_this_repositorys_files_outside_hidden_trees_are_ours():
    assert bench.module_of(str(ROOT / "server" / "runs" / "facade.py")) == "server.runs.facade"
    assert bench.module_of(str(ROOT / "server" / "runs" / "__init__.py")) == "server.runs"
    assert bench.module_of(str(ROOT / ".venv" / "lib" / "httpx" / "_client.py")) is None
    assert bench.module_of(str(ROOT / "bench" / "trajectory_walk.py")) is None  # the harness is not the walk
    assert bench.module_of("/usr/lib/python3.11/threading.py") is None
    assert bench.module_of("<string>") is None


def test_a_baseline_that_names_no_commit_is_refused_in_one_line_before_any_walk():
    with pytest.raises(SystemExit) as refused:
        bench.commit_of("no-such-revision")
    assert str(refused.value) == f"error: --baseline no-such-revision: no such commit in {ROOT}"
